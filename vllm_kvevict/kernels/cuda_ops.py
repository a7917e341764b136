# SPDX-License-Identifier: Apache-2.0
"""The optional CUDA C++ implementation of the batched eviction operations: same signatures and
semantics as :mod:`vllm_kvevict.kernels.torch_ops` (the specification) for :func:`gather_paged`,
:func:`scatter_paged` and :func:`keydiff_scores`. Written against vLLM 0.32.0's
KV-cache layouts (any strides of the ``[num_blocks, block_size, H, D]`` views).

The sources live in ``csrc/`` at the top of the repository and ship inside the package
(``kernels/csrc``):
``kvevict_kernels.cu`` (pure CUDA: the kernels and their host launchers, raw pointers and strides)
and ``bindings.cpp`` (torch's CPU headers only: checks, allocation, the pybind11 module). They are
compiled with :func:`torch.utils.cpp_extension.load` on first use, never at import, and cached
under ``$KVEVICT_CACHE_DIR`` or ``~/.cache/vllm-kvevict/torch_extensions``. Two ways to build:

* torch built with CUDA: ``load`` compiles both files (nvcc for the ``.cu``), the usual way;
* otherwise (a CPU torch, whose headers lack the CUDA macros, or when the first way fails, e.g.
  a toolkit whose major version differs from torch's): nvcc compiles the ``.cu`` alone into an
  object file (its name carries a hash of sources and flags), and ``load`` compiles the bindings
  and links that object with the static CUDA runtime. This is how CI builds it: compiled and
  imported, never run (there is no GPU there).

``python -m vllm_kvevict.kernels.cuda_ops`` builds and prints where. ``TORCH_CUDA_ARCH_LIST``
picks the GPU architectures (default: the visible GPUs, else :data:`DEFAULT_ARCHS`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import ModuleType

import torch

from vllm_kvevict import envs
from vllm_kvevict.kernels.torch_ops import EPS

logger = logging.getLogger(__name__)

NAME = "kvevict_cuda_ops"
#: ``csrc/``: shipped inside the package (``kernels/csrc``, a link to the repository's ``csrc/`` in a
#: checkout), else found at the top of a checkout (a copy of the tree without the link)
CSRC = next(
    (
        p
        for p in (Path(__file__).parent / "csrc", Path(__file__).resolve().parents[2] / "csrc")
        if (p / "kvevict_kernels.cu").is_file()
    ),
    Path(__file__).parent / "csrc",
)
KERNELS = CSRC / "kvevict_kernels.cu"
HEADER = CSRC / "kvevict_kernels.h"
BINDINGS = CSRC / "bindings.cpp"
#: GPU architectures compiled when ``TORCH_CUDA_ARCH_LIST`` is unset and no GPU is visible: Ampere
#: machine code plus PTX (JIT-compiled by the driver on newer GPUs). One architecture keeps a
#: compile-only build (CI) short.
DEFAULT_ARCHS = "8.0+PTX"

if not (KERNELS.is_file() and HEADER.is_file() and BINDINGS.is_file()):
    raise ImportError(
        f"kvevict cuda_ops: the CUDA sources are not in {CSRC} (kvevict_kernels.cu, kvevict_kernels.h, "
        "bindings.cpp): reinstall vllm-kvevict (the wheel ships them) to use KVEVICT_KERNELS=cuda"
    )

_lock = threading.Lock()
_ext: ModuleType | None = None
_error: Exception | None = None


def cache_dir() -> Path:
    """Where builds are kept: ``$KVEVICT_CACHE_DIR/torch_extensions`` or ``~/.cache/vllm-kvevict/torch_extensions``."""
    root = envs.KVEVICT_CACHE_DIR
    return Path(root) / "torch_extensions" if root else Path.home() / ".cache" / "vllm-kvevict" / "torch_extensions"


def build_dir() -> Path:
    """This torch's build directory (one per torch version and CUDA flavour)."""
    tag = re.sub(r"[^A-Za-z0-9.]+", "_", f"torch{torch.__version__}-cuda{torch.version.cuda or 'none'}")
    return cache_dir() / f"{NAME}-{tag}"


