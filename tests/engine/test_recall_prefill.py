# SPDX-License-Identifier: Apache-2.0
"""``recall.prefill: all``: every prefill chunk of a recall request attends to its window and to
the tokens its compactions dropped into the tier, so the prompt is computed as without eviction
while vLLM's pool holds only the window.

Shown on vLLM's own prompt logprobs (each prompt token's logprob given the tokens before it, computed
by the prefill chunks): with ``prefill: all`` they equal those of the same prompt with eviction off,
on the same server, at every position, and so does the first answer token; with plain chunked
eviction (``kvevict_recall: false`` on the same server) they part from them after the first
compaction, so the comparison can fail. The request's peak stays within its window bound."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.engine.evict_common import TOL, complete, make_prompt, pool_server, released_line
from vllm_kvevict.window import WindowConfig, first_boundary, window_bound_blocks

pytestmark = [pytest.mark.engine, pytest.mark.timeout(1200)]

BUDGET, BS, CHUNK, POOL = 96, 32, 64, 64
BOUND = window_bound_blocks(WindowConfig(BUDGET, BS), CHUNK)
FIRST = first_boundary(WindowConfig(BUDGET, BS))  # the first compaction point (192)
SERVER = {"policy": "keydiff", "budget": BUDGET, "recall": {"enabled": True, "prefill": "all"}}
PROMPT_LOGPROBS = {"prompt_logprobs": 0}


@pytest.fixture(scope="module")
def server(gqa_model, tmp_path_factory):
    base = tmp_path_factory.mktemp("recall-prefill")
    extra = ["--enable-log-requests", "--no-enable-prefix-caching"]
    env = {"KVEVICT_PROFILE_DIR": str(base / "profile")}
    with pool_server(
        gqa_model, base, SERVER, pool=POOL, chunk=CHUNK, max_len=4096, extra=extra, env=env, dump=False
    ) as srv:
        srv.profile_dir = base / "profile"  # type: ignore[attr-defined]
        yield srv


def _steps(server) -> list[dict]:
    """The worker's step records so far (``KVEVICT_PROFILE_DIR``: one line per model step)."""
    return [
        json.loads(ln) for f in sorted(server.profile_dir.glob("steps-*.jsonl")) for ln in f.read_text().splitlines()
    ]


def _diffs(a: dict, b: dict) -> list[float]:
    return [abs(x - y) for x, y in zip(a["prompt_logprobs"][1:], b["prompt_logprobs"][1:])]


@pytest.mark.parametrize("length", [700, 1300])
def test_the_prompt_is_computed_as_without_eviction(server, vocab, length):
    prompt = make_prompt(length, length, vocab)
    stock = complete(server, prompt, 4, {"kvevict_enabled": False}, PROMPT_LOGPROBS)
    with ThreadPoolExecutor(2) as pool:  # sent together: whether or not they share steps, each must equal
        outs = list(pool.map(lambda _: complete(server, prompt, 4, None, PROMPT_LOGPROBS), range(2)))
    for out in outs:
        assert len(out["prompt_logprobs"]) == length
        assert max(_diffs(out, stock)) < TOL
        assert out["tokens"][0] == stock["tokens"][0]
        assert abs(out["logprobs"][0] - stock["logprobs"][0]) < TOL
        line = released_line(server, out["id"])
        assert line[1] > 0 and line[2] <= BOUND  # it evicted, within its window bound
    plain = complete(server, prompt, 4, {"kvevict_recall": False}, PROMPT_LOGPROBS)
    d = _diffs(plain, stock)
    assert max(d[:FIRST]) < TOL  # tokens computed before the first compaction: the same
    assert max(d) > 100 * TOL  # after it, chunks that attend to the window alone do


def test_a_step_of_recalled_chunks_alone_runs_no_vllm_attention(server, gqa_model, vocab):
    """A step whose every row is a prompt chunk that recall computes over its window and tier does
    not run vLLM's attention over the window as well (vLLM wrote its K/V before the attention):
    alone, a 700-token prompt's chunks after its first compaction, in every layer, and its prompt
    logprobs are still those without eviction."""
    layers = json.loads((gqa_model / "config.json").read_text())["num_hidden_layers"]
    prompt = make_prompt(700, 70, vocab)
    stock = complete(server, prompt, 1, {"kvevict_enabled": False}, PROMPT_LOGPROBS)
    seen = len(_steps(server))
    out = complete(server, prompt, 1, None, PROMPT_LOGPROBS)
    steps = _steps(server)[seen:]
    replaced = [st for st in steps if st.get("attention_replaced")]
    # the steps computing [192, 700): the tier holds what the compaction at 192 dropped
    assert sum(st["tokens"] for st in replaced) == 700 - FIRST, steps
    assert all(st["attention_replaced"] == layers and not st.get("attn_s") for st in replaced), replaced
    assert all(st.get("attn_s") for st in steps if st not in replaced)  # the others ran vLLM's
    assert max(_diffs(out, stock)) < TOL
