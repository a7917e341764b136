# SPDX-License-Identifier: Apache-2.0
"""The policy kernels: LSH-E's bit-packed SimHash codes and Hamming distances, CriticalKV's projected
value norms. The torch reference against plain specifications written here (numpy XOR + popcount,
float64 einsum), the Triton kernels against the reference (under ``TRITON_INTERPRET=1`` on CPU, on a
GPU natively), and the policies' outputs against their previous formulas, recomputed here.
Codes and distances must match exactly; norms within float32 (or 16-bit input) tolerance.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from tests.policy_reference import build, make_policy, on_device
from vllm_kvevict.kernels import torch_ops as ref
from vllm_kvevict.policies import criticalkv
from vllm_kvevict.policies import lshe as lshe_mod
from vllm_kvevict.policies.lshe import _projection

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
HALF = (torch.float16, torch.bfloat16)


def kernels_param(request, monkeypatch, name):
    """Force ``ops`` onto ``name`` (torch|triton) for the test."""
    if name == "triton":
        request.getfixturevalue("tri")
    monkeypatch.setenv("KVEVICT_KERNELS", name)


# -- the previous formulas (before the fused ops), from scratch ---------------------------------------


def old_simhash(x, R):
    """Packed codes of ``x [..., d]``: ``x.float() @ R.T >= 0``, bits weighted by powers of two."""
    bits = (x.float() @ R.to(x.device).T) >= 0
    weights = 2 ** torch.arange(R.shape[0], device=x.device, dtype=torch.int64)
    return (bits.long() * weights).sum(dim=-1)


def old_signs(codes, bits):
    shifts = torch.arange(bits, device=codes.device, dtype=torch.int64)
    return ((codes[..., None] >> shifts) & 1).float() * 2 - 1


def old_lshe_observe(view, p, row_chunk=256):
    """LSH-E's observe as it was: Hamming distances ``(c - s_a . s_b) / 2`` from +-1 sign matmuls."""
    R = _projection(p.seed, view.layer, p.bits, view.K.shape[-1])
    code, victim = view.state["lsh_code"], view.state["lsh_victim"]
    m, n = view.q_pos.shape[0], view.pos.shape[1]
    code[:, n - m :] = old_simhash(view.K[:, n - m :], R)
    H, G = view.num_heads, view.G
    for c0 in range(0, m, row_chunk):
        c1 = min(m, c0 + row_chunk)
        s_k = old_signs(code, p.bits)
        if p.hash == "query":
            s_q = old_signs(old_simhash(view.Q[:, c0:c1], R), p.bits).reshape(H, G, c1 - c0, p.bits).sum(dim=1)
            dist = (G * p.bits - s_q @ s_k.transpose(1, 2)) / 2
        else:
            dist = (p.bits - s_k[:, n - m + c0 : n - m + c1] @ s_k.transpose(1, 2)) / 2
        ref.lshe_victims(
            dist.round().long(), view.pos, victim, view.q_pos[c0:c1], view.budget, p.sink_tokens, p.recent_tokens
        )


