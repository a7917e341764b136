# SPDX-License-Identifier: Apache-2.0
"""The eviction step never waits for the device: no host sync in any layer of any step.

On a GPU a host sync (``.item()``, ``int(t)``, ``.tolist()``, ``.cpu()``, ``nonzero``, an output
sized by a tensor's value) waits for every kernel queued before it: the step would stall each
layer's forward and defeat vLLM's asynchronous scheduling. Everything the step sizes comes from
the plan on the host (``kernels/torch_ops.Ragged``), so none is needed.

Watched on CPU, where the code is the same: every operation the plugin's code dispatches in a
layer (``TorchDispatchMode``: ``aten::_local_scalar_dense``, ``nonzero``, boolean-mask indexing,
``repeat_interleave`` without an output size, ...) and every tensor-to-host call it makes
(``tolist``, ``numpy``, ``cpu``, ``item``), over a real schedule (tests/step_driver.py): chunked
prompts of ragged lengths for every policy in one batch, each prompt completing in its own step,
then decoding; recall on and off, with both its prefill modes; the torch operations (the CPU
engine's, and what a GPU runs for ``column_sums`` and long selections) and the Triton kernels
(interpreted here, native on a GPU). LSH-E's torch victims are a host algorithm by design (the
CPU engine's; a GPU runs the Triton kernel): LSH-E is watched with the Triton kernels only.
"""

from __future__ import annotations

import collections
import os
import traceback

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.step_driver import Driver, Request
from vllm_kvevict.policies import POLICIES

#: operations that read the device to return a value or size an output
SYNCING = {
    "aten._local_scalar_dense.default",
    "aten.item.default",
    "aten.is_nonzero.default",
    "aten.equal.default",
    "aten.nonzero.default",
    "aten.nonzero_static.default",
    "aten.masked_select.default",
    "aten._unique2.default",
    "aten.unique_consecutive.default",
    "aten.unique_dim.default",
    "aten.bincount.default",
}
#: tensor methods that copy to the host
TO_HOST = ("tolist", "numpy", "cpu", "item", "__int__", "__float__", "__bool__", "__index__")


def _ours() -> str | None:
    """The plugin's frame that made the current call (None: not the plugin's code)."""
    for f in reversed(traceback.extract_stack()[:-2]):
        if "vllm_kvevict" in f.filename:
            return f"{f.filename.split('vllm_kvevict/')[-1]}:{f.lineno}"
        if "/tests/" in f.filename:
            return None
    return None


class SyncWatch(TorchDispatchMode):
    """Records each host sync the plugin's code makes: ``(what, where)`` -> count."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        syncs = name in SYNCING
        if name == "aten.repeat_interleave.Tensor":
            syncs = kwargs.get("output_size") is None
        if name in ("aten.index.Tensor", "aten.index_put.default", "aten.index_put_.default"):
            syncs = any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1])
        if syncs and (site := _ours()) is not None:
            self.seen[(name, site)] += 1
        return func(*args, **kwargs)


@pytest.fixture
def watch(monkeypatch):
    """A :class:`SyncWatch` per layer and the plugin's tensor-to-host calls, in one counter."""
    seen: collections.Counter = collections.Counter()
    inside = []  # a layer is being watched
    for meth in TO_HOST:
        orig = getattr(torch.Tensor, meth)

        def wrapped(self, *a, _orig=orig, _meth=meth, **k):
            if inside and (site := _ours()) is not None:
                seen[(_meth, site)] += 1
            return _orig(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, meth, wrapped)

    class Layer:
        def __init__(self, _layer: int) -> None:
            self.mode = SyncWatch()

        def __enter__(self):
            inside.append(self)
            self.mode.__enter__()

        def __exit__(self, *exc):
            self.mode.__exit__(*exc)
            inside.pop()
            seen.update(self.mode.seen)

    return Layer, seen


def _requests(kernels: str, scale: float, keys_only: bool = False) -> list[Request]:
    """Every policy without recall and every policy that keeps a tier with it, in one batch;
    ``keys_only``: the policies scored from keys or their queries' attention (and H2O's state)
    alone, one of them keeping a tier (the in-place step)."""
    prompts = [300, 200, 257, 180, 330, 140, 240, 150, 275, 199, 230, 170, 310]
    every = [p for p in POLICIES if p != "none" and (kernels == "triton" or p != "lshe")]
    if keys_only:
        mix = [
            (p, i == 8)
            for i, p in enumerate(
                ("keydiff", "knorm", "streamingllm", "random", "snapkv", "tova", "h2o", "caote", "keydiff")
            )
        ]
    else:
        mix = [(p, False) for p in every] + [(p, True) for p in every if p != "kvmerger"]  # merging keeps no tier
    return [
        Request(f"{p}-{i}-{r}", max(136, int(prompts[i % len(prompts)] * scale)), p, r) for i, (p, r) in enumerate(mix)
    ]


@pytest.mark.parametrize(
    "kernels, prefill, keys_only",
    [("torch", "window", False), ("torch", "all", False), ("triton", "all", False), ("triton", "all", True)],
)
def test_no_host_sync_in_any_layer_of_any_step(monkeypatch, watch, kernels, prefill, keys_only):
    """Triton's kernels run interpreted here (slow): one layer and shorter prompts for them."""
    if kernels == "triton":
        pytest.importorskip("triton")
        if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("no GPU and TRITON_INTERPRET unset when Triton was imported")
    monkeypatch.setenv("KVEVICT_KERNELS", kernels)
    requests = _requests(kernels, 0.7 if kernels == "triton" else 1.0, keys_only)
    server = {"policy": "keydiff", "budget": 64, "recall": {"enabled": True, "prefill": prefill}}
    driver = Driver(requests, server, layers=1 if kernels == "triton" else 2)
    Layer, seen = watch
    steps, compacted = 0, set()
    try:
        for tokens in driver.schedule(chunk=96 if kernels == "torch" else 64, decodes=3):
            plan = driver.step(tokens, watch=Layer)
            steps += 1
            compacted |= {plan.req_ids[r] for r in plan.compact_rows}
        failed = driver.fell_back()
    finally:
        driver.close()
    assert steps >= 5 and compacted == {r.rid for r in requests}, (
        steps,
        sorted({r.rid: r.prompt for r in requests if r.rid not in compacted}.items()),
    )
    assert not failed, f"requests fell back (the step did not run as asked): {failed}"
    assert not seen, "host syncs in the eviction step:\n" + "\n".join(
        f"{n} x {w} at {s}" for (w, s), n in seen.most_common()
    )
