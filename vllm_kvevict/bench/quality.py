# SPDX-License-Identifier: Apache-2.0
"""Quality under eviction: retrieval accuracy per policy and budget, against the same server with
eviction off (per-request ``kvevict_enabled: false``) as the reference.

    python -m vllm_kvevict.bench.quality --base-url http://127.0.0.1:8000 \\
        --tokenizer "$(python -m vllm_kvevict.testing.models smollm2 --print-path)" \\
        --configs keydiff,snapkv,caote:base=tova --budget-ratios 0.1,0.25 \\
        --tasks niah_single,niah_multikey --length 2000 --depths 4 --seeds 1

A configuration is ``policy`` or ``policy:key=value,key=value`` (the policy's parameters, sent as
``kvevict_params``). Budgets are ratios of each prompt's token count (chat template included,
``--budget-ratios``) or absolute token counts (``--budgets``), sent per request
(``kvevict_budget``), so one server measures every configuration; tasks
(``vllm_kvevict/bench/tasks.py``) at one or more prompt lengths (``--lengths``). Prints a table,
writes JSON and, with ``--plot``, a PNG of score versus kept fraction.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict

from vllm_kvevict.bench.tasks import TASKS, Task, depths
from vllm_kvevict.testing.server import cpu_args

REFERENCE = "none"  # the same engine, eviction off for the request


#: spec keys that are request keys of their own, not the policy's parameters
REQUEST_SPEC_KEYS = {"recall": "kvevict_recall", "trigger": "kvevict_trigger"}


def parse_spec(spec: str) -> tuple[str, dict]:
    """``policy[:k=v,...]`` (or ``;`` between the parameters) -> (policy, params); values parsed as
    JSON where they parse. ``recall``
    and ``trigger`` (``keydiff:recall=true``) are kept in the params under their request keys."""
    policy, _, rest = spec.partition(":")
    params = {}
    for item in filter(None, rest.replace(";", ",").split(",")):
        k, _, v = item.partition("=")
        try:
            params[k] = json.loads(v)
        except json.JSONDecodeError:
            params[k] = v
    return policy, params


def spec_xargs(spec: str, budget: int) -> dict:
    """The request's ``vllm_xargs`` for a config spec and budget."""
    policy, params = parse_spec(spec)
    xargs = {"kvevict_policy": policy, "kvevict_budget": budget}
    for k, key in REQUEST_SPEC_KEYS.items():
        if k in params:
            xargs[key] = params.pop(k)
    if params:
        xargs["kvevict_params"] = json.dumps(params)
    return xargs


def _prompt_tokens(tokenizer, task: Task) -> int:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": task.prompt}], add_generation_prompt=True, tokenize=False
    )
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def budget_keys(budget_ratios: Sequence[float], budgets: Sequence[int]) -> list[str]:
    """Column keys: ``"0.25"`` (a ratio of each prompt's tokens) or ``"512tok"`` (absolute tokens)."""
    return [f"{r:g}" for r in budget_ratios] + [f"{b}tok" for b in budgets]


def _budget(key: str, prompt_tokens: int) -> int:
    return int(key[:-3]) if key.endswith("tok") else max(1, round(float(key) * prompt_tokens))


