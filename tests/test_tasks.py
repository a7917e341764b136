# SPDX-License-Identifier: Apache-2.0
"""The benchmark's task generators (vllm_kvevict/bench/tasks.py) and the quality report's
bookkeeping (budget keys, summaries, table, plot), without a server."""

from __future__ import annotations

import re
from collections import Counter

import pytest

from vllm_kvevict.bench import quality
from vllm_kvevict.bench.tasks import TASKS, Task, depths


@pytest.fixture(scope="module")
def tokenizer(smollm2_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_model)


@pytest.mark.parametrize("name", sorted(TASKS))
@pytest.mark.parametrize("length", [600, 2000])
def test_task_length_answers_and_determinism(tokenizer, name, length):
    t = TASKS[name](tokenizer, length, 0.5, 3)
    n = len(tokenizer(t.prompt)["input_ids"])
    assert 0.9 * length <= n <= length + 10, n
    assert t.answers and all(a in t.prompt for a in t.answers)
    assert t.score(" ".join(t.answers)) == 1.0 and t.score("nothing here") == 0.0
    assert t == TASKS[name](tokenizer, length, 0.5, 3)  # a seed gives the same prompt
    assert t.prompt != TASKS[name](tokenizer, length, 0.5, 4).prompt


def test_score_is_fraction_of_answers():
    t = Task("x", "p", ("1111111", "2222222", "3333333", "4444444"), None, 0)
    assert t.score("1111111 and 3333333") == 0.5
    assert t.score("ABC") == 0.0 and Task("x", "p", ("abcde",), None, 0).score("ABCDE") == 1.0


@pytest.mark.parametrize("name", ["niah_single", "niah_multikey", "niah_multivalue", "kv_retrieval"])
def test_depth_places_the_asked_item(tokenizer, name):
    where = []
    for d in depths(3):
        t = TASKS[name](tokenizer, 1500, d, 7)
        where.append(t.prompt.index(t.answers[0]) / len(t.prompt))
    assert where[0] < 0.15 and 0.35 < where[1] < 0.65 and where[2] > 0.85, where


def test_variable_tracking_chain(tokenizer):
    t = TASKS["variable_tracking"](tokenizer, 1500, 0.0, 1)
    chain = re.findall(r"VAR ([A-Z]{5}) = (VAR [A-Z]{5}|\d+)\.", t.prompt)
    assert [a for a, _ in chain] == list(t.answers)  # in reading order
    assert chain[0][1].isdigit() and all(b == f"VAR {a}" for (a, _), (_, b) in zip(chain, chain[1:]))
    assert f"value {chain[0][1]}" in t.prompt.split("\n")[-1]


def test_common_words_are_the_most_frequent(tokenizer):
    t = TASKS["common_words"](tokenizer, 2000, 0.0, 1)
    counts = Counter(re.findall(r"\d+\. (\w+)", t.prompt))
    top = {w for w, _ in counts.most_common(len(t.answers))}
    assert top == set(t.answers)
    assert min(counts[w] for w in t.answers) > max(c for w, c in counts.items() if w not in t.answers)


def test_quality_report_budget_keys_table_and_plot(tmp_path):
    rows = []
    for task, score in (("niah_single", 1.0), ("common_words", 0.5)):
        for ln in (1000, 2000):
            rows.append(
                {
                    "task": task,
                    "length": ln,
                    "config": "none",
                    "budget_key": "-",
                    "budget": None,
                    "prompt_tokens": ln,
                    "score": score,
                    "depth": 1.0 if task == "niah_single" else 0.0,
                }
            )
            for key, b in (("0.25", ln // 4), ("300tok", 300)):
                rows.append(
                    {
                        "task": task,
                        "length": ln,
                        "config": "keydiff",
                        "budget_key": key,
                        "budget": b,
                        "prompt_tokens": ln,
                        "score": score / 2,
                        "depth": 1.0 if task == "niah_single" else 0.0,
                    }
                )
    assert quality.budget_keys([0.25], [300]) == ["0.25", "300tok"]
    assert quality._budget("300tok", 1234) == 300 and quality._budget("0.25", 1000) == 250
    r = quality.summarize(
        rows, ["keydiff"], ["0.25", "300tok"], ["niah_single", "common_words"], [1000, 2000], 2, [1], []
    )
    assert r["summary"] == {"none": {"-": 0.75}, "keydiff": {"0.25": 0.375, "300tok": 0.375}}
    assert r["kept_fraction"]["keydiff"] == {"0.25": 0.25, "300tok": pytest.approx((0.3 + 0.15) / 2)}
    assert r["per_task"]["common_words"]["keydiff"]["300tok"] == 0.25
    assert r["per_length"]["2000"]["none"]["-"] == 0.75
    table = quality.format_table(r)
    assert "300 tokens" in table and "kept 0.25" in table and "0.38 (0.50/0.25)" in table
    assert "by prompt length" in table
    # the targets are shares of no eviction's score, per length
    assert r["share"]["keydiff"]["0.25"] == {"1000": 0.5, "2000": 0.5}
    assert "share of no eviction" in table and "keydiff kept 0.25" in table and "50%" in table
    # the needle beside the question (depth 1) apart from the others: recency alone can keep it
    assert r["per_depth"]["end"]["keydiff"]["0.25"] == 0.5 and r["per_depth"]["rest"]["keydiff"]["0.25"] == 0.25
    assert "needle at depth 1" in table and "keydiff kept 0.25" in table
    quality.plot(r, str(tmp_path / "q.png"))
    assert (tmp_path / "q.png").stat().st_size > 10_000


def test_config_specs_become_request_keys():
    import json

    from vllm_kvevict.bench.quality import spec_xargs

    assert spec_xargs("keydiff", 100) == {"kvevict_policy": "keydiff", "kvevict_budget": 100}
    x = spec_xargs("caote:base=tova,recall=true,trigger=once", 64)
    assert x["kvevict_recall"] is True and x["kvevict_trigger"] == "once"
    assert json.loads(x["kvevict_params"]) == {"base": "tova"}


def test_quality_rows_are_found_again_by_their_job(tmp_path, tokenizer):
    """A grid run in parts (``--rows``): each finished request is found again by the job that sent
    it, and no other job."""
    import json

    task = TASKS["niah_single_varied"](tokenizer, 500, 1.0, 3)
    jobs = [(task, 500, "keydiff:recall=true", "0.1", {}, 520), (task, 500, "keydiff", "0.1", {}, 520)]
    row = {"task": task.name, "length": 500, "depth": 1.0, "seed": 3, "config": "keydiff:recall=true"}
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(row | {"budget_key": "0.1", "score": 0.0}) + "\n")
    path.write_text(path.read_text() + json.dumps(row | {"budget_key": "0.1", "score": 1.0}) + "\n")
    done = quality.load_rows(str(path))
    assert quality.job_key(jobs[0]) in done and quality.job_key(jobs[1]) not in done
    assert done[quality.job_key(jobs[0])]["score"] == 1.0  # the last of a repeated request
    assert quality.load_rows(str(tmp_path / "none.jsonl")) == {}
