# SPDX-License-Identifier: Apache-2.0
"""Kernel benchmark below vLLM: the batched eviction step against the attention it serves and the
device's copy bandwidth, at a model's shapes (default Llama-3.1-8B: 32 query heads, 8 KV heads,
head_dim 128, bf16), for several request counts and context lengths.

    python -m vllm_kvevict.bench.kernels --device cuda --requests 1,8,64 --contexts 2048,8192,32768

Per (requests R, context n) on one layer's paged cache (FlashAttention layout, block 16):

* ``compact``: gather the window through the block table, select ``budget`` tokens per (request,
  KV head), scatter them right-aligned (:mod:`vllm_kvevict.kernels.ops`: Triton on CUDA). Reported
  as bytes moved (K and V of the kept tokens, read and written) per second, and as a fraction of
  the device-to-device copy bandwidth measured in the same run (``torch.Tensor.copy_`` of 1 GiB);
  ``all x``: the step's whole cache traffic (the gather of every token's K and V, read and written,
  plus the kept ones' scatter) as that fraction.
* ``chunk``: one prefill chunk's eviction work (scores + select + scatter over the window
  ``budget + chunk``) against the chunk's attention over its context in the same run
  (``scaled_dot_product_attention`` with a lower-right causal mask, the chunk's queries over the
  window, which torch runs as FlashAttention on CUDA): the fraction eviction adds. Scores:
  ``--score keydiff`` (batched over the requests), ``snapkv`` (every request's 32-query window
  attention in one ragged ``column_sums``, as the engine runs it) or ``recall`` (recall's
  query-aware score, :func:`~vllm_kvevict.backends.recall.recall_scores`, one request at a time as
  the engine runs it, over the window as candidates, max-pooled over 31 positions, the 32 query
  positions protected). ``layer``: the same chunk's whole prefill step in that layer, the
  attention above plus the layer's projections and MLP as GEMMs of the model's sizes over the
  chunk's tokens (``--hidden``, ``--intermediate``; QKV, O, gate and up, down), timed in the same
  run: the fraction eviction adds to the layer (its norms, RoPE and activation are elementwise
  and left out, so the fraction is an upper bound).
* ``step``: the engine's own eviction step for that chunk (:func:`engine_step`:
  :func:`~vllm_kvevict.backends.evict.evict_step` on the cache views in place, as a layer after
  the step's first runs it; ``--score`` names its policy: KeyDiff, SnapKV with its 32-query
  window, or KeyDiff keeping what it drops for recall's tiers), and ``step/layer`` its fraction
  of the layer's prefill step: what a served model pays. ``chunk`` above is the benchmark's own
  composition of the kernels (gathered, with host reads), kept to compare.

Times are medians of CUDA-event-timed repetitions (wall clock on CPU). Prints a table and writes
JSON and a PNG. No vLLM needed: this is what runs on a machine with a GPU and only torch + Triton.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch.nn.attention.bias import causal_lower_right

from vllm_kvevict import envs
from vllm_kvevict.backends.recall import recall_scores
from vllm_kvevict.kernels import ops
from vllm_kvevict.kernels.ops import FUSED
from vllm_kvevict.policies.keydiff import keydiff_scores

#: recall's pooling width in the benchmark (the server's default, config.RecallConfig.kernel)
RECALL_KERNEL = 31
SCORES = ("keydiff", "snapkv", "recall")


def _timer(device: torch.device, fn, reps: int) -> float:
    """Median seconds of ``fn()`` after one warm-up."""
    fn()
    out = []
    for _ in range(reps):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            out.append(a.elapsed_time(b) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return statistics.median(out)


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30, reps: int = 10) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write counted)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / _timer(device, lambda: dst.copy_(src), reps)


def paged_layer(R: int, n: int, H: int, D: int, bs: int, dtype, device):
    """One layer's cache holding ``R`` requests of ``n`` tokens in shuffled blocks, and its table."""
    per = -(-n // bs)
    nb = R * per + 1
    cache = torch.randn(nb, H, bs, 2 * D, dtype=dtype, device=device)  # vLLM's [nb, H, bs, 2D]
    table = (torch.randperm(nb - 1, device=device)[: R * per] + 1).reshape(R, per).to(torch.int32)
    k, v = cache.transpose(1, 2).split(D, dim=-1)
    return cache, k, v, table


def layer_gemms(tokens: int, hidden: int, inter: int, Hq: int, H: int, D: int, dtype, device):
    """A decoder layer's GEMMs over ``tokens`` tokens at the model's sizes (QKV, O, gate and up,
    down), as a callable: the rest of the layer's prefill step beside its attention."""
    g = torch.Generator(device=device).manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g, device=device).to(dtype) / shape[0] ** 0.5

    x, attn, act = rand(tokens, hidden), rand(tokens, Hq * D), rand(tokens, inter)
    w_qkv, w_o, w_gu, w_d = (
        rand(hidden, (Hq + 2 * H) * D),
        rand(Hq * D, hidden),
        rand(hidden, 2 * inter),
        rand(inter, hidden),
    )

    def run():
        return x @ w_qkv, attn @ w_o, x @ w_gu, act @ w_d

    return run


