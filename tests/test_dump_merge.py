# SPDX-License-Identifier: Apache-2.0
"""The engine's kept-set dumps under tensor parallelism (testing/hf_reference.load_attempts): each
rank records the KV heads it holds; together they give one kept list per model KV head."""

from __future__ import annotations

import json

import pytest

from vllm_kvevict.testing.hf_reference import load_attempts


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def _rank(rank, heads, kept_by_head, req="r-0", L=128):
    return [
        {"req_id": req, "start": True, "num_tokens": 300, "rank": rank},
        {
            "req_id": req,
            "layer": 0,
            "e_prev": 0,
            "e_new": 32,
            "L": L,
            "rank": rank,
            "heads": heads,
            "kept": [kept_by_head[h] for h in heads],
        },
    ]


KEPT = {0: [1, 2, 5], 1: [0, 3, 4], 2: [2, 3, 4], 3: [0, 1, 2]}


def test_ranks_are_put_together_by_model_head(tmp_path):
    _write(tmp_path / "kept-11.jsonl", _rank(1, [2, 3], KEPT))
    _write(tmp_path / "kept-10.jsonl", _rank(0, [0, 1], KEPT))
    (att,) = load_attempts(tmp_path)["r-0"]
    assert att.num_tokens == 300 and att.events[128][0] == [KEPT[h] for h in range(4)]


def test_one_rank_is_read_as_is(tmp_path):
    _write(tmp_path / "kept-10.jsonl", _rank(0, [0, 1, 2, 3], KEPT))
    (att,) = load_attempts(tmp_path)["r-0"]
    assert att.events[128][0] == [KEPT[h] for h in range(4)]


def test_replicated_heads_must_agree(tmp_path):
    _write(tmp_path / "kept-10.jsonl", _rank(0, [0], KEPT))
    _write(tmp_path / "kept-11.jsonl", _rank(1, [0], KEPT))  # two ranks, one KV head replicated
    assert load_attempts(tmp_path)["r-0"][0].events[128][0] == [KEPT[0]]
    _write(tmp_path / "kept-11.jsonl", _rank(1, [0], {0: [9, 9, 9]}))
    with pytest.raises(ValueError, match="replicas of KV head 0"):
        load_attempts(tmp_path)


def test_ranks_must_agree_on_compaction_points(tmp_path):
    _write(tmp_path / "kept-10.jsonl", _rank(0, [0], KEPT))
    _write(tmp_path / "kept-11.jsonl", _rank(1, [1], KEPT, L=160))
    with pytest.raises(ValueError, match="compaction points"):
        load_attempts(tmp_path)
