"""Quality under eviction: retrieval accuracy per policy and budget, against the same server with
eviction off (per-request ``kvevict_enabled: false``) as the reference.

    python -m vllm_kvevict.bench.quality --base-url http://127.0.0.1:8000 --model smollm2 \\
        --tokenizer "$(python -m vllm_kvevict.testing.models smollm2 --print-path)" \\
        --policies keydiff,streamingllm --budget-ratio 0.25 --length 3000 --depths 5 --seeds 1,2

Budgets are a ratio of each prompt's token count (chat template included), sent per request
(``kvevict_budget``), so one server measures every configuration. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict

from vllm_kvevict.bench.tasks import Task, depths, niah_single

REFERENCE = "none"  # the same engine, eviction off for the request


def _prompt_tokens(tokenizer, task: Task) -> int:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": task.prompt}], add_generation_prompt=True, tokenize=False
    )
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def run_quality(
    base_url: str, model: str, tokenizer, policies: list[str], budget_ratio: float, length: int,
    n_depths: int, seeds: list[int], max_tokens: int = 32, concurrency: int = 2,
) -> dict:
    from openai import OpenAI

    client = OpenAI(base_url=base_url.rstrip("/") + "/v1", api_key="unused", max_retries=0)
    tasks = [niah_single(tokenizer, length, d, s) for d in depths(n_depths) for s in seeds]
    jobs = []
    for task in tasks:
        n = _prompt_tokens(tokenizer, task)
        jobs.append((task, REFERENCE, {"kvevict_enabled": False}, n))
        for policy in policies:
            budget = max(1, round(budget_ratio * n))
            jobs.append((task, policy, {"kvevict_policy": policy, "kvevict_budget": budget}, n))

    def run(job):
        task, name, xargs, n = job
        r = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": task.prompt}], max_tokens=max_tokens,
            temperature=0, extra_body={"vllm_xargs": xargs},
        )
        out = r.choices[0].message.content or ""
        return {"config": name, "xargs": xargs, "prompt_tokens": n, "depth": task.depth, "seed": task.seed,
                "answer": task.answer, "output": out, "score": task.score(out)}

    with ThreadPoolExecutor(concurrency) as pool:
        rows = list(pool.map(run, jobs))
    summary = {}
    for name in [REFERENCE, *policies]:
        scores = [r["score"] for r in rows if r["config"] == name]
        summary[name] = sum(scores) / len(scores)
    ref = summary[REFERENCE]
    return {
        "task": "niah_single", "length": length, "budget_ratio": budget_ratio, "depths": depths(n_depths),
        "seeds": seeds, "summary": summary,
        "relative_to_reference": {k: (v / ref if ref else None) for k, v in summary.items()},
        "rows": rows, "tasks": [asdict(t) | {"prompt": None} for t in tasks],
    }


def format_table(result: dict) -> str:
    lines = [f"niah_single, ~{result['length']} tokens, budget {result['budget_ratio']:.0%} of the prompt, "
             f"{len(result['depths'])} depths x {len(result['seeds'])} seeds",
             f"{'config':<14}{'accuracy':>10}{'vs. no eviction':>18}"]
    for name, acc in result["summary"].items():
        rel = result["relative_to_reference"][name]
        lines.append(f"{name:<14}{acc:>10.2f}{(f'{rel:.2f}' if rel is not None else 'n/a'):>18}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m vllm_kvevict.bench.quality", description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--model", required=True, help="served model name")
    ap.add_argument("--tokenizer", required=True, help="tokenizer path (to size prompts and budgets)")
    ap.add_argument("--policies", default="keydiff,streamingllm")
    ap.add_argument("--budget-ratio", type=float, default=0.25)
    ap.add_argument("--length", type=int, default=3000)
    ap.add_argument("--depths", type=int, default=5)
    ap.add_argument("--seeds", default="1,2")
    ap.add_argument("--out", default="quality.json")
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer

    result = run_quality(
        args.base_url, args.model, AutoTokenizer.from_pretrained(args.tokenizer), args.policies.split(","),
        args.budget_ratio, args.length, args.depths, [int(s) for s in args.seeds.split(",")],
    )
    print(format_table(result))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