def cuda_home() -> str | None:
    """The CUDA toolkit: torch's ``CUDA_HOME`` (set on CUDA builds of torch only), else the same
    places torch searches (``$CUDA_HOME``/``$CUDA_PATH``, above ``nvcc`` on ``PATH``,
    ``/usr/local/cuda``): the first holding ``bin/nvcc`` and ``include/cuda_runtime.h`` (``nvcc`` on
    ``PATH`` may be a wrapper script). ``None`` when there is none."""
    from torch.utils import cpp_extension

    candidates = [cpp_extension.CUDA_HOME, os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates += [os.path.dirname(os.path.dirname(p)) for p in (nvcc, os.path.realpath(nvcc))]
    candidates.append("/usr/local/cuda")
    for home in candidates:
        if home and all(
            os.path.isfile(os.path.join(home, *f)) for f in (("bin", "nvcc"), ("include", "cuda_runtime.h"))
        ):
            return home
    return None


def arch_flags() -> list[str]:
    """nvcc ``-gencode`` flags: ``TORCH_CUDA_ARCH_LIST`` ("8.0;9.0+PTX"), else the visible GPUs,
    else :data:`DEFAULT_ARCHS`."""
    archs = os.environ.get("TORCH_CUDA_ARCH_LIST", "")
    if not archs and torch.cuda.is_available():
        caps = sorted({torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})
        archs = ";".join(f"{a}.{b}" for a, b in caps) + "+PTX"
    flags = []
    for arch in (archs or DEFAULT_ARCHS).replace(" ", ";").split(";"):
        if not arch:
            continue
        num = arch.removesuffix("+PTX").replace(".", "")
        flags.append(f"-gencode=arch=compute_{num},code=sm_{num}")
        if arch.endswith("+PTX"):
            flags.append(f"-gencode=arch=compute_{num},code=compute_{num}")
    return flags


def _load_with_torch(out: Path, verbose: bool) -> ModuleType:
    """torch built with CUDA: ``load`` compiles the ``.cu`` and the bindings together."""
    from torch.utils.cpp_extension import load

    cuda_flags = ["-O3", "-lineinfo"]
    if not os.environ.get("TORCH_CUDA_ARCH_LIST") and torch.cuda.device_count() == 0:
        cuda_flags += arch_flags()  # torch would look for visible GPUs only
    return load(
        name=NAME,
        sources=[str(BINDINGS), str(KERNELS)],
        extra_cflags=["-O3"],
        extra_cuda_cflags=cuda_flags,
        extra_include_paths=[str(CSRC)],
        build_directory=str(out),
        verbose=verbose,
    )


def _nvcc_object(home: str, out: Path, verbose: bool) -> Path:
    """``kvevict_kernels.cu`` compiled by nvcc alone (position-independent, torch's nvcc defines),
    cached under a name hashing the sources, the flags and the compiler."""
    from torch.utils.cpp_extension import COMMON_NVCC_FLAGS

    nvcc = os.path.join(home, "bin", "nvcc")
    flags = ["-O3", "-lineinfo", "-std=c++17", "-Xcompiler", "-fPIC", *COMMON_NVCC_FLAGS, *arch_flags(), f"-I{CSRC}"]
    digest = hashlib.sha256()
    for part in (KERNELS.read_bytes(), HEADER.read_bytes(), " ".join([nvcc, *flags]).encode()):
        digest.update(part)
    obj = out / f"kvevict_kernels-{digest.hexdigest()[:16]}.o"
    if not obj.exists():
        tmp = obj.with_suffix(f".{os.getpid()}.tmp.o")
        cmd = [nvcc, *flags, "-c", str(KERNELS), "-o", str(tmp)]
        if verbose:
            print(" ".join(cmd), file=sys.stderr)
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"kvevict cuda_ops: nvcc failed ({' '.join(cmd)}):\n{res.stdout}{res.stderr}")
        os.replace(tmp, obj)  # atomic: concurrent builds see a whole object or none
    return obj


def _load_with_object(home: str, out: Path, verbose: bool) -> ModuleType:
    """Any torch: nvcc builds the kernels, ``load`` the bindings (CPU headers), linked together
    with the static CUDA runtime (no libcudart needed at run time)."""
    from torch.utils.cpp_extension import load

    obj = _nvcc_object(home, out, verbose)
    lib = os.path.join(home, "lib64") if os.path.isdir(os.path.join(home, "lib64")) else os.path.join(home, "lib")
    return load(
        name=NAME,
        sources=[str(BINDINGS)],
        extra_cflags=["-O3"],
        extra_include_paths=[str(CSRC)],
        extra_ldflags=[str(obj), f"-L{lib}", "-lcudart_static", "-ldl", "-lrt", "-lpthread"],
        build_directory=str(out),
        verbose=verbose,
    )


