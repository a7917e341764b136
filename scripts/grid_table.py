# SPDX-License-Identifier: Apache-2.0
"""The markdown table of a quality grid's rows file (``kvevict-bench quality --rows FILE``), as in
docs/policies.md ("Recall on issue 26's grid"): for each prompt length, configuration and budget,
the score (mean over tasks; per task; needle at depth 1 / elsewhere), its share of no eviction's
score on the same prompts, and the number of prompts per task behind it.

    python scripts/grid_table.py docs/img/recall_grid_rows.jsonl [--lengths 3000] [--ratios 0.1,0.25]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict


def mean(xs):
    return sum(xs) / len(xs) if xs else None


def fmt(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("rows")
    ap.add_argument("--lengths", default="", help="comma-separated; default: every length in the file")
    ap.add_argument("--ratios", default="", help="comma-separated budget ratios; default: every one")
    args = ap.parse_args()
    rows = [json.loads(line) for line in open(args.rows) if line.strip()]
    lengths = [int(x) for x in args.lengths.split(",") if x] or sorted({r["length"] for r in rows})
    ratios = [x for x in args.ratios.split(",") if x] or sorted({r["budget_key"] for r in rows} - {"-"}, key=float)
    tasks = sorted({r["task"] for r in rows}, key=lambda t: (t != "niah_single_varied", t))
    by = defaultdict(list)
    for r in rows:
        by[r["length"], r["config"], r["budget_key"]].append(r)
    configs = list(dict.fromkeys(r["config"] for r in rows if r["config"] != "none"))

    def cell(sel, ref):
        if not sel:
            return "-"
        per_task = [mean([r["score"] for r in sel if r["task"] == t]) for t in tasks]
        score = mean(per_task) if None not in per_task else None
        parts = "/".join(map(fmt, per_task))
        end = mean([r["score"] for r in sel if r["depth"] == 1.0])
        rest = mean([r["score"] for r in sel if r["depth"] != 1.0])
        n = "/".join(str(sum(r["task"] == t for r in sel)) for t in tasks)
        # the share is of no eviction's score on the same prompts (a part of the grid may lack some)
        prompts = {(x["task"], x["depth"], x["seed"]) for x in sel}
        same = [r for r in ref if (r["task"], r["depth"], r["seed"]) in prompts]
        ref_tasks = [mean([r["score"] for r in same if r["task"] == t]) for t in tasks]
        ref_score = mean(ref_tasks) if ref and None not in ref_tasks else None
        share = f", **{score / ref_score:.0%}**" if ref_score and score is not None else ""
        return f"{fmt(score)} ({parts}; {fmt(end)} / {fmt(rest)}){share} n={n}"

    for ln in lengths:
        none = by[ln, "none", "-"]
        if not none:
            continue
        print(f"\n~{ln} tokens; no eviction: {cell(none, [])}\n")
        print("| config | " + " | ".join(f"{float(k):.0%} of the prompt" for k in ratios) + " |")
        print("|---|" + "---|" * len(ratios))
        for c in configs:
            cells = [cell(by[ln, c, k], none) for k in ratios]
            if any(x != "-" for x in cells):
                print(f"| {c} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
