# SPDX-License-Identifier: Apache-2.0
"""Quality on the bundled SmolLM2: single-needle retrieval (RULER niah_single format), ~3K-token
prompts, needle depth swept; KeyDiff at a quarter of the prompt keeps >= 90% of the accuracy the
same server reaches with eviction off. StreamingLLM's score is reported, not asserted.
"""

from __future__ import annotations

import json

import pytest

from vllm_kvevict.bench.quality import format_table, run_quality
from vllm_kvevict.testing.server import CPU_BASE_ARGS, VLLMServer

pytestmark = [pytest.mark.engine, pytest.mark.smollm2, pytest.mark.slow, pytest.mark.timeout(1500)]


def test_keydiff_quarter_budget_keeps_retrieval(smollm2_model, server_log, tmp_path):
    from transformers import AutoTokenizer

    cfg = {"kvevict": {"policy": "keydiff", "budget": 768}}  # every request sets its own budget
    args = [
        "--attention-backend",
        "kvevict",
        *CPU_BASE_ARGS,
        "--kv-cache-memory-bytes",
        "2G",
        "--max-model-len",
        "4096",
        "--no-enable-prefix-caching",
        "--additional-config",
        json.dumps(cfg),
    ]
    with VLLMServer(smollm2_model, args, log_path=server_log("quality")) as srv:
        result = run_quality(
            srv.base_url,
            srv.served_model_name,
            AutoTokenizer.from_pretrained(smollm2_model),
            ["keydiff", "streamingllm"],
            budget_ratios=[0.25],
            length=3000,
            n_depths=5,
            seeds=[1, 2],
        )
    (tmp_path / "quality.json").write_text(json.dumps(result, indent=1))
    print("\n" + format_table(result))
    s = result["summary"]
    # The comparison is real: nothing started on a cached prefix, and eviction freed blocks.
    assert result["server"]["prefix_cache_hit_tokens"] == 0 and result["server"]["blocks_freed_by_eviction"] > 0
    assert s["none"]["-"] >= 0.8, "the reference (no eviction) should retrieve the needle"
    assert s["keydiff"]["0.25"] >= 0.9 * s["none"]["-"]
    assert all(2900 <= r["prompt_tokens"] <= 3100 for r in result["rows"])
    # An empty answer (end of turn first) is told apart from a cut one.
    assert all(r["finish_reason"] in ("stop", "length") for r in result["rows"])
