# SPDX-License-Identifier: Apache-2.0
"""The worked example of docs/architecture.md ("Adding a policy") is complete, short, and runs
through the engine's eviction step as written: a new policy is its file."""

from __future__ import annotations

import re
import types
from pathlib import Path

import torch

from tests.test_evict_step import BS, COMPACT, _setup
from vllm_kvevict.backends import flash_layout as flash_cache
from vllm_kvevict.backends.evict import RowWork, evict_step
from vllm_kvevict.policies import KVView, Policy
from vllm_kvevict.policies.base import topk_newer

DOC = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"


def example_module() -> types.ModuleType:
    text = DOC.read_text()
    section = text[text.index("### Adding a policy") :]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert code is not None, "the example's code block"
    assert len(code.group(1).splitlines()) < 40
    mod = types.ModuleType("vnorm_example")
    exec(compile(code.group(1), "docs/architecture.md", "exec"), mod.__dict__)
    return mod


def test_the_example_policy_runs_in_the_engine_step(monkeypatch):
    monkeypatch.setenv("KVEVICT_KERNELS", "torch")
    VNorm = example_module().VNorm
    assert issubclass(VNorm, Policy) and VNorm.needs.decode and not VNorm.needs.observes
    policy = VNorm(VNorm.Params(recent_tokens=4))
    cache, write, slot_pos, state, plan, work = _setup("flash", torch.float32)
    _, V_cache = flash_cache.cache_views(cache)
    rows = [r for r in COMPACT if r % 2 == 0]  # half the compacting rows switch to the example
    want = {}
    for i, w in enumerate(work):
        if w.row not in rows:
            continue
        work[i] = RowWork(w.row, policy, w.compact, w.inputs)
        L, e_prev, e_new = plan.seq_lens[w.row], plan.e_prev[w.row], plan.e_new[w.row]
        tok = torch.arange(e_prev, L)
        slots = plan.block_table[w.row][tok // BS] * BS + tok % BS
        view = KVView(
            K=V_cache[slots // BS, slots % BS].transpose(0, 1),  # unread by VNorm
            V=V_cache[slots // BS, slots % BS].transpose(0, 1),
            pos=slot_pos[slots].long().T,
            L=L,
        )
        scores = view.V.norm(dim=-1).masked_fill(view.pos >= L - 4, float("inf"))  # the doc's equation
        want[w.row] = torch.gather(view.pos, 1, topk_newer(scores, L - e_new, view.pos)).T
        assert torch.equal(policy.evict(view, L - e_new)[0], topk_newer(scores, L - e_new, view.pos))
    kept = evict_step(
        plan,
        work,
        BS,
        gather=lambda b, o: flash_cache.gather_tokens(cache, b, o),
        write=write,
        slot_pos=slot_pos,
        slot_state=state,
        G=2,
        views=flash_cache.cache_views(cache),
    )
    got = dict(zip([w.row for w in work if w.compact], kept))
    for r in rows:
        assert torch.equal(got[r].long(), want[r]), r
