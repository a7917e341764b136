# SPDX-License-Identifier: Apache-2.0
"""The kernel benchmark (``python -m vllm_kvevict.bench.kernels``) on CPU at tiny shapes: its
eviction step does what the engine's does (checked against a per-request recomputation), and a
run prints its table and writes well-formed JSON and a PNG. The GPU numbers come from the same
script on a lent GPU (docs/benchmarks.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vllm_kvevict.bench import kernels as bench
from vllm_kvevict.kernels import torch_ops as ref
from vllm_kvevict.kernels.ops import FUSED
from vllm_kvevict.policies.attention import pool1d
from vllm_kvevict.policies.base import topk_newer


@pytest.mark.parametrize("score", bench.SCORES)
@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_eviction_step_keeps_the_top_tokens_right_aligned(monkeypatch, score, kernels):
    if kernels == "triton":
        pytest.importorskip("triton")
    monkeypatch.setenv("KVEVICT_KERNELS", kernels)
    torch.manual_seed(0)
    R, n, H, Hq, D, bs, budget = 3, 70, 2, 4, 64, 16, 20
    if score == "recall":  # more than its 32 protected query positions
        budget = 45
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    cache, k, v, table = bench.paged_layer(R, n, H, D, bs, torch.float32, dev)
    rows = torch.arange(R, dtype=torch.int32, device=dev)
    starts, ends = torch.zeros(R, dtype=torch.long, device=dev), torch.full((R,), n, device=dev)
    Qw = torch.randn(R, Hq, 32, D, device=dev)
    before_k, before_v = k.clone().cpu(), v.clone().cpu()
    assert bench.eviction_step(k, v, table, rows, starts, ends, budget, score, Qw, Hq // H) == R * budget
    k, v, table, Qw = (x.cpu() for x in (k, v, table, Qw))  # checked on CPU
    for r in range(R):
        i = torch.arange(n)
        Kr = before_k[table[r][i // bs].long(), i % bs]  # [n, H, D]
        Vr = before_v[table[r][i // bs].long(), i % bs]
        pos = i[None, :].expand(H, n)
        if score == "keydiff":
            s = FUSED["keydiff_scores"](Kr, torch.tensor([0, n])).T
        else:  # the window's attention summed per key, mean over each KV head's query group
            p = ref.attention_probs(Qw[r], Kr.transpose(0, 1), torch.arange(n - 32, n), pos, Hq // H, D**-0.5)
            s = p.sum(dim=1).reshape(H, Hq // H, n).mean(dim=1)
            if score == "recall":  # max-pooled over neighbouring positions, the query window kept
                s = pool1d(s, bench.RECALL_KERNEL, "max")
                s[:, n - 32 :] = float("inf")
        kept = topk_newer(s, budget, pos)  # [H, budget], ascending
        j = torch.arange(n - budget, n)
        h = torch.arange(H)
        got_k = k[table[r][j // bs].long(), j % bs]  # [budget, H, D]: right-aligned in the request's blocks
        got_v = v[table[r][j // bs].long(), j % bs]
        torch.testing.assert_close(got_k, Kr[kept.T, h], rtol=0, atol=0)
        torch.testing.assert_close(got_v, Vr[kept.T, h], rtol=0, atol=0)


def test_run_writes_table_json_and_plot(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("KVEVICT_KERNELS", "torch")
    assert (
        bench.main(
            [
                "--device",
                "cpu",
                "--requests",
                "1,2",
                "--contexts",
                "128,256",
                "--chunk",
                "32",
                "--q-heads",
                "4",
                "--kv-heads",
                "2",
                "--head-dim",
                "64",
                "--hidden",
                "256",
                "--intermediate",
                "512",
                "--dtype",
                "float32",
                "--reps",
                "1",
                "--score",
                "snapkv",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    report = json.loads((tmp_path / "kernels.json").read_text())
    assert report["device"] == "cpu" and report["kernels"] == "torch" and report["score"] == "snapkv"
    assert [(r["requests"], r["context"]) for r in report["rows"]] == [(1, 128), (1, 256), (2, 128), (2, 256)]
    for r in report["rows"]:
        assert r["budget"] == r["context"] // 4 and r["window"] == r["budget"] + 32
        assert r["compact_bytes"] == 2 * 2 * r["requests"] * r["budget"] * 2 * 64 * 4
        assert r["traffic_bytes"] == r["compact_bytes"] + 2 * 2 * r["requests"] * r["context"] * 2 * 64 * 4
        assert r["traffic_bw_fraction"] == pytest.approx(r["traffic_bytes"] / r["compact_s"] / report["copy_bw"])
        assert r["compact_s"] > 0 and r["chunk_evict_s"] > 0 and r["chunk_attn_s"] > 0
        assert r["chunk_fraction"] == pytest.approx(r["chunk_evict_s"] / r["chunk_attn_s"])
        assert r["chunk_layer_s"] > r["chunk_attn_s"]  # the layer's GEMMs beside its attention
        assert r["layer_fraction"] == pytest.approx(r["chunk_evict_s"] / r["chunk_layer_s"])
        assert r["step_s"] > 0 and r["step_layer_fraction"] == pytest.approx(r["step_s"] / r["chunk_layer_s"])
    assert report["shapes"]["hidden"] == 256 and report["shapes"]["intermediate"] == 512
    assert (tmp_path / "kernels.png").stat().st_size > 1000
    assert "step/layer" in capsys.readouterr().out


@pytest.mark.parametrize("score", bench.SCORES)
def test_engine_step_compacts_each_window_to_its_budget(monkeypatch, score):
    """The step the benchmark times is the engine's: each request's window ``[n - budget - chunk,
    n)`` ends up as ``budget`` tokens per KV head, right-aligned, positions from that window in
    order; ``recall``: what each request drops handed to its tier, with its scores."""
    monkeypatch.setenv("KVEVICT_KERNELS", "torch")
    R, n, chunk, budget, bs, H = 3, 200, 64, 48, 16, 2
    step = bench.engine_step(R, n, chunk, budget, score, 4, H, 32, bs, torch.float32, torch.device("cpu"))
    plan, slot_pos = step.plan, step.slot_pos
    for r in range(R):
        i = torch.arange(n - budget, n)
        got = slot_pos[plan.block_table[r][i // bs].long() * bs + i % bs].long()  # [budget, H]
        assert ((got >= n - budget - chunk) & (got < n)).all()
        assert (got[1:] > got[:-1]).all(), "kept in position order, each once"
        if score == "snapkv":  # the observation window is always kept
            assert (got[-32:] == torch.arange(n - 32, n)[:, None]).all()
    if score == "recall":
        assert sorted(step.evicted) == list(range(R)) and all(e[0].shape[0] == chunk for e in step.evicted.values())
    else:
        assert step.evicted is None


def test_layer_gemms_are_the_layers_projections_and_mlp():
    """QKV, O, gate and up, down over the chunk's tokens, at the model's sizes."""
    out = bench.layer_gemms(48, 64, 160, 8, 2, 16, torch.float32, torch.device("cpu"))()
    assert [tuple(t.shape) for t in out] == [(48, (8 + 2 * 2) * 16), (48, 64), (48, 2 * 160), (48, 64)]


def test_ops_are_timed_per_implementation(tmp_path, capsys):
    """``--ops``: every op of the step timed per implementation that runs on the device (torch
    alone on CPU), over the whole context and over one chunk's window."""
    args = "--device cpu --requests 2 --contexts 128 --chunk 32 --q-heads 4 --kv-heads 2 --head-dim 64 --hidden 128"
    assert bench.main([*args.split(), "--dtype", "float32", "--reps", "1", "--ops", "--out", str(tmp_path)]) == 0
    (row,) = json.loads((tmp_path / "kernels.json").read_text())["rows"]
    ops = ("gather_paged", "keydiff_scores", "select_topk", "scatter_paged", "column_sums")
    for where in ("context", "window"):
        assert set(row["ops"][where]) == set(ops)
        assert all(set(t) == {"torch"} and t["torch"] > 0 for t in row["ops"][where].values())
    assert "select_topk" in capsys.readouterr().out


def test_the_gpu_machines_modules_run_without_vllm(tmp_path):
    """The GPU machine has torch, Triton and nvcc but no vLLM (``scripts/gpu_check.sh``): the
    benchmark and the kernel tests it runs import, and the benchmark runs, with every ``vllm``
    import refused."""
    code = f"""
import sys
class NoVLLM:
    def find_spec(self, name, path=None, target=None):
        if name == "vllm" or name.startswith("vllm."):
            raise ImportError("no vLLM on this machine: " + name)
sys.meta_path.insert(0, NoVLLM())
import tests.test_kernels_batched, tests.test_kernels_policy, tests.test_csrc, tests.test_recall
import tests.test_evict_step
from vllm_kvevict.bench import kernels
args = "--device cpu --requests 2 --contexts 128 --chunk 32 --q-heads 4 --kv-heads 2 --head-dim 32 --hidden 64"
sys.exit(kernels.main([*args.split(), "--intermediate", "128", "--reps", "1", "--score", "recall", "--out", {str(tmp_path)!r}]))
"""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "KVEVICT_KERNELS": "torch", "PYTHONPATH": str(root)}
    out = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads((tmp_path / "kernels.json").read_text())["rows"][0]["step_s"] > 0