def row_positions(K, cu) -> torch.Tensor:
    """``[N, H]``: each packed token's position within its request (the same on every head)."""
    pos = torch.arange(K.shape[0], device=K.device)[:, None] - cu[:-1].repeat_interleave(cu[1:] - cu[:-1])[:, None]
    return pos.expand(-1, K.shape[1]).contiguous()


def window_queries(Qw, pos, cu) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The requests' window queries ``Qw [R, H_q, w, D]`` packed for ``column_sums``: ``Q [R w,
    H_q, D]``, their positions (each request's last ``w``) and ``cu_q``."""
    R, Hq, w, D = Qw.shape
    last = pos[cu[1:] - 1, 0]  # each request's newest position
    q_pos = (last[:, None] - w + 1 + torch.arange(w, device=pos.device)).reshape(-1)
    cu_q = torch.arange(R + 1, device=pos.device) * w
    return Qw.transpose(1, 2).reshape(R * w, Hq, D), q_pos, cu_q


def snapkv_scores(K, pos, cu, Qw, G: int) -> torch.Tensor:
    """``[N, H]``: the attention each key receives from its request's window queries
    ``Qw [R, H_q, w, D]``, summed and group-averaged (the SnapKV/TOVA/H2O/CAOTE/CriticalKV building
    block): one ragged ``column_sums`` for every request, as the engine runs it."""
    Q, q_pos, cu_q = window_queries(Qw, pos, cu)
    cs = ops.column_sums(Q, K, q_pos, pos, cu_q, cu, G, Qw.shape[-1] ** -0.5)
    return cs.reshape(K.shape[0], -1, G).mean(dim=-1)


def recall_step_scores(K, pos, cu, Qw, G: int) -> torch.Tensor:
    """``[N, H]``: recall's query-aware score of every request's candidates, one request at a time
    (as the engine's recall runs), its window queries' own positions protected (``inf``)."""
    R, Hq, w, D = Qw.shape
    out = []
    for r in range(R):
        a, b = int(cu[r]), int(cu[r + 1])
        last = pos[b - 1, 0]
        q_pos = last - w + 1 + torch.arange(w, device=K.device)
        s = recall_scores(Qw[r], q_pos, K[a:b], pos[a:b], G, D**-0.5, None, RECALL_KERNEL)
        out.append(s.masked_fill(pos[a:b] > last - w, float("inf")))
    return torch.cat(out)


def eviction_step(k, v, table, rows, starts, ends, budget: int, score: str = "keydiff", Qw=None, G: int = 1):
    K, V, cu = ops.gather_paged(k, v, table, rows, starts, ends)
    pos = row_positions(K, cu)
    if score == "keydiff":
        scores = keydiff_scores(K, cu)
    elif score == "snapkv":
        scores = snapkv_scores(K, pos, cu, Qw, G)
    else:
        scores = recall_step_scores(K, pos, cu, Qw, G)
    keep = torch.full((rows.numel(),), budget, device=K.device)
    idx, cu_keep = ops.select_topk(scores, pos, cu, keep)
    dst = ends - (cu_keep[1:] - cu_keep[:-1])
    ops.scatter_paged(k, K, idx, cu, cu_keep, table, rows, dst)
    ops.scatter_paged(v, V, idx, cu, cu_keep, table, rows, dst)
    return int(cu_keep[-1])


def engine_step(
    R: int, n: int, chunk: int, budget: int, score: str, Hq: int, H: int, D: int, bs: int, dtype, dev
) -> EngineStep:
    """The engine's own eviction step (:func:`~vllm_kvevict.backends.evict.evict_step`, in place
    on the cache views) for one prefill chunk of ``R`` requests at context ``n``: every request's
    window ``[n - budget - chunk, n)`` compacted to its last ``budget`` tokens, as a layer after
    the step's first runs it (the step's geometry made by a first call). ``recall``: KeyDiff
    keeping what it drops for the requests' tiers."""
    from vllm_kvevict.backends.evict import RowWork
    from vllm_kvevict.backends.plan import StepPlan
    from vllm_kvevict.policies import get_policy
    from vllm_kvevict.policies.base import RowInputs

    win = min(n, budget + chunk)
    first, per = (n - win) // bs, -(-n // bs)
    wb = per - first  # each request's window blocks, the others freed (the null block)
    cache = torch.randn(R * wb + 1, H, bs, 2 * D, dtype=dtype, device=dev)
    table = torch.zeros(R, per, dtype=torch.int32, device=dev)
    table[:, first:] = (torch.randperm(R * wb, device=dev) + 1).view(R, wb).to(torch.int32)
    t = torch.arange(first * bs, n, device=dev)
    slots = table[:, t // bs].long() * bs + t % bs  # [R, window tokens]
    slot_pos = torch.zeros(cache.shape[0] * bs, H, dtype=torch.int32, device=dev)
    slot_pos[slots.flatten()] = t.repeat(R)[:, None].to(torch.int32)
    policy = get_policy("keydiff" if score != "snapkv" else "snapkv")
    Qw = torch.randn(R, Hq, 32, D, dtype=dtype, device=dev)
    work = [
        RowWork(
            r, policy, True, RowInputs(L=n, budget=budget, Q=Qw[r] if score == "snapkv" else None), score == "recall"
        )
        for r in range(R)
    ]
    plan = StepPlan(
        L_prev=[n - chunk] * R,
        e_prev=[n - win] * R,
        e_new=[n - budget] * R,
        seq_lens=[n] * R,
        block_table=table,
        slot_mapping=torch.empty(0, device=dev),
        positions=torch.empty(0, device=dev),
        req_ids=None,
        states=[],
        query_start_loc=[0] * (R + 1),
    )
    step = EngineStep(plan, work, bs, slot_pos, cache, Hq // H, score == "recall")
    step()
    return step


@dataclass
class EngineStep:
    """One layer's eviction step for a planned chunk (:func:`engine_step`), called to run it."""

    plan: Any
    work: list
    block_size: int
    slot_pos: torch.Tensor
    cache: torch.Tensor  # the layer's [blocks, H, block_size, 2D]
    G: int
    recall: bool
    evicted: dict | None = None  # what the last call handed to the tiers (recall)

    def __call__(self) -> None:
        from vllm_kvevict.backends import flash_layout as fl
        from vllm_kvevict.backends.evict import evict_step

        self.evicted = {} if self.recall else None
        gather, write = partial(fl.gather_tokens, self.cache), partial(fl.write_tokens, self.cache)
        evict_step(
            self.plan,
            self.work,
            self.block_size,
            gather,
            write,
            self.slot_pos,
            {},
            layer=1,
            G=self.G,
            views=fl.cache_views(self.cache),
            evicted=self.evicted,
            positions=False,
        )


def implementations(device: torch.device) -> dict[str, object]:
    """The kernel modules that run on ``device``: torch always; Triton and the CUDA extension on a
    GPU where they import and build."""
    from vllm_kvevict.kernels import torch_ops

    mods: dict[str, object] = {"torch": torch_ops}
    if device.type == "cuda":
        try:
            from vllm_kvevict.kernels import triton_ops

            mods["triton"] = triton_ops
        except ImportError:
            pass
        try:
            from vllm_kvevict.kernels import cuda_ops

            cuda_ops.build()
            mods["cuda"] = cuda_ops
        except Exception as e:  # noqa: BLE001 - reported, the others still measured
            print(f"cuda kernels not measured: {e}", file=sys.stderr)
    return mods


def op_times(k, v, table, rows, starts, ends, budget: int, Qw, G: int, reps: int) -> dict[str, dict[str, float]]:
    """Median seconds of each operation of one eviction step over the windows ``[starts, ends)``,
    per implementation that has it: which one each op should default to."""
    dev = k.device
    mods = implementations(dev)
    K, V, cu = ops.gather_paged(k, v, table, rows, starts, ends)
    pos = row_positions(K, cu)
    scores = keydiff_scores(K, cu)
    keep = torch.full((rows.numel(),), budget, device=dev)
    idx, cu_keep = ops.select_topk(scores, pos, cu, keep)
    dst = ends - (cu_keep[1:] - cu_keep[:-1])
    Q, q_pos, cu_q = window_queries(Qw, pos, cu)
    D = Qw.shape[-1]
    calls = {
        "gather_paged": lambda m: m.gather_paged(k, v, table, rows, starts, ends),
        "keydiff_scores": lambda m: (m.keydiff_scores if m is not mods["torch"] else FUSED["keydiff_scores"])(K, cu),
        "select_topk": lambda m: m.select_topk(scores, pos, cu, keep),
        "scatter_paged": lambda m: m.scatter_paged(k, K, idx, cu, cu_keep, table, rows, dst),
        "column_sums": lambda m: m.column_sums(Q, K, q_pos, pos, cu_q, cu, G, D**-0.5, None),
    }
    out: dict[str, dict[str, float]] = {}
    for op, call in calls.items():
        out[op] = {
            name: _timer(dev, lambda m=m: call(m), reps)
            for name, m in mods.items()
            if hasattr(m, op) or (name == "torch" and op in FUSED)
        }
    return out


def run(
    device: str,
    requests: list[int],
    contexts: list[int],
    chunk: int,
    budget_ratio: float,
    Hq: int,
    H: int,
    D: int,
    bs: int,
    dtype: torch.dtype,
    reps: int,
    score: str = "keydiff",
    per_op: bool = False,
    hidden: int = 4096,
    inter: int = 14336,
) -> dict:
    dev = torch.device(device)
    bw = copy_bandwidth(dev, 1 << 30 if dev.type == "cuda" else 1 << 26)
    rows_out = []
    for R in requests:
        for n in contexts:
            cache, k, v, table = paged_layer(R, n, H, D, bs, dtype, dev)
            rows = torch.arange(R, device=dev, dtype=torch.int32)
            budget = max(1, int(budget_ratio * n))
            starts = torch.zeros(R, dtype=torch.int64, device=dev)
            ends = torch.full((R,), n, dtype=torch.int64, device=dev)
            # compaction of the whole context down to the budget
            kept = eviction_step(k, v, table, rows, starts, ends, budget)
            t_all = _timer(dev, lambda: eviction_step(k, v, table, rows, starts, ends, budget), reps)
            moved = 2 * 2 * kept * H * D * k.element_size()  # K and V, read and written
            # all the step's cache traffic: the gather reads and writes every token's K and V, the
            # scatter the kept ones (scores and selection read the gathered copy: not counted)
            traffic = moved + 2 * 2 * R * n * H * D * k.element_size()
            # one prefill chunk: eviction over the window budget + chunk vs the chunk's attention over it
            win = min(n, budget + chunk)
            w_ends = torch.full((R,), win, dtype=torch.int64, device=dev)
            Qw = torch.randn(R, Hq, 32, D, dtype=dtype, device=dev)
            t_chunk = _timer(
                dev, lambda: eviction_step(k, v, table, rows, starts, w_ends, budget, score, Qw, Hq // H), reps
            )
            q = torch.randn(R, Hq, chunk, D, dtype=dtype, device=dev)
            kk = torch.randn(R, H, win, D, dtype=dtype, device=dev).repeat_interleave(Hq // H, dim=1)
            vv = torch.randn_like(kk)
            mask = causal_lower_right(chunk, win)  # the chunk's queries are the window's last: FlashAttention on CUDA

            def attn():
                return torch.nn.functional.scaled_dot_product_attention(q, kk, vv, attn_mask=mask)

            t_attn = _timer(dev, attn, reps)
            t_gemm = _timer(dev, layer_gemms(R * chunk, hidden, inter, Hq, H, D, dtype, dev), reps)
            t_step = _timer(dev, engine_step(R, n, chunk, budget, score, Hq, H, D, bs, dtype, dev), reps)
            by_op = {}
            if per_op:  # each op per implementation: over the whole context and over one chunk's window
                G = Hq // H
                by_op = {
                    "context": op_times(k, v, table, rows, starts, ends, budget, Qw, G, reps),
                    "window": op_times(k, v, table, rows, starts, w_ends, budget, Qw, G, reps),
                }
            rows_out.append(
                {
                    "requests": R,
                    "context": n,
                    "budget": budget,
                    "compact_s": t_all,
                    "compact_bytes": moved,
                    "compact_bw": moved / t_all,
                    "compact_bw_fraction": moved / t_all / bw,
                    "traffic_bytes": traffic,
                    "traffic_bw_fraction": traffic / t_all / bw,
                    "window": win,
                    "chunk": chunk,
                    "chunk_evict_s": t_chunk,
                    "chunk_attn_s": t_attn,
                    "chunk_fraction": t_chunk / t_attn,
                    "chunk_layer_s": t_attn + t_gemm,
                    "layer_fraction": t_chunk / (t_attn + t_gemm),
                    "step_s": t_step,
                    "step_layer_fraction": t_step / (t_attn + t_gemm),
                    **({"ops": by_op} if by_op else {}),
                }
            )
            del cache
            k = v = q = kk = vv = None  # type: ignore[assignment]  # free the device memory before the next size
            print(format_row(rows_out[-1]), file=sys.stderr)
    return {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "copy_bw": bw,
        "shapes": {
            "q_heads": Hq,
            "kv_heads": H,
            "head_dim": D,
            "hidden": hidden,
            "intermediate": inter,
            "block_size": bs,
            "dtype": str(dtype),
        },
        "kernels": (
            envs.KVEVICT_KERNELS
            if envs.KVEVICT_KERNELS != "auto"
            else ops.backend_for(torch.empty(0, device=dev)).__name__.rsplit(".", 1)[-1].removesuffix("_ops")
        ),
        "score": score,
        "rows": rows_out,
    }


def format_row(r: dict) -> str:
    return (
        f"{r['requests']:>5}{r['context']:>8}{r['budget']:>8}{r['compact_s'] * 1e3:>11.3f}"
        f"{r['compact_bw'] / 1e9:>10.1f}{r['compact_bw_fraction']:>8.2f}{r['traffic_bw_fraction']:>8.2f}"
        f"{r['chunk_evict_s'] * 1e3:>12.3f}"
        f"{r['chunk_attn_s'] * 1e3:>10.3f}{r['chunk_fraction']:>8.3f}"
        f"{r['chunk_layer_s'] * 1e3:>11.3f}{r['layer_fraction']:>9.3f}"
        f"{r['step_s'] * 1e3:>10.3f}{r['step_layer_fraction']:>11.3f}"
    )


def format_table(report: dict) -> str:
    lines = [
        f"{report['device']} ({report['kernels']} kernels, {report.get('score', 'keydiff')} scores), copy bandwidth {report['copy_bw'] / 1e9:.0f} GB/s; "
        f"per layer, {report['shapes']}",
        f"{'reqs':>5}{'context':>8}{'budget':>8}{'compact ms':>11}{'GB/s':>10}{'x copy':>8}{'all x':>8}"
        f"{'chunk ev ms':>12}"
        f"{'attn ms':>10}{'ev/attn':>8}{'layer ms':>11}{'ev/layer':>9}{'step ms':>10}{'step/layer':>11}",
    ]
    lines += [format_row(r) for r in report["rows"]]
    timed = [r for r in report["rows"] if "ops" in r]
    if timed:
        impls = sorted({i for r in timed for t in r["ops"].values() for o in t.values() for i in o})
        lines += ["", "per op, ms (over the whole context / one chunk's window):"]
        lines.append(f"{'reqs':>5}{'tokens':>8} {'op':<16}" + "".join(f"{i:>10}" for i in impls))
        for r in timed:
            for where, table in r["ops"].items():
                n = r["context"] if where == "context" else r["window"]
                for op, t in table.items():
                    cells = "".join(f"{t[i] * 1e3:>10.3f}" if i in t else f"{'-':>10}" for i in impls)
                    lines.append(f"{r['requests']:>5}{n:>8} {op:<16}{cells}")
    return "\n".join(lines)


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    for R in sorted({r["requests"] for r in report["rows"]}):
        rs = [r for r in report["rows"] if r["requests"] == R]
        a1.plot([r["context"] for r in rs], [r["compact_bw_fraction"] for r in rs], marker="o", label=f"{R} req")
        a2.plot([r["context"] for r in rs], [r["step_layer_fraction"] for r in rs], marker="o", label=f"{R} req")
    a1.set_xscale("log", base=2)
    a2.set_xscale("log", base=2)
    a1.set_xlabel("context tokens")
    a2.set_xlabel("context tokens")
    a1.set_ylabel("compaction bandwidth / copy bandwidth")
    a2.set_ylabel("the engine's eviction step / the layer's prefill step (one chunk)")
    a1.legend()
    a2.legend()
    fig.suptitle(f"{report['device']}: batched eviction kernels")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m vllm_kvevict.bench.kernels", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--requests", default="1,8,64")
    ap.add_argument("--contexts", default="2048,8192,32768")
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--budget-ratio", type=float, default=0.25)
    ap.add_argument("--q-heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=4096, help="the model's hidden size (the layer's GEMMs)")
    ap.add_argument("--intermediate", type=int, default=14336, help="the MLP's intermediate size")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--score", choices=SCORES, default="keydiff")
    ap.add_argument("--ops", action="store_true", help="also time each op per implementation (torch, triton, cuda)")
    ap.add_argument("--out", default="bench-results")
    a = ap.parse_args(argv)
    report = run(
        a.device,
        [int(x) for x in a.requests.split(",")],
        [int(x) for x in a.contexts.split(",")],
        a.chunk,
        a.budget_ratio,
        a.q_heads,
        a.kv_heads,
        a.head_dim,
        a.block_size,
        getattr(torch, a.dtype),
        a.reps,
        a.score,
        a.ops,
        a.hidden,
        a.intermediate,
    )
    print(format_table(report))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "kernels.json").write_text(json.dumps(report, indent=1))
    plot(report, str(out / "kernels.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