def run_quality(
    base_url: str,
    model: str,
    tokenizer,
    configs: list[str],
    budget_ratios: list[float],
    length: int | list[int],
    n_depths: int,
    seeds: list[int],
    tasks: Sequence[str] = ("niah_single",),
    concurrency: int = 2,
    progress: bool = False,
    budgets: Sequence[int] = (),
    rows_path: str | None = None,
) -> dict:
    """Every task x length x depth x seed, with eviction off and under every config x budget (ratios of
    the prompt, ``budget_ratios``, and absolute token counts, ``budgets``). ``rows_path``: a JSON-lines
    file every finished request is appended to, and whose requests are not sent again (a grid too
    long for one sitting runs in parts)."""
    from openai import OpenAI

    lengths = [length] if isinstance(length, int) else list(length)
    keys = budget_keys(budget_ratios, budgets)
    client = OpenAI(base_url=base_url.rstrip("/") + "/v1", api_key="unused", max_retries=0, timeout=3600)
    items = [
        (ln, TASKS[t](tokenizer, ln, d, s)) for t in tasks for ln in lengths for d in depths(n_depths) for s in seeds
    ]
    jobs = []
    for ln, task in items:
        n = _prompt_tokens(tokenizer, task)
        jobs.append((task, ln, REFERENCE, "-", {"kvevict_enabled": False}, n))
        for spec in configs:
            for key in keys:
                jobs.append((task, ln, spec, key, spec_xargs(spec, _budget(key, n)), n))

    def run(job):
        task, ln, name, key, xargs, n = job
        t0 = time.perf_counter()
        r = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": task.prompt}],
            max_tokens=task.max_tokens,
            temperature=0,
            extra_body={"vllm_xargs": xargs},
        )
        choice = r.choices[0]
        out = choice.message.content or ""
        return {
            "task": task.name,
            "length": ln,
            "config": name,
            "budget_key": key,
            "budget_ratio": None if key == "-" or key.endswith("tok") else float(key),
            "budget": xargs.get("kvevict_budget"),
            "xargs": xargs,
            "prompt_tokens": n,
            "depth": task.depth,
            "seed": task.seed,
            "answer": task.answer,
            "output": out,
            "finish_reason": choice.finish_reason,
            "score": task.score(out),
            "latency_s": round(time.perf_counter() - t0, 3),
        }

    done = load_rows(rows_path) if rows_path else {}
    rows = [done[job_key(j)] for j in jobs if job_key(j) in done]
    todo = [j for j in jobs if job_key(j) not in done]
    lock = threading.Lock()

    def run_and_keep(job):
        row = run(job)
        if rows_path:
            with lock, open(rows_path, "a") as f:
                f.write(json.dumps(row) + "\n")
        return row

    before = _server_counters(base_url)
    with ThreadPoolExecutor(concurrency) as pool:
        it = pool.map(run_and_keep, todo)
        if progress:
            from tqdm import tqdm

            it = tqdm(it, total=len(todo), desc="quality", unit="req")
        rows += list(it)
    after = _server_counters(base_url)
    return summarize(rows, configs, keys, tasks, lengths, n_depths, seeds, [t for _, t in items]) | {
        "budget_ratios": list(budget_ratios),
        "budgets": list(budgets),
        "server": {k: after[k] - before[k] for k in after},
    }


def job_key(job) -> tuple:
    """What identifies a request of the grid: task, length, depth, seed, config and budget column."""
    task, ln, name, key, _xargs, _n = job
    return (task.name, ln, task.depth, task.seed, name, key)


def load_rows(path: str) -> dict[tuple, dict]:
    """The rows of an earlier (partial) run, by :func:`job_key` (the last of each wins)."""
    out: dict[tuple, dict] = {}
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                if line.strip():
                    r = json.loads(line)
                    out[(r["task"], r["length"], r["depth"], r["seed"], r["config"], r["budget_key"])] = r
    return out


def _server_counters(base_url: str) -> dict[str, float]:
    """What the server did during the run, from its ``/metrics``: prefix-cache hits (tokens; any
    makes the comparison unfair: a later send of a prompt starts on the first send's blocks and
    evicts nothing before them) and KV blocks freed by eviction."""
    from vllm_kvevict.bench.serving import metrics

    m = metrics(base_url)
    return {
        "prefix_cache_hit_tokens": m.get("vllm:prefix_cache_hits_total", 0.0),
        "blocks_freed_by_eviction": m.get("kvevict:blocks_freed_total", 0.0),
    }


