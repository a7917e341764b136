# SPDX-License-Identifier: Apache-2.0
"""Every policy in the engine equals a transformers reference that makes the same decisions.

One server (tiny GQA Llama, float32, chunks of 64 tokens); each request picks its policy (and
parameters) per request. The engine dumps what it kept at every compaction; the reference
(vllm_kvevict/testing/hf_reference.py) replays the request in transformers, recomputes each
decision from its own queries, keys, values, per-entry state and ``o_proj`` with the policy, checks
it against the engine's kept set, and must give the same greedy tokens with logprobs within 1e-4.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.engine.evict_common import check_against_reference, complete, make_prompt, server_args
from vllm_kvevict.config import parse_config, request_config, request_overrides
from vllm_kvevict.testing.hf_reference import load_attempts
from vllm_kvevict.testing.server import VLLMServer

pytestmark = [pytest.mark.engine, pytest.mark.timeout(1200)]

BUDGET = 80
MAX_TOKENS = 100  # crosses a decode-time compaction point (every 96 tokens) for the policies that evict while decoding
SERVER = {"policy": "keydiff", "budget": BUDGET}

CASES = [
    ("snapkv", None),
    ("snapkv", {"pooling": "max"}),
    ("tova", None),
    ("h2o", None),
    ("h2o", {"recent_tokens": 8}),
    ("knorm", None),
    ("random", {"seed": 3}),
    ("criticalkv", None),
    ("criticalkv", {"base": "h2o"}),
    ("kvmerger", None),
    ("kvmerger", {"threshold": 0.0}),
    ("lshe", None),
    ("lshe", {"hash": "key", "bits": 8}),
    ("caote", None),
    ("caote", {"base": "tova"}),
    ("caote", {"base": "snapkv"}),
    ("fastcaote", None),
]


def test_every_policy_equals_reference(gqa_model, hf_model, tmp_path, server_log):
    dump = tmp_path / "dump"
    args = server_args(SERVER, "--max-model-len", "2048", "--max-num-batched-tokens", "64", "--max-num-seqs", "4")
    vocab = hf_model.config.vocab_size
    server = parse_config({**SERVER})

    def run(i_case):
        i, (policy, params) = i_case
        xargs = {"kvevict_policy": policy, **({"kvevict_params": json.dumps(params)} if params else {})}
        return complete(srv, make_prompt(230 + 13 * i, 10 + i, vocab), MAX_TOKENS, xargs)

    with VLLMServer(gqa_model, args, log_path=server_log("policies"), env={"KVEVICT_DUMP_DIR": str(dump)}) as srv:
        with ThreadPoolExecutor(3) as pool:
            outs = list(pool.map(run, enumerate(CASES)))
    attempts = load_attempts(dump)
    failures = []
    for (policy, params), out in zip(CASES, outs, strict=True):
        xargs = {"kvevict_policy": policy, **({"kvevict_params": json.dumps(params)} if params else {})}
        cfg = request_config(server, request_overrides(xargs))
        try:
            atts = check_against_reference(hf_model, out, attempts, True, config=cfg)
        except AssertionError as e:
            failures.append(f"{policy} {params}: {e}")
            continue
        P = len(out["prompt"])
        events = [L for a in atts for L in a.events]
        if cfg.effective_trigger == "once":
            assert events == [P], f"{policy}: one compaction when the prompt completes, got {events}"
        else:
            # at the compaction points (multiples of the stride, 96), in the prompt and while decoding
            assert any(L <= P for L in events) and any(L > P for L in events), f"{policy}: {events}"
            assert all(L % 96 == 0 for L in events), f"{policy}: {events}"
    assert not failures, "\n".join(failures)
    # The check can fail: the snapkv request's decisions are not TOVA's or H2O's.
    snap = outs[0]
    for wrong in ("tova", "keydiff"):
        cfg = request_config(server, request_overrides({"kvevict_policy": wrong}))
        with pytest.raises(AssertionError, match="kept sets differ"):
            check_against_reference(hf_model, snap, attempts, True, config=cfg)
