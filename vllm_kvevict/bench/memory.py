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
"""

from __future__ import annotations

from vllm_kvevict.bench.serving import BLOCK, Sampler, ServerSpec, common_args, random_prompts, serve, stream_completion
from vllm_kvevict.window import WindowConfig, window_bound_blocks

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
) -> dict:
    from openai import OpenAI

    kv_blocks = -(-(prompt_len + output_len) // BLOCK) + 2
    common = common_args(kv_blocks, prompt_len + output_len, 1, chunk)
    prompt = random_prompts(1, prompt_len, seed=1)[0]
    bound = window_bound_blocks(WindowConfig(budget=budget, block_size=BLOCK), chunk)
    series = {}
    specs = [ServerSpec("stock"), ServerSpec("kvevict", policy, budget)]
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(specs), desc="memory", unit="server")
    for spec in specs:
        with serve(model, spec, common, log_dir) as srv:
            client = OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0, timeout=3600)
            with Sampler(srv.base_url, period_s) as sampler:
                timing = stream_completion(client, srv.served_model_name, prompt, output_len)
            pts = [(round(t, 3), round(u * kv_blocks, 2)) for t, u, _ in sampler.series]
            series[spec.name] = {"points": pts, "peak_blocks": max((b for _, b in pts), default=0.0), **timing}
            if spec.policy is not None:
                # logged by the engine core right after the request is freed: wait for it, never sleep
                m = srv.wait_log(RELEASED, timeout=60)[-1]
                series[spec.name]["engine_peak_blocks"] = int(m["peak"])
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return {
        "model": model,
        "prompt_len": prompt_len,
        "output_len": output_len,
        "budget": budget,
        "policy": policy,
        "chunk": chunk,
        "block_size": BLOCK,
        "kv_blocks": kv_blocks,
        "window_bound_blocks": bound,
        "sequence_blocks": -(-(prompt_len + output_len) // BLOCK),
        "series": series,
    }


def format_table(report: dict) -> str:
    lines = [
        f"one request: {report['prompt_len']} prompt + {report['output_len']} output tokens, chunk "
        f"{report['chunk']}, block {report['block_size']}; kvevict {report['policy']} budget {report['budget']} "
        f"(window bound {report['window_bound_blocks']} blocks; the whole sequence is "
        f"{report['sequence_blocks']} blocks)",
        f"{'server':<10}{'peak blocks':>13}{'engine peak':>13}{'latency s':>11}{'samples':>9}",
    ]
    for name, s in report["series"].items():
        engine = str(s.get("engine_peak_blocks", "-"))
        lines.append(f"{name:<10}{s['peak_blocks']:>13.1f}{engine:>13}{s['latency_s']:>11.1f}{len(s['points']):>9}")
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
    ax.axhline(report["window_bound_blocks"], color="red", linestyle=":", label="kvevict window bound")
    ax.set_xlabel("seconds since the request was sent")
    ax.set_ylabel("KV blocks in use")
    ax.set_title(f"{report['prompt_len']}+{report['output_len']} tokens, {report['policy']} budget {report['budget']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