def old_projected_value_norms(V, W_O, G):
    """CriticalKV's Vp as it was: one query head at a time, ``[n, D]`` transient each."""
    H_q = W_O.shape[0]
    out = torch.empty(H_q, V.shape[1], dtype=torch.float32, device=V.device)
    for g in range(H_q):
        out[g] = (V[g // G].float() @ W_O[g].float()).abs().sum(dim=-1)
    return out.reshape(H_q // G, G, -1).mean(dim=1)


# -- specifications --------------------------------------------------------------------------------


def spec_hamming(q_codes, k_codes, G):
    """``[H, m, n]``: numpy XOR and popcount on the codes as unsigned 64-bit words, summed over the group."""
    q = q_codes.cpu().numpy().view(np.uint64)
    k = k_codes.cpu().numpy().view(np.uint64)
    H, n = k.shape
    q = q.reshape(H, G, -1)
    return torch.from_numpy(np.bitwise_count(q[:, :, :, None] ^ k[:, None, None, :]).astype(np.int64).sum(axis=1))


def spec_projected(V, W_O, G):
    """``[H, n]`` float64: mean over the group of sum_c |sum_k v[k] W[k, c]|."""
    H, n, d = V.shape
    W = W_O.double().reshape(H, G, d, -1)
    return torch.einsum("htk,hgkc->hgtc", V.double(), W).abs().sum(-1).mean(1)


def random_codes(g, shape, bits):
    """Uniform ``bits``-bit codes (``bits = 64``: any int64, negatives included)."""
    if bits == 64:
        return torch.randint(-(2**63), 2**63 - 1, shape, generator=g, dtype=torch.int64)
    return torch.randint(0, 2**bits, shape, generator=g, dtype=torch.int64)


# -- SimHash codes ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bits", [8, 16, 62])
def test_simhash_reference_is_bit_identical_to_the_old_formula(bits, dtype):
    g = torch.Generator().manual_seed(bits)
    R = torch.randn(bits, 64, generator=g)
    x = torch.randn(3, 50, 64, generator=g).to(dtype)
    want = old_simhash(x, R)
    assert torch.equal(ref.simhash_codes(x.reshape(-1, 64), R).view(3, 50), want)
    assert torch.equal(lshe_mod.simhash(x, R), want)  # the policy's helper, through ops
    assert torch.equal(lshe_mod.simhash(x[:, 10:], R), want[:, 10:])  # a strided view
    assert int(want.max()) < 2**bits and int(want.min()) >= 0


SIMHASH_CASES = [  # (M, d, bits)
    (0, 64, 16),
    (1, 64, 8),
    (37, 128, 62),
    (300, 64, 16),
    (70, 80, 62),  # d not a power of two
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", range(len(SIMHASH_CASES)))
def test_triton_simhash_codes(tri, case, dtype):
    """Exact codes, except (tolerated, never seen on random data) a bit whose dot is within 1e-5 of 0,
    where another fp32 summation order may round to the other sign."""
    M, d, bits = SIMHASH_CASES[case]
    g = torch.Generator().manual_seed(case)
    R = torch.randn(bits, d, generator=g)
    x = torch.randn(M, d, generator=g).to(dtype)
    want = ref.simhash_codes(x.to(DEV), R)
    got = tri.simhash_codes(x.to(DEV), R.to(DEV)).cpu()
    assert got.shape == (M,) and got.dtype == torch.int64
    differ = ((got ^ want.cpu())[:, None] >> torch.arange(bits)) & 1  # [M, bits]
    dots = x.double() @ R.double().T
    assert (dots[differ.bool()].abs() < 1e-5).all()
    assert int(differ.sum()) <= 2, "more than a stray near-zero tie"
    if M:
        strided = x.to(DEV).repeat_interleave(2, dim=1)[:, ::2]  # a non-contiguous [M, d] view of the same vectors
        assert torch.equal(tri.simhash_codes(strided, R.to(DEV)), got.to(DEV))


def test_simhash_ties_set_the_bit(tri):
    """A dot that is exactly 0 (small integers: exact in any order), or -0.0, sets its bit in both."""
    R = torch.tensor([[1.0, -1.0, 0.0, 0.0], [2.0, 1.0, -3.0, 1.0], [0.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    x = torch.tensor(
        [
            [1.0, 1.0, 1.0, 0.0],  # dots 0, 0, 0, 3
            [0.0, 0.0, 0.0, 0.0],  # all 0
            [-0.0, -0.0, -0.0, -0.0],  # all -0.0 (or 0.0)
            [-1.0, 0.0, 0.0, -1.0],
        ]
    )  # dots -1, -3, -1, -2
    want = torch.tensor([0b1111, 0b1111, 0b1111, 0b0000])
    assert torch.equal(ref.simhash_codes(x, R), want)
    assert torch.equal(tri.simhash_codes(x.to(DEV), R.to(DEV)).cpu(), want)


# -- Hamming distances -----------------------------------------------------------------------------

HAMMING_CASES = [  # (H, G, m, n, bits)
    (2, 1, 5, 40, 16),
    (3, 2, 37, 100, 62),
    (2, 4, 1, 70, 8),
    (1, 4, 33, 1, 16),
    (2, 2, 0, 10, 16),  # no query
    (2, 2, 4, 0, 16),  # empty window
    (2, 3, 20, 130, 64),  # all 64 bits, negative codes
]


@pytest.mark.parametrize("case", range(len(HAMMING_CASES)))
def test_hamming_distances(case):
    H, G, m, n, bits = HAMMING_CASES[case]
    g = torch.Generator().manual_seed(case)
    q, k = random_codes(g, (H * G, m), bits), random_codes(g, (H, n), bits)
    if m and n:
        q[0, 0] = k[0, 0]  # distance 0 at least once per group member
    want = spec_hamming(q, k, G)
    got = ref.hamming_distances(q.to(DEV), k.to(DEV), G)
    assert got.shape == (H, m, n) and got.dtype == torch.int64
    assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("bits", [8, 16, 62])
def test_hamming_key_variant(bits):
    """``hash: key``: key codes against key codes, G = 1, e.g. the last rows of the window."""
    g = torch.Generator().manual_seed(bits)
    code = random_codes(g, (3, 90), bits)
    want = spec_hamming(code[:, 60:], code, 1)
    assert torch.equal(ref.hamming_distances(code[:, 60:], code, 1), want)  # a strided slice
    assert (want[:, torch.arange(30), torch.arange(60, 90)] == 0).all()  # each code vs itself


# -- projected value norms -------------------------------------------------------------------------

PROJ_CASES = [  # (H_kv, G, n, d, D)
    (2, 1, 37, 64, 96),
    (2, 2, 130, 64, 200),
    (1, 4, 1, 128, 64),
    (3, 2, 0, 64, 96),  # no token
    (2, 4, 70, 128, 130),
    (2, 2, 50, 80, 100),  # d not a power of two
]


def proj_case(case, dtype, strided=False):
    H, G, n, d, D = PROJ_CASES[case]
    g = torch.Generator().manual_seed(case)
    V = torch.randn(H, n, 2 * d if strided else d, generator=g).to(dtype)[..., :d]
    W_O = (torch.randn(H * G, d, D, generator=g) / d**0.5).to(dtype)
    return V.to(DEV), W_O.to(DEV), G


def tol(dtype):
    return dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", range(len(PROJ_CASES)))
def test_projected_value_norms(tri, case, dtype):
    V, W_O, G = proj_case(case, dtype, strided=case % 2 == 1)
    want = spec_projected(V.cpu(), W_O.cpu(), G).float()
    got_ref = criticalkv.projected_value_norms(V, W_O, G)
    got_tri = tri.projected_value_norms(V, W_O, G)
    assert got_ref.shape == got_tri.shape == V.shape[:2]
    assert got_ref.dtype == got_tri.dtype == torch.float32
    torch.testing.assert_close(got_ref.cpu(), want, rtol=1e-5, atol=1e-5)  # 16-bit inputs are exact in fp32
    torch.testing.assert_close(got_tri, got_ref, **tol(dtype))


@pytest.mark.parametrize("case", range(len(PROJ_CASES)))
def test_criticalkv_scores_in_one_kernel_equal_its_statement(tri, case):
    """CriticalKV's stage-2 criterion ``(A + eps) * Vp`` in one Triton kernel: the statement's,
    values packed (strided) or read where they are through their blocks."""
    from vllm_kvevict.kernels.ops import FUSED

    V, W_O, G = proj_case(case, torch.bfloat16, strided=True)
    H, n, d = V.shape
    g = torch.Generator().manual_seed(100 + case)
    V = V.transpose(0, 1)  # [n, H, d], as the step packs them
    A = torch.rand(n, H, generator=g).to(DEV)
    bs = 32
    slots = torch.randperm(n + 5, generator=g)[:n].to(DEV)
    cache = torch.zeros((n + 5 + bs - 1) // bs, bs, H, d, dtype=V.dtype, device=DEV)
    cache[slots // bs, slots % bs] = V
    want = FUSED["criticalkv_scores"](A, V, W_O, G, 1e-4)
    for v in (V, ref.PagedKeys(cache, slots // bs, slots % bs)):
        torch.testing.assert_close(tri.criticalkv_scores(A, v, W_O, G, 1e-4), want, **tol(torch.bfloat16))


def test_projected_value_norms_reference_chunks_tokens(monkeypatch):
    V, W_O, G = proj_case(4, torch.float32)
    whole = criticalkv.projected_value_norms(V, W_O, G)
    monkeypatch.setattr(criticalkv, "PROJ_CHUNK", 3 * W_O.shape[0] * W_O.shape[-1])  # 3 tokens at a time
    torch.testing.assert_close(criticalkv.projected_value_norms(V, W_O, G), whole, rtol=1e-6, atol=0)


# -- the policies: outputs unchanged ---------------------------------------------------------------


@pytest.mark.parametrize("kernels", ["torch", "triton"])
@pytest.mark.parametrize("hash_mode", ["query", "key"])
@pytest.mark.parametrize("bits,G,d", [(8, 1, 64), (16, 2, 128), (62, 4, 64)])
def test_lshe_observe_unchanged(request, monkeypatch, kernels, hash_mode, bits, G, d):
    """Codes and victims equal the sign-matmul formulation's, one chunk and in small row chunks."""
    kernels_param(request, monkeypatch, kernels)
    H, n, m, budget, layer = 2, 80, 30, 35, 5
    pol = make_policy("lshe", bits=bits, hash=hash_mode)
    view, _ = build(pol, H=H, G=G, n=n, d=d, m=m, budget=budget, layer=layer, seed=bits + G)
    view = on_device(view, DEV)
    R = _projection(pol.params.seed, layer, bits, d)
    view.state["lsh_code"][:, : n - m] = old_simhash(view.K[:, : n - m], R)  # the cached keys' codes
    view.state["lsh_victim"][:, 10:14] = n - m - 1  # victims of earlier steps
    want = {k: t.clone() for k, t in view.state.items()}
    old_lshe_observe(replace(view, state=want), pol.params)
    assert (want["lsh_victim"] >= n - m).any()  # this step chose victims
    for row_chunk in (256, 7):
        monkeypatch.setattr(lshe_mod, "ROW_CHUNK", row_chunk)
        got = {k: t.clone() for k, t in view.state.items()}
        pol.observe(replace(view, state=got))
        assert torch.equal(got["lsh_code"], want["lsh_code"])
        assert torch.equal(got["lsh_victim"], want["lsh_victim"])


@pytest.mark.parametrize("kernels", ["torch", "triton"])
@pytest.mark.parametrize("G,d", [(1, 64), (2, 128), (4, 64)])
def test_criticalkv_unchanged(request, monkeypatch, kernels, G, d):
    """Vp, the scores and the kept slots equal those of the per-head loop."""
    kernels_param(request, monkeypatch, kernels)
    pol = make_policy("criticalkv", snapkv={"window": 4, "pooling": "max"})
    view, _ = build(pol, H=2, G=G, n=60, d=d, D=48, m=4, seed=G)
    view = on_device(view, DEV)
    view.keep = 25
    want = old_projected_value_norms(view.V, view.W_O, G)
    got = criticalkv.projected_value_norms(view.V, view.W_O, G)
    torch.testing.assert_close(got, want, rtol=1e-6 if kernels == "torch" else 1e-4, atol=1e-6)
    scores = pol.score(view)
    kept = pol.evict(view, 25)[0]
    monkeypatch.setattr(criticalkv, "projected_value_norms", old_projected_value_norms)
    torch.testing.assert_close(scores, pol.score(view), rtol=1e-6 if kernels == "torch" else 1e-4, atol=1e-7)
    assert torch.equal(kept, pol.evict(view, 25)[0])
