# SPDX-License-Identifier: Apache-2.0
"""The markdown table of a quality grid's rows file (``kvevict-bench quality --rows FILE``), as in
docs/policies.md ("Recall grid"): for each prompt length, configuration and budget,
the score (mean over tasks; per task; needle at depth 1 / elsewhere), its share of no eviction's
score on the same prompts, and the number of prompts per task behind it; ``--plot`` also draws the
shares (one panel per length, a policy's configs in one colour: with recall solid, without dashed,
``trigger=once``, stated or the policy's default, starred).

    python scripts/grid_table.py docs/img/recall_grid_rows.jsonl [--lengths 3000] [--ratios 0.1,0.25]
        [--config keydiff --config keydiff:recall=true] [--plot docs/img/recall_grid.png]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from dataclasses import dataclass


def mean(xs):
    return sum(xs) / len(xs) if xs else None


def fmt(x) -> str:
    return "-" if x is None else f"{x:.2f}"


@dataclass
class Cell:
    score: float | None  # mean over tasks (None unless every task has a prompt)
    per_task: list  # mean per task, None where a task has none
    end: float | None  # needle at depth 1 (beside the question)
    rest: float | None  # every other depth
    n: list[int]  # prompts per task
    share: float | None  # of no eviction's score on the same prompts

    def __str__(self) -> str:
        share = f", **{self.share:.0%}**" if self.share is not None else ""
        parts = "/".join(map(fmt, self.per_task))
        n = "/".join(map(str, self.n))
        return f"{fmt(self.score)} ({parts}; {fmt(self.end)} / {fmt(self.rest)}){share} n={n}"


def cell(sel: list[dict], ref: list[dict], tasks: list[str]) -> Cell | None:
    if not sel:
        return None
    per_task = [mean([r["score"] for r in sel if r["task"] == t]) for t in tasks]
    score = mean(per_task) if None not in per_task else None
    # the share is of no eviction's score on the same prompts (a part of the grid may lack some)
    prompts = {(x["task"], x["depth"], x["seed"]) for x in sel}
    same = [r for r in ref if (r["task"], r["depth"], r["seed"]) in prompts]
    ref_tasks = [mean([r["score"] for r in same if r["task"] == t]) for t in tasks]
    ref_score = mean(ref_tasks) if same and None not in ref_tasks else None
    return Cell(
        score=score,
        per_task=per_task,
        end=mean([r["score"] for r in sel if r["depth"] == 1.0]),
        rest=mean([r["score"] for r in sel if r["depth"] != 1.0]),
        n=[sum(r["task"] == t for r in sel) for t in tasks],
        share=score / ref_score if ref_score and score is not None else None,
    )


def grid(rows: list[dict], lengths: list[int], ratios: list[str], configs: list[str]) -> dict:
    """{length: (no eviction's cell, {config: {ratio: cell or None}})} for lengths with a reference."""
    tasks = sorted({r["task"] for r in rows}, key=lambda t: (t != "niah_single_varied", t))
    by = defaultdict(list)
    for r in rows:
        by[r["length"], r["config"], r["budget_key"]].append(r)
    out = {}
    for ln in lengths:
        none = by[ln, "none", "-"]
        if none:
            cells = {c: {k: cell(by[ln, c, k], none, tasks) for k in ratios} for c in configs}
            out[ln] = (cell(none, [], tasks), {c: v for c, v in cells.items() if any(v.values())})
    return out


def table(result: dict, ratios: list[str]) -> str:
    lines = []
    for ln, (none, cells) in result.items():
        lines += [f"\n~{ln} tokens; no eviction: {none}\n"]
        lines += ["| config | " + " | ".join(f"{float(k):.0%} of the prompt" for k in ratios) + " |"]
        lines += ["|---|" + "---|" * len(ratios)]
        for c, by_ratio in cells.items():
            lines += [f"| {c} | " + " | ".join(str(by_ratio[k] or "-") for k in ratios) + " |"]
    return "\n".join(lines)


def plot(result: dict, ratios: list[str], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from vllm_kvevict.bench.quality import parse_spec
    from vllm_kvevict.policies import POLICIES

    fig, axes = plt.subplots(1, len(result), figsize=(6 * len(result) + 3, 5), sharey=True, squeeze=False)
    policies = list(dict.fromkeys(c.split(":")[0] for _, cells in result.values() for c in cells))
    cmap = plt.get_cmap("tab20")  # a ListedColormap of 20: an int picks one of them
    xs = [float(k) for k in ratios]
    for ax, (ln, (none, cells)) in zip(axes[0], result.items()):
        ax.axhline(100, color="black", linewidth=1.5, label="no eviction")
        ax.axhline(80, color="grey", linewidth=0.8, linestyle=":")
        ax.axhline(90, color="grey", linewidth=0.8, linestyle=":")
        for c, by_ratio in cells.items():
            pts = [(x, by_ratio[k].share * 100) for x, k in zip(xs, ratios) if by_ratio[k] and by_ratio[k].share]
            if not pts:
                continue
            policy, params = parse_spec(c)
            recall = params.get("recall") is True
            once = params.get("trigger", POLICIES[policy].needs.trigger) == "once"  # unstated: the default
            ax.plot(
                [x for x, _ in pts],
                [y for _, y in pts],
                color=cmap(policies.index(policy) % 20),
                linestyle=":" if once else ("-" if recall else "--"),
                marker="*" if once else ("o" if recall else "x"),
                label=c,
            )
        ax.set_xscale("log")
        ax.set_xticks(xs, [f"{x:.0%}" for x in xs])
        ax.minorticks_off()
        ax.set_xlabel("budget (share of the prompt)")
        ax.set_title(f"~{ln} tokens (no eviction {none.score:.2f})", fontsize=9)
    axes[0][0].set_ylabel("share of no eviction's score, %")
    # one entry per config across the panels (a config may be drawn in only one of them)
    by_label: dict[str, object] = {}
    for ax in axes[0]:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            by_label.setdefault(label, handle)
    axes[0][-1].legend(
        list(by_label.values()), list(by_label), fontsize=7, ncol=2, loc="center left", bbox_to_anchor=(1.0, 0.5)
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("rows")
    ap.add_argument("--lengths", default="", help="comma-separated; default: every length in the file")
    ap.add_argument("--ratios", default="", help="comma-separated budget ratios; default: every one")
    ap.add_argument("--config", action="append", default=[], help="one config (repeat); default: every one in the file")
    ap.add_argument("--plot", default="", help="also draw the shares to this PNG")
    args = ap.parse_args(argv)
    rows = [json.loads(line) for line in open(args.rows) if line.strip()]
    lengths = [int(x) for x in args.lengths.split(",") if x] or sorted({r["length"] for r in rows})
    ratios = [x for x in args.ratios.split(",") if x] or sorted({r["budget_key"] for r in rows} - {"-"}, key=float)
    configs = args.config or list(dict.fromkeys(r["config"] for r in rows if r["config"] != "none"))
    result = grid(rows, lengths, ratios, configs)
    print(table(result, ratios))
    if args.plot:
        plot(result, ratios, args.plot)


if __name__ == "__main__":
    main()