def summarize(rows, configs, keys, tasks, lengths, n_depths, seeds, items) -> dict:
    def mean(xs):
        return sum(xs) / len(xs) if xs else None

    summary: dict[str, dict[str, float | None]] = {}  # config -> {budget key or "-": score over tasks}
    kept_fraction: dict[str, dict[str, float]] = {}  # config -> {budget key: mean budget / prompt tokens}
    per_task: dict[str, dict[str, dict[str, float | None]]] = {}
    per_length: dict[str, dict[str, dict[str, float | None]]] = {}
    #: "end": the needle at depth 1 (next to the question, where recency alone can keep it); "rest": the others
    per_depth: dict[str, dict[str, dict[str, float | None]]] = {}
    for name in [REFERENCE, *configs]:
        for key in ["-"] if name == REFERENCE else keys:
            sel = [r for r in rows if r["config"] == name and r["budget_key"] == key]
            summary.setdefault(name, {})[key] = mean([r["score"] for r in sel])
            if key != "-":
                kept_fraction.setdefault(name, {})[key] = mean(
                    [min(1.0, r["budget"] / r["prompt_tokens"]) for r in sel]
                )
            for t in tasks:
                per_task.setdefault(t, {}).setdefault(name, {})[key] = mean([r["score"] for r in sel if r["task"] == t])
            for ln in lengths:
                per_length.setdefault(str(ln), {}).setdefault(name, {})[key] = mean(
                    [r["score"] for r in sel if r["length"] == ln]
                )
            for part, at_end in (("end", True), ("rest", False)):
                per_depth.setdefault(part, {}).setdefault(name, {})[key] = mean(
                    [r["score"] for r in sel if (r.get("depth") == 1.0) == at_end]
                )
    # each config's score as a share of no eviction's, per prompt length (what the recall grid's targets are in)
    share: dict[str, dict[str, dict[str, float | None]]] = {}
    for name in [c for c in configs if c != REFERENCE]:
        for key in keys:
            for ln in map(str, lengths):
                v, ref = per_length[ln][name][key], per_length[ln][REFERENCE]["-"]
                share.setdefault(name, {}).setdefault(key, {})[ln] = v / ref if v is not None and ref else None
    return {
        "tasks": list(tasks),
        "lengths": list(lengths),
        "share": share,
        "budget_keys": list(keys),
        "depths": depths(n_depths),
        "seeds": list(seeds),
        "summary": summary,
        "kept_fraction": kept_fraction,
        "per_task": per_task,
        "per_length": per_length,
        "per_depth": per_depth,
        "rows": rows,
        "items": [asdict(t) | {"prompt": None} for t in items],
    }


def _label(key: str) -> str:
    return f"{key[:-3]} tokens" if key.endswith("tok") else f"kept {key}"


