# SPDX-License-Identifier: Apache-2.0
"""Reading, writing and compacting vLLM's paged KV cache, against plain-tensor references."""

from __future__ import annotations

import pytest
import torch

from vllm_kvevict.backends import cpu_layout as cpu_cache
from vllm_kvevict.backends import flash_layout as flash_cache
from vllm_kvevict.backends.evict import RowWork, evict_step
from vllm_kvevict.backends.plan import StepPlan, shift_block_table
from vllm_kvevict.policies import get_policy


@pytest.mark.parametrize("isa", ["vec", "vec16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bs,D", [(32, 64), (64, 128), (32, 128)])
def test_cpu_cache_roundtrip_through_vllm_writer(isa, dtype, bs, D):
    H, NB, n = 3, 6, 2 * bs + 5
    cache = torch.zeros(NB, H, bs, 2 * D, dtype=dtype)
    K, V = torch.randn(n, H, D).to(dtype), torch.randn(n, H, D).to(dtype)
    slots = torch.randperm(NB * bs, generator=torch.Generator().manual_seed(0))[:n]
    cpu_cache.write_tokens(cache, isa, slots, K, V)  # vLLM's own op packs the page
    K2, V2 = cpu_cache.gather_tokens(cache, isa, slots // bs, slots % bs)
    assert torch.equal(K, K2) and torch.equal(V, V2)
    # vec/vec16 pages are strided matrices (read through views); the element map gives the same
    assert cpu_cache._affine(isa, bs, D, dtype) is not None
    with pytest.MonkeyPatch.context() as m:
        m.setattr(cpu_cache, "_affine", lambda *a: None)
        K3, V3 = cpu_cache.gather_tokens(cache, isa, slots // bs, slots % bs)
    assert torch.equal(K, K3) and torch.equal(V, V3)


def test_flash_cache_roundtrip_matches_flash_attention_views():
    NB, H, bs, D = 5, 2, 16, 64
    cache = torch.zeros(NB, H, bs, 2 * D)
    K, V = torch.randn(20, H, D), torch.randn(20, H, D)
    slots = torch.randperm(NB * bs)[:20]
    flash_cache.write_tokens(cache, slots, K, V)
    # FlashAttention's view in vLLM: (B, H, N, 2D) -> (B, N, H, D) x 2
    k_view, v_view = cache.transpose(1, 2).split(D, dim=-1)
    assert torch.equal(k_view[slots // bs, slots % bs], K) and torch.equal(v_view[slots // bs, slots % bs], V)
    K2, V2 = flash_cache.gather_tokens(cache, slots // bs, slots % bs)
    assert torch.equal(K, K2) and torch.equal(V, V2)


def test_shift_block_table():
    bt = torch.tensor([[5, 6, 7, 8], [1, 2, 0, 0]])
    out = shift_block_table(bt, torch.tensor([2, 0]))
    assert out.tolist() == [[7, 8, 0, 0], [1, 2, 0, 0]]


def test_compact_step_keeps_policy_choice_right_aligned():
    NB, H, bs, D = 12, 2, 8, 64
    cache = torch.zeros(NB, H, bs, 2 * D)
    slot_pos = torch.zeros(NB * bs, H, dtype=torch.int32)
    # Two requests: r0 with logical tokens [0, 30) in blocks 3,7,1,9; r1 with [0, 20) in blocks 2,4,11.
    tables = torch.tensor([[3, 7, 1, 9], [2, 4, 11, 0]])
    lens = [30, 20]
    g = torch.Generator().manual_seed(1)
    truth = []
    for r, L in enumerate(lens):
        i = torch.arange(L)
        slots = tables[r][i // bs] * bs + i % bs
        K, V = torch.randn(L, H, D, generator=g), torch.randn(L, H, D, generator=g)
        flash_cache.write_tokens(cache, slots, K, V)
        slot_pos[slots] = i.to(torch.int32)[:, None]
        truth.append((K, V))
    # r0: window [0, 30) -> keep [16, 30) (14 tokens); r1: [8, 20) -> keep [16, 20) (4 tokens)
    plan = StepPlan(
        L_prev=[24, 19],
        e_prev=[0, 8],
        e_new=[16, 16],
        seq_lens=lens,
        block_table=tables,
        slot_mapping=torch.tensor([]),
        positions=torch.tensor([]),
        req_ids=["a", "b"],
        states=[],
        query_start_loc=[0, 0, 0],
    )
    pol = get_policy("keydiff")
    kept = evict_step(
        plan,
        [RowWork(r, pol, True) for r in plan.compact_rows],
        bs,
        gather=lambda b, o: flash_cache.gather_tokens(cache, b, o),
        write=lambda s, K, V: flash_cache.write_tokens(cache, s, K, V),
        slot_pos=slot_pos,
        slot_state={},
    )
    for r, (K, V) in enumerate(truth):
        lo, L = plan.e_prev[r], lens[r]
        keep = L - plan.e_new[r]
        Kw = K[lo:L]
        for h in range(H):
            # KeyDiff computed independently: -cos(k_i, mean of normalised keys)
            k = Kw[:, h]
            mu = torch.nn.functional.normalize(k, dim=-1).mean(0)
            score = -(k @ mu) / (k.norm(dim=-1) * mu.norm())
            want = torch.sort(torch.topk(score, keep).indices).values + lo  # positions, ascending
            assert kept[r][:, h].tolist() == want.tolist()
            i = torch.arange(plan.e_new[r], L)
            dst = tables[r][i // bs] * bs + i % bs
            Kc, Vc = flash_cache.gather_tokens(cache, dst // bs, dst % bs)
            assert torch.equal(Kc[:, h], K[want, h]) and torch.equal(Vc[:, h], V[want, h])
            assert slot_pos[dst, h].tolist() == want.tolist()


def test_per_head_equals_the_advanced_index():
    """torch_ops.per_head (one index_select on the flattened token x head axis) is x[idx, arange(H)]."""
    from vllm_kvevict.kernels import torch_ops

    g = torch.Generator().manual_seed(0)
    for shape in ((50, 3, 8), (50, 3), (7, 1, 4)):
        x = torch.randn(*shape, generator=g)
        idx = torch.randint(0, shape[0], (20, shape[1]), generator=g)
        h = torch.arange(shape[1])[None, :]
        assert torch.equal(torch_ops.per_head(x, idx), x[idx, h])
