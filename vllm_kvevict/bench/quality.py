"""Quality under eviction: retrieval accuracy per policy and budget, against the same server with
eviction off (per-request ``kvevict_enabled: false``) as the reference.

    python -m vllm_kvevict.bench.quality --base-url http://127.0.0.1:8000 --model smollm2 \\
        --tokenizer "$(python -m vllm_kvevict.testing.models smollm2 --print-path)" \\
        --configs keydiff,snapkv,caote:base=tova --budget-ratios 0.1,0.25 \\
        --tasks niah_single,niah_multikey --length 2000 --depths 4 --seeds 1

A configuration is ``policy`` or ``policy:key=value,key=value`` (the policy's parameters, sent as
``kvevict_params``). Budgets are ratios of each prompt's token count (chat template included),
sent per request (``kvevict_budget``), so one server measures every configuration. Prints a
table, writes JSON and, with ``--plot``, a PNG of accuracy versus kept fraction.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict

from vllm_kvevict.bench.tasks import TASKS, Task, depths

REFERENCE = "none"  # the same engine, eviction off for the request


def parse_spec(spec: str) -> tuple[str, dict]:
    """``policy[:k=v,...]`` -> (policy, params); values parsed as JSON where they parse."""
    policy, _, rest = spec.partition(":")
    params = {}
    for item in filter(None, rest.split(",")):
        k, _, v = item.partition("=")
        try:
            params[k] = json.loads(v)
        except json.JSONDecodeError:
            params[k] = v
    return policy, params


def _prompt_tokens(tokenizer, task: Task) -> int:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": task.prompt}], add_generation_prompt=True, tokenize=False
    )
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def run_quality(
    base_url: str, model: str, tokenizer, configs: list[str], budget_ratios: list[float], length: int,
    n_depths: int, seeds: list[int], tasks: list[str] = ("niah_single",), max_tokens: int = 32,
    concurrency: int = 2, progress: bool = False,
) -> dict:
    from openai import OpenAI

    client = OpenAI(base_url=base_url.rstrip("/") + "/v1", api_key="unused", max_retries=0, timeout=3600)
    items = [TASKS[t](tokenizer, length, d, s) for t in tasks for d in depths(n_depths) for s in seeds]
    jobs = []
    for task in items:
        n = _prompt_tokens(tokenizer, task)
        jobs.append((task, REFERENCE, None, {"kvevict_enabled": False}, n))
        for spec in configs:
            policy, params = parse_spec(spec)
            for ratio in budget_ratios:
                xargs = {"kvevict_policy": policy, "kvevict_budget": max(1, round(ratio * n))}
                if params:
                    xargs["kvevict_params"] = json.dumps(params)
                jobs.append((task, spec, ratio, xargs, n))

    def run(job):
        task, name, ratio, xargs, n = job
        t0 = time.perf_counter()
        r = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": task.prompt}], max_tokens=max_tokens,
            temperature=0, extra_body={"vllm_xargs": xargs},
        )
        out = r.choices[0].message.content or ""
        return {"task": task.name, "config": name, "budget_ratio": ratio, "xargs": xargs, "prompt_tokens": n,
                "depth": task.depth, "seed": task.seed, "answer": task.answer, "output": out,
                "score": task.score(out), "latency_s": round(time.perf_counter() - t0, 3)}

    with ThreadPoolExecutor(concurrency) as pool:
        it = pool.map(run, jobs)
        if progress:
            from tqdm import tqdm

            it = tqdm(it, total=len(jobs), desc="quality", unit="req")
        rows = list(it)
    return summarize(rows, configs, budget_ratios, tasks, length, n_depths, seeds, items)


def summarize(rows, configs, budget_ratios, tasks, length, n_depths, seeds, items) -> dict:
    def mean(xs):
        return sum(xs) / len(xs) if xs else None

    summary: dict[str, dict[str, float | None]] = {}  # config -> {"ratio" or "-": accuracy over tasks}
    per_task: dict[str, dict[str, dict[str, float | None]]] = {}
    for name in [REFERENCE, *configs]:
        for ratio in [None] if name == REFERENCE else budget_ratios:
            key = "-" if ratio is None else f"{ratio:g}"
            sel = [r for r in rows if r["config"] == name and r["budget_ratio"] == ratio]
            summary.setdefault(name, {})[key] = mean([r["score"] for r in sel])
            for t in tasks:
                per_task.setdefault(t, {}).setdefault(name, {})[key] = mean(
                    [r["score"] for r in sel if r["task"] == t]
                )
    return {
        "tasks": list(tasks), "length": length, "budget_ratios": list(budget_ratios), "depths": depths(n_depths),
        "seeds": list(seeds), "summary": summary, "per_task": per_task, "rows": rows,
        "items": [asdict(t) | {"prompt": None} for t in items],
    }


def format_table(result: dict) -> str:
    ratios = [f"{r:g}" for r in result["budget_ratios"]]
    tasks = result["tasks"]
    n = len(result["depths"]) * len(result["seeds"])
    lines = [f"{', '.join(tasks)}: ~{result['length']} tokens, {n} prompts per task; accuracy "
             f"(mean over tasks; per task in brackets) at budget = ratio x prompt tokens"]
    head = f"{'config':<26}" + "".join(f"{'kept ' + r:>22}" for r in ratios)
    lines.append(head)

    def cell(name, key):
        acc = result["summary"][name].get(key)
        if acc is None:
            return f"{'-':>22}"
        parts = "/".join(f"{result['per_task'][t][name][key]:.2f}" for t in tasks)
        return f"{f'{acc:.2f} ({parts})':>22}"

    ref = result["summary"][REFERENCE]["-"]
    lines.append(f"{'none (no eviction)':<26}" + f"{f'{ref:.2f}':>22}" * len(ratios))
    for name in result["summary"]:
        if name != REFERENCE:
            lines.append(f"{name:<26}" + "".join(cell(name, r) for r in ratios))
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5))
    xs = result["budget_ratios"]
    colors = plt.get_cmap("tab20").colors
    styles = ["-", "--", ":", "-."]
    names = [n for n in result["summary"] if n != REFERENCE]
    ax.axhline(result["summary"][REFERENCE]["-"], color="black", linewidth=2, label="no eviction")
    for i, name in enumerate(names):
        accs = result["summary"][name]
        jitter = (i - len(names) / 2) * 0.002  # equal scores stay distinguishable
        ax.plot([x + jitter for x in xs], [accs[f"{x:g}"] for x in xs], marker="os^vD"[i % 5],
                linestyle=styles[i % 4], color=colors[i % 20], label=name)
    ax.set_xlabel("kept fraction of the prompt (budget / prompt tokens)")
    ax.set_ylabel("accuracy")
    ax.set_title(f"{', '.join(result['tasks'])} (~{result['length']} tokens)")
    ax.set_ylim(-0.05, 1.05)
    ax.legend(fontsize=7, ncol=2, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


#: how the benchmarks start vLLM on this project's CPU machines (fp32 as the tests; eviction on)
CPU_SERVE_ARGS = ["--dtype", "float32", "--block-size", "32", "--enforce-eager", "--kv-cache-memory-bytes", "4G"]


@contextlib.contextmanager
def serve_or_connect(args):
    """A running server: the given ``--base-url``, or vLLM started here with kvevict."""
    if args.base_url:
        yield args.base_url, args.model, args.tokenizer or args.model_path
        return
    import shlex
    import tempfile

    from vllm_kvevict.testing.models import smollm2_path
    from vllm_kvevict.testing.server import VLLMServer

    path = args.model_path or str(smollm2_path())
    extra = shlex.split(args.server_args)
    cfg = {"kvevict": {"policy": "keydiff", "budget": 256}}  # every request sets its own
    srv_args = ["--attention-backend", "kvevict", *CPU_SERVE_ARGS, *extra, "--additional-config", json.dumps(cfg)]
    log = tempfile.NamedTemporaryFile(prefix="kvevict-bench-", suffix=".log", delete=False).name
    print(f"starting vLLM on {path} (log: {log})", file=sys.stderr)
    with VLLMServer(path, srv_args, log_path=log, served_model_name=args.model, startup_timeout=900) as srv:
        yield srv.base_url, srv.served_model_name, args.tokenizer or path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m vllm_kvevict.bench.quality", description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", help="a running server; without it, vLLM is started on --model-path")
    ap.add_argument("--model", default="model", help="served model name")
    ap.add_argument("--tokenizer", help="tokenizer path (to size prompts and budgets); default --model-path")
    ap.add_argument("--model-path", help="model to serve (default: the bundled SmolLM2)")
    ap.add_argument("--server-args", default="", help="extra vllm serve arguments when starting it")
    ap.add_argument("--configs", default="keydiff,streamingllm", help="comma-separated policy[:k=v;...] specs")
    ap.add_argument("--budget-ratios", default="0.25")
    ap.add_argument("--tasks", default="niah_single", help=f"comma-separated, of {', '.join(TASKS)}")
    ap.add_argument("--length", type=int, default=3000)
    ap.add_argument("--depths", type=int, default=5)
    ap.add_argument("--seeds", default="1,2")
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--out", default="quality.json")
    ap.add_argument("--plot", default=None, help="PNG path")
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer

    # Parameters inside a spec are separated by ';' on the command line (',' separates specs).
    configs = [c.replace(";", ",") for c in args.configs.split(",")]
    with serve_or_connect(args) as (base_url, model, tokenizer_path):
        result = run_quality(
            base_url, model, AutoTokenizer.from_pretrained(tokenizer_path), configs,
            [float(r) for r in args.budget_ratios.split(",")], args.length, args.depths,
            [int(s) for s in args.seeds.split(",")], args.tasks.split(","), concurrency=args.concurrency,
            progress=True,
        )
    print(format_table(result))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    if args.plot:
        plot(result, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