def format_table(result: dict) -> str:
    keys = result["budget_keys"]
    tasks, lengths = result["tasks"], result["lengths"]
    n = len(result["depths"]) * len(result["seeds"]) * len(lengths)
    w = max(22, 5 * len(tasks) + 9)
    lines = [
        f"~{', '.join(map(str, lengths))} tokens, {n} prompts per task; score (mean over tasks; per task "
        f"in brackets: {', '.join(tasks)}); kept = budget / prompt tokens"
    ]
    lines.append(f"{'config':<26}" + "".join(f"{_label(k):>{w}}" for k in keys))

    def cell(name, key):
        acc = result["summary"][name].get(key)
        if acc is None:
            return f"{'-':>{w}}"
        parts = "/".join(f"{result['per_task'][t][name][key]:.2f}" for t in tasks)
        return f"{f'{acc:.2f} ({parts})':>{w}}"

    lines.append(f"{'none (no eviction)':<26}" + cell(REFERENCE, "-") * len(keys))
    for name in result["summary"]:
        if name != REFERENCE:
            lines.append(f"{name:<26}" + "".join(cell(name, k) for k in keys))
    hits = result.get("server", {}).get("prefix_cache_hit_tokens", 0)
    if hits:
        lines.append(
            f"WARNING: the server hit its prefix cache for {hits:.0f} prompt tokens: requests that "
            f"start on a hit evict nothing before it; serve with --no-enable-prefix-caching"
        )
    if 1.0 in result["depths"] and len(result["depths"]) > 1:
        lines.append("needle at depth 1 (beside the question) / elsewhere:")
        for name in result["summary"]:
            for key in result["summary"][name]:
                end, rest = (result["per_depth"][p][name][key] for p in ("end", "rest"))
                label = "none (no eviction)" if name == REFERENCE else f"{name} {_label(key)}"
                lines.append(f"  {label:<40}" + "".join("       -" if v is None else f"{v:>8.2f}" for v in (end, rest)))
    if result.get("share"):
        lines.append("share of no eviction's score, by prompt length: " + ", ".join(map(str, lengths)))
        for name, by_key in result["share"].items():
            for key, by_len in by_key.items():
                lines.append(
                    f"  {name + ' ' + _label(key):<40}"
                    + "".join("       -" if v is None else f"{v:>8.0%}" for v in by_len.values())
                )
    if len(lengths) > 1:
        lines.append("by prompt length (mean over tasks): " + ", ".join(map(str, lengths)))
        for name in result["summary"]:
            for key in result["summary"][name]:
                vals = [result["per_length"][str(ln)][name][key] for ln in lengths]
                label = "none (no eviction)" if name == REFERENCE else f"{name} {_label(key)}"
                lines.append(f"  {label:<40}" + "".join(f"{v:>8.2f}" for v in vals))
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5))
    cmap = plt.get_cmap("tab20")  # a ListedColormap of 20: an int picks one of them
    styles = ["-", "--", ":", "-."]
    names = [n for n in result["summary"] if n != REFERENCE]
    ax.axhline(result["summary"][REFERENCE]["-"], color="black", linewidth=2, label="no eviction")
    for i, name in enumerate(names):
        pts = sorted((result["kept_fraction"][name][k], v) for k, v in result["summary"][name].items())
        jitter = (i - len(names) / 2) * 0.002  # equal scores stay distinguishable
        ax.plot(
            [x + jitter for x, _ in pts],
            [y for _, y in pts],
            marker="os^vD"[i % 5],
            linestyle=styles[i % 4],
            color=cmap(i % 20),
            label=name,
        )
    ax.set_xlabel("kept fraction of the prompt (budget / prompt tokens)")
    ax.set_ylabel("score")
    ax.set_title(f"{', '.join(result['tasks'])} (~{'/'.join(map(str, result['lengths']))} tokens)", fontsize=8)
    ax.set_ylim(-0.05, 1.05)
    ax.legend(fontsize=7, ncol=2, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


#: how the benchmarks start vLLM on this project's CPU machines (fp32 as the tests; eviction on): the
#: default of ``--platform-args``
CPU_SERVE_ARGS = cpu_args("4G")


@contextlib.contextmanager
def serve_or_connect(args):
    """A running server: the given ``args.base_url`` (the model name ``args.served_model_name``, else
    the first of its ``/v1/models``; the tokenizer ``args.tokenizer``, else ``args.model``, else the
    path the server reports), or vLLM started here with kvevict on ``args.model`` (default: the
    bundled SmolLM2), ``args.platform_args`` (None: :data:`CPU_SERVE_ARGS`), then ``args.server_args``
    after the benchmark's own. Yields (base URL, model name, tokenizer path)."""
    import shlex

    if args.base_url:
        from vllm_kvevict.bench.serving import connect

        ep = connect(args.base_url, args.served_model_name, args.model)
        yield ep.base_url, ep.served_model_name, args.tokenizer or ep.model
        return
    import tempfile

    from vllm_kvevict.bench.serving import platform_args, split_config
    from vllm_kvevict.testing.models import smollm2_path
    from vllm_kvevict.testing.server import VLLMServer

    path = args.model or str(smollm2_path())
    platform = CPU_SERVE_ARGS if args.platform_args is None else platform_args(shlex.split(args.platform_args))
    extra, user_cfg = split_config(shlex.split(args.server_args or ""))
    cfg = {"kvevict": {"policy": "keydiff", "budget": 256}}  # every request sets its own
    if user_cfg:
        cfg = {**user_cfg, "kvevict": {**cfg["kvevict"], **user_cfg.get("kvevict", {})}}
    # Every prompt is sent once per configuration: with prefix caching on, the later sends would start
    # on the first one's cached blocks and evict nothing before the hit (docs/architecture.md).
    srv_args = [
        "--attention-backend",
        "kvevict",
        *platform,
        "--no-enable-prefix-caching",
        *extra,
        "--additional-config",
        json.dumps(cfg),
    ]
    log = tempfile.NamedTemporaryFile(prefix="kvevict-bench-", suffix=".log", delete=False).name
    print(f"starting vLLM on {path} (log: {log})", file=sys.stderr)
    name = args.served_model_name or "model"
    with VLLMServer(path, srv_args, log_path=log, served_model_name=name, startup_timeout=900) as srv:
        yield srv.base_url, srv.served_model_name, args.tokenizer or path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m vllm_kvevict.bench.quality", description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", help="a running kvevict server; without it, vLLM is started on --model")
    ap.add_argument(
        "--model",
        default=None,
        help="the model, a path or name as vllm serve takes it: served when no --base-url (default: the bundled "
        "SmolLM2), and the default tokenizer",
    )
    ap.add_argument("--model-path", dest="model", help=argparse.SUPPRESS)  # before --model meant the path
    ap.add_argument(
        "--served-model-name",
        default=None,
        help="the model name in requests (default: the first of the server's /v1/models; 'model' when started here)",
    )
    ap.add_argument(
        "--tokenizer", help="tokenizer path (to size prompts and budgets); default --model, else the server's model"
    )
    ap.add_argument(
        "--platform-args",
        default=None,
        help=f"the platform's vllm serve flags when starting it (default: {' '.join(CPU_SERVE_ARGS)})",
    )
    ap.add_argument(
        "--server-args", default="", help="extra vllm serve arguments when starting it, after the benchmark's own"
    )
    ap.add_argument("--configs", default="keydiff,streamingllm", help="comma-separated policy[:k=v;...] specs")
    ap.add_argument("--budget-ratios", default="0.25", help="budgets as ratios of each prompt's tokens")
    ap.add_argument("--budgets", default="", help="absolute budgets in tokens, comma-separated")
    ap.add_argument("--tasks", default="niah_single", help=f"comma-separated, of {', '.join(TASKS)}")
    ap.add_argument("--length", "--lengths", dest="length", default="3000", help="prompt tokens, comma-separated")
    ap.add_argument("--depths", type=int, default=5, help="needle depths per task (evenly spaced, ends included)")
    ap.add_argument("--seeds", default="1,2", help="task seeds, comma-separated (one prompt per seed and depth)")
    ap.add_argument("--max-concurrency", type=int, default=2, help="requests in flight at once")
    ap.add_argument("--concurrency", dest="max_concurrency", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--out", default="quality.json", help="JSON path")
    ap.add_argument("--plot", default=None, help="PNG path")
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer

    # Parameters inside a spec are separated by ';' on the command line (',' separates specs).
    configs = [c.replace(";", ",") for c in args.configs.split(",")]
    with serve_or_connect(args) as (base_url, model, tokenizer_path):
        result = run_quality(
            base_url,
            model,
            AutoTokenizer.from_pretrained(tokenizer_path),
            configs,
            [float(r) for r in args.budget_ratios.split(",") if r],
            [int(x) for x in str(args.length).split(",")],
            args.depths,
            [int(s) for s in args.seeds.split(",")],
            args.tasks.split(","),
            concurrency=args.max_concurrency,
            progress=True,
            budgets=[int(b) for b in args.budgets.split(",") if b],
        )
    print(format_table(result))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    if args.plot:
        plot(result, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