def build(verbose: bool = False) -> ModuleType:
    """The compiled extension: built on the first call (minutes), then loaded from the cache. A failed
    build raises, and the same error is raised again by later calls in this process."""
    global _ext, _error
    with _lock:
        if _ext is not None:
            return _ext
        if _error is not None:
            raise _error
        try:
            home = cuda_home()
            if home is None:
                raise RuntimeError("kvevict cuda_ops: no CUDA toolkit (nvcc) found; set CUDA_HOME")
            out = build_dir()
            out.mkdir(parents=True, exist_ok=True)
            from torch.utils import cpp_extension

            if torch.version.cuda and cpp_extension.CUDA_HOME:
                try:
                    _ext = _load_with_torch(out, verbose)
                except Exception as e:  # e.g. a toolkit of another major version than torch's
                    logger.warning(
                        "kvevict cuda_ops: building with torch's CUDA setup failed (%s); "
                        "compiling the kernels with nvcc and the static CUDA runtime instead",
                        e,
                    )
            if _ext is None:
                _ext = _load_with_object(home, out, verbose)
        except Exception as e:
            _error = e
            raise
        return _ext


def available() -> bool:
    """Whether the extension can be used: a CUDA toolkit is found and the build succeeds (this builds
    it on the first call). Running the kernels also needs CUDA tensors, i.e. a GPU."""
    if cuda_home() is None:
        return False
    try:
        build()
    except Exception as e:  # noqa: BLE001 - reported, then "not available"
        logger.warning("kvevict cuda_ops: not available: %s", e)
        return False
    return True


def _on_cuda(t: torch.Tensor, name: str) -> torch.device:
    if not (isinstance(t, torch.Tensor) and t.is_cuda):
        where = t.device if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"kvevict cuda_ops: {name} must be a CUDA tensor, got {where}")
    return t.device


def _stream(device: torch.device) -> int:
    return torch.cuda.current_stream(device).cuda_stream


def gather_paged(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    rows: torch.Tensor,
    starts: torch.Tensor,
    ends: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`vllm_kvevict.kernels.torch_ops.gather_paged`: ``K, V [N, H, D]`` and ``cu [R + 1]``."""
    dev = _on_cuda(k_cache, "k_cache")
    ext = build()
    with torch.cuda.device(dev):
        return tuple(ext.gather_paged(k_cache, v_cache, block_table, rows, starts, ends, _stream(dev)))


def scatter_paged(
    dst: torch.Tensor,
    src: torch.Tensor,
    idx: torch.Tensor,
    cu: torch.Tensor,
    cu_keep: torch.Tensor,
    block_table: torch.Tensor,
    rows: torch.Tensor,
    dst_start: torch.Tensor,
) -> None:
    """:func:`vllm_kvevict.kernels.torch_ops.scatter_paged`, in place (``src`` must not alias ``dst``)."""
    dev = _on_cuda(dst, "dst")
    ext = build()
    with torch.cuda.device(dev):
        ext.scatter_paged(dst, src, idx, cu, cu_keep, block_table, rows, dst_start, _stream(dev))


def keydiff_scores(K: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
    """:func:`vllm_kvevict.policies.keydiff.keydiff_scores` (the statement): ``[N, H]`` float32."""
    dev = _on_cuda(K, "K")
    ext = build()
    with torch.cuda.device(dev):
        return ext.keydiff_scores(K, cu, EPS, _stream(dev))


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m vllm_kvevict.kernels.cuda_ops",
        description="Build the vllm-kvevict CUDA kernels and print where they are.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="show the compiler commands")
    args = parser.parse_args(argv)
    home = cuda_home()
    if home is None:
        print("kvevict cuda_ops: no CUDA toolkit (nvcc) found; set CUDA_HOME", file=sys.stderr)
        return 1
    t0 = time.perf_counter()
    ext = build(verbose=args.verbose)
    print(
        f"kvevict cuda_ops: {ext.__file__} (built or loaded in {time.perf_counter() - t0:.1f} s; "
        f"CUDA {home}; torch {torch.__version__}; build directory {build_dir()})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
