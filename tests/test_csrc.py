# SPDX-License-Identifier: Apache-2.0
"""The CUDA C++ kernels (``csrc/``, :mod:`vllm_kvevict.kernels.cuda_ops`).

Wherever a CUDA toolkit is found (this project's CI included) the extension is built and imported,
and its argument checks are exercised with CPU tensors; without a GPU nothing is run. On a GPU each
op is compared with :mod:`vllm_kvevict.kernels.torch_ops` on small ragged row sets (rows of length
0 and 1, rows longer than a tile, block sizes 16/32, 1-8 KV heads, head_dim 64/128, fp32/fp16/bf16,
FlashAttention ``[nb, H, bs, 2D]`` views, ``[nb, 2, bs, H, D]`` views, a strided head_dim, a
right-aligned in-place compaction over the gathered tokens, dtype conversions, per-slot state):
gather and scatter bit-exact, scores and norms within 1e-5.

``KVEVICT_CSRC_EMULATE=1`` runs the same comparisons without a GPU against the kernels' own source
compiled for the CPU (``csrc/emulate/``: g++ >= 11, about a minute to build, a few to run).
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch

from tests.test_kernels_batched import paged_case
from vllm_kvevict.kernels import cuda_ops
from vllm_kvevict.kernels import torch_ops as ref
from vllm_kvevict.kernels.ops import FUSED
from vllm_kvevict.policies.keydiff import keydiff_scores

CUDA = torch.cuda.is_available()
TOOLKIT = cuda_ops.cuda_home()


@pytest.fixture(scope="module")
def ext():
    """The built extension (the first build compiles for a few minutes at most; later ones load the cache)."""
    if TOOLKIT is None:
        pytest.skip("no CUDA toolkit (nvcc under CUDA_HOME, on PATH or in /usr/local/cuda): nothing to build")
    return cuda_ops.build()


def build_emulated():
    """The extension with its kernels compiled for the CPU: ``kvevict_kernels.cu`` rewritten for g++
    against ``csrc/emulate/`` (dynamic shared memory and ``<<<...>>>`` launches made calls), and
    ``bindings.cpp`` with its CUDA-device check switched off."""
    from torch.utils.cpp_extension import load

    out = cuda_ops.build_dir() / "emulate"
    out.mkdir(parents=True, exist_ok=True)
    kern = cuda_ops.KERNELS.read_text()
    kern = re.sub(r"extern __shared__ (\w+) (\w+)\[\];", r"\1* \2 = emu::dyn_smem<\1>();", kern)
    kern = re.sub(r"(\w+<[^<>;]*>)<<<(.*?)>>>\(", r"emu::launch(\1, emu::Cfg(\2), ", kern)
    assert "<<<" not in kern and "extern __shared__" not in kern, "a construct the rewrite did not catch"
    bindings = out / "bindings_emulated.cpp"
    text = cuda_ops.BINDINGS.read_text()
    assert "t.is_cuda()" in text, "bindings.cpp no longer checks devices the way this rewrite expects"
    text = text.replace("t.is_cuda()", "true")
    if not bindings.exists() or bindings.read_text() != text:
        bindings.write_text(text)
    emu = cuda_ops.CSRC / "emulate"
    parts = [kern, cuda_ops.HEADER.read_text(), *(p.read_text() for p in sorted(emu.glob("*.h")))]
    digest = hashlib.sha256("".join(parts).encode()).hexdigest()[:16]
    obj = out / f"kernels-{digest}.o"
    if not obj.exists():
        src = out / f"kernels-{digest}.cpp"
        src.write_text(kern)
        subprocess.run(
            [
                "g++",
                "-std=c++20",
                "-O1",
                "-fPIC",
                "-pthread",
                f"-I{emu}",
                f"-I{cuda_ops.CSRC}",
                "-c",
                str(src),
                "-o",
                str(obj),
            ],
            check=True,
        )
    ext = load(
        name="kvevict_cuda_emulated",
        sources=[str(bindings)],
        extra_include_paths=[str(cuda_ops.CSRC)],
        extra_ldflags=[str(obj), "-pthread"],
        build_directory=str(out),
    )

    class Emulated:  # the reference's signatures, on CPU tensors
        gather_paged = staticmethod(lambda *a: tuple(ext.gather_paged(*a, 0)))
        scatter_paged = staticmethod(lambda *a: ext.scatter_paged(*a, 0))
        keydiff_scores = staticmethod(lambda K, cu: ext.keydiff_scores(K, cu, ref.EPS, 0))

    return Emulated


@pytest.fixture(scope="module", params=["cuda", "emulated"])
def ops(request):
    """The ops under test: the CUDA kernels on a GPU, or their CPU emulation when asked for."""
    if request.param == "emulated":
        if os.environ.get("KVEVICT_CSRC_EMULATE") != "1":
            pytest.skip("CPU emulation of the CUDA kernels: set KVEVICT_CSRC_EMULATE=1")
        if CUDA:
            pytest.skip("a GPU is here: the CUDA kernels themselves are tested")
        return build_emulated()
    if not CUDA:
        pytest.skip("no CUDA device: the CUDA kernels are only built here, not run")
    request.getfixturevalue("ext")
    return cuda_ops


@pytest.mark.timeout(900)
def test_extension_builds_and_imports(ext):
    t0 = time.perf_counter()
    assert cuda_ops.build() is ext and cuda_ops.available()  # cached in the process
    assert time.perf_counter() - t0 < 5
    for name in ("gather_paged", "scatter_paged", "keydiff_scores"):
        assert callable(getattr(ext, name))
    assert cuda_ops.build_dir() in Path(ext.__file__).parents


def test_extension_checks_its_arguments(ext):
    """The C++ checks run without a GPU: CPU tensors, wrong ranks and dtypes are refused clearly."""
    kc = torch.zeros(4, 16, 2, 64)
    bt, idx = torch.zeros(1, 4, dtype=torch.int32), torch.zeros(1, dtype=torch.long)
    with pytest.raises(RuntimeError, match="k_cache must be a CUDA tensor"):
        ext.gather_paged(kc, kc, bt, idx, idx, idx + 1, 0)
    with pytest.raises(RuntimeError, match="dst must be a CUDA tensor"):
        ext.scatter_paged(kc, kc[0], bt, idx, idx, bt, idx, idx, 0)
    with pytest.raises(RuntimeError, match="K must be a CUDA tensor"):
        ext.keydiff_scores(kc[0], idx, ref.EPS, 0)


def test_python_entry_points_refuse_cpu_tensors():
    """Before building anything: the Python functions name the tensor that is not on a GPU."""
    kc = torch.zeros(4, 16, 2, 64)
    with pytest.raises(ValueError, match="k_cache must be a CUDA tensor"):
        cuda_ops.gather_paged(kc, kc, None, None, None, None)
    with pytest.raises(ValueError, match="K must be a CUDA tensor"):
        cuda_ops.keydiff_scores(kc[0], torch.zeros(2, dtype=torch.long))


# -- on a GPU: against the reference -------------------------------------------------------------

CASES = [  # (block size, H, D, row lengths, window starts)
    (16, 2, 64, [40, 1, 0, 100], [0, 16, 5, 32]),  # an empty row, a single token
    (32, 8, 128, [70, 0, 1, 33], None),
    (32, 1, 64, [300, 3], [32, 0]),  # longer than a tile
    (16, 8, 64, [17, 64, 1], [3, 0, 0]),
    (16, 3, 36, [5, 20], None),  # rows of 72 (fp16) or 144 (fp32) bytes: 8-byte vectors
]
LAYOUTS = ("flash", "stacked", "strided")
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def layout_case(case: int, layout: str, dtype: torch.dtype):
    """``(base, views, bt, rows, starts, ends)``: ``views(base)`` is the K and V ``[nb, bs, H, D]``
    views of the cache tensor ``base`` (clone ``base`` to get an independent cache)."""
    bs, H, D, lens, starts = CASES[case]
    cache, kc, vc, bt, rows, st, en = paged_case(200 + case, bs, H, D, lens, dtype=dtype, starts=starts)
    nb, dev = kc.shape[0], kc.device
    g = torch.Generator().manual_seed(300 + case)
    if layout == "flash":  # vLLM's [nb, H, bs, 2D], split into K and V
        return cache, lambda b: b.transpose(1, 2).split(D, dim=-1), bt, rows, st, en
    if layout == "stacked":  # FlashAttention's [nb, 2, bs, H, D]
        base = torch.randn(nb, 2, bs, H, D, generator=g).to(dtype).to(dev)
        return base, lambda b: (b[:, 0], b[:, 1]), bt, rows, st, en
    # every other element of the head dimension: no vector loads possible
    base = torch.randn(nb, bs, H, 4 * D, generator=g).to(dtype).to(dev)
    return base, lambda b: (b[..., 0::4], b[..., 1::4]), bt, rows, st, en


def check_gather_scores(ops, case: int, layout: str, dtype: torch.dtype):
    base, views, bt, rows, st, en = layout_case(case, layout, dtype)
    kc, vc = views(base)
    K, V, cu = ref.gather_paged(kc, vc, bt, rows, st, en)
    K2, V2, cu2 = ops.gather_paged(kc, vc, bt, rows, st, en)
    assert K2.dtype == K.dtype and K2.shape == K.shape and K2.is_contiguous()
    assert cu2.dtype == torch.int64 and torch.equal(cu, cu2)
    assert torch.equal(K, K2) and torch.equal(V, V2)  # a copy: bit-exact
    got, want = keydiff_scores(K, cu), FUSED["keydiff_scores"](K, cu)
    assert got.dtype == torch.float32 and got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    return base, views, bt, rows, st, en, K, V, cu


def check_scatter(ops, case: int, layout: str, dtype: torch.dtype):
    """The right-aligned compaction: each row's kept tokens written over the end of its own window."""
    base, views, bt, rows, st, en, K, V, cu = check_gather_scores(ops, case, layout, dtype)
    lens = (en - st).tolist()
    H = K.shape[1]
    s = FUSED["keydiff_scores"](K, cu)
    pos = torch.arange(K.shape[0] * H, device=K.device).reshape(-1, H)
    keep = torch.tensor([max(1, n // 3) if n else 0 for n in lens], device=K.device)
    idx, cu_keep = ref.select_topk(s, pos, cu, keep)
    dst_start = en - (cu_keep[1:] - cu_keep[:-1])

    def both(fn):  # the reference and the op, each on its own copy of the cache
        want, got = base.clone(), base.clone()
        fn(ref, want)
        fn(ops, got)
        assert torch.equal(want, got)

    both(lambda m, b: [m.scatter_paged(d, x, idx, cu, cu_keep, bt, rows, dst_start) for d, x in zip(views(b), (K, V))])
    # idx into the packed tokens with every row's source offset 0 (how evict_step calls it)
    zero, glob = torch.zeros_like(cu), idx + cu[:-1][ref.row_ids(cu_keep)][:, None]
    both(lambda m, b: m.scatter_paged(views(b)[0], K, glob, zero, cu_keep, bt, rows, dst_start))
    other = torch.float32 if dtype != torch.float32 else torch.bfloat16  # src.to(dst.dtype)
    both(lambda m, b: m.scatter_paged(views(b)[1], V.to(other), idx, cu, cu_keep, bt, rows, dst_start))
    none = torch.zeros_like(cu_keep)  # nothing kept anywhere
    both(lambda m, b: m.scatter_paged(views(b)[0], K, idx[:0], cu, none, bt, rows, dst_start))

    # per-slot state [slots, H] moved the same way: same dtype and converted
    nb, bs = views(base)[0].shape[:2]
    g = torch.Generator().manual_seed(case)
    for state_dtype, src in (
        (torch.float32, s),
        (torch.int32, pos.int()),
        (torch.int32, pos),
        (torch.int64, pos.int()),
        (torch.float32, pos),
    ):
        state = torch.randint(-1000, 1000, (nb * bs, H), generator=g).to(state_dtype).to(K.device)
        want, got = state.clone(), state.clone()
        ref.scatter_paged(want.view(nb, bs, H), src, idx, cu, cu_keep, bt, rows, dst_start)
        ops.scatter_paged(got.view(nb, bs, H), src, idx, cu, cu_keep, bt, rows, dst_start)
        assert torch.equal(want, got), (state_dtype, src.dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_cuda_ops_match_reference(ops, case, layout, dtype):
    check_scatter(ops, case, layout, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_keydiff_rows_split_into_chunks(ops, dtype):
    """Sets of more than 2048 tokens split every row into chunks (one block each; the anchor is
    summed over them): rows shorter than the chunk count, empty rows and one long row."""
    lens = torch.tensor([3000, 0, 1, 2, 1500, 37])
    cu = ref.cu_from_lengths(lens)
    g = torch.Generator().manual_seed(7)
    dev = "cuda" if CUDA else "cpu"
    K = (torch.randn(int(cu[-1]), 2, 64, generator=g) + 0.3).to(dtype).to(dev)  # a common direction
    cu = cu.to(dev)
    torch.testing.assert_close(keydiff_scores(K, cu), FUSED["keydiff_scores"](K, cu), atol=1e-5, rtol=1e-5)


def test_cuda_ops_empty_sets(ops):
    base, views, bt, rows, st, en = layout_case(0, "flash", torch.float16)
    kc, vc = views(base)
    K, V, cu = ops.gather_paged(kc, vc, bt, rows, st, st)  # every row empty
    assert K.shape == (0, *kc.shape[2:]) and cu.tolist() == [0] * (rows.numel() + 1)
    assert keydiff_scores(K, cu).shape == (0, kc.shape[2])
    K, V, cu = ops.gather_paged(kc, vc, bt, rows[:0], st[:0], en[:0])  # no rows at all
    assert K.shape[0] == 0 and cu.tolist() == [0]


def test_cuda_ops_run_on_the_current_stream(ext):
    """Launched on torch's current stream: results are ready after that stream's work, not before."""
    if not CUDA:
        pytest.skip("no CUDA device: the CUDA kernels are only built here, not run")
    ops = cuda_ops
    s = torch.cuda.Stream()
    base, views, bt, rows, st, en = layout_case(1, "flash", torch.bfloat16)
    kc, vc = views(base)
    want = ref.gather_paged(kc, vc, bt, rows, st, en)
    with torch.cuda.stream(s):
        got = ops.gather_paged(kc, vc, bt, rows, st, en)
        scores = keydiff_scores(got[0], got[2])
    s.synchronize()
    assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])
    torch.testing.assert_close(scores, FUSED["keydiff_scores"](want[0], want[2]), atol=1e-5, rtol=1e-5)


def test_ops_dispatch(monkeypatch):
    """``KVEVICT_KERNELS=cuda`` takes the extension for CUDA tensors in the ops it implements only;
    CPU tensors and the other ops keep ``auto``'s implementation (torch's ``column_sums``)."""
    from vllm_kvevict.kernels import ops

    monkeypatch.setenv("KVEVICT_KERNELS", "cuda")
    assert ops.backend_for(torch.empty(1), "gather_paged") is ref
    assert set(ops.CUDA_OPS) <= set(ops.OPS) | set(ops.FUSED)
    for name in ops.CUDA_OPS:
        assert callable(getattr(cuda_ops, name))
    if CUDA:
        t = torch.empty(1, device="cuda")
        assert ops.backend_for(t, "scatter_paged") is cuda_ops
        assert ops.backend_for(t, "column_sums") is ref


def test_wheel_ships_the_sources(tmp_path):
    """A non-editable install can build the extension: the wheel carries ``csrc/`` (through the
    ``kernels/csrc`` link), byte for byte."""
    root = Path(__file__).resolve().parents[1]
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            str(root),
            "-w",
            str(tmp_path),
        ],
        check=True,
        timeout=600,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("vllm_kvevict-*.whl")
    with zipfile.ZipFile(wheel) as z:
        for name in (
            "kvevict_kernels.cu",
            "kvevict_kernels.h",
            "bindings.cpp",
            "emulate/cuda_runtime.h",
            "emulate/cuda_bf16.h",
            "emulate/cuda_fp16.h",
        ):
            assert z.read(f"vllm_kvevict/kernels/csrc/{name}") == (root / "csrc" / name).read_bytes(), name
    assert cuda_ops.CSRC.resolve() == (root / "csrc").resolve()
