# SPDX-License-Identifier: Apache-2.0
"""The benchmark CLI's smoke presets, end to end against real servers on the bundled SmolLM2.

Checks the outputs are well formed and the stock/no-eviction references are sane; the eviction
numbers themselves are reported, not asserted (docs/benchmarks.md). Memory: kvevict's peak stays
within its window bound while stock vLLM holds the whole sequence. Overhead: the step profiler
sees the prefill chunks, the compactions and the eviction time inside the step time.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.engine, pytest.mark.smollm2, pytest.mark.timeout(1200)]


def _bench(tmp_path, *args: str) -> dict:
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "vllm_kvevict.bench", *args, "--preset", "smoke", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=1100,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    name = args[0]
    report = json.loads((out / f"{name}.json").read_text())
    assert (out / f"{name}.png").stat().st_size > 10_000
    assert report["preset"] == "smoke"
    print(proc.stdout)
    return report | {"_stdout": proc.stdout}


@pytest.mark.slow
def test_quality_smoke(smollm2_model, tmp_path):
    r = _bench(tmp_path, "quality")
    assert set(r["summary"]) == {"none", "keydiff", "streamingllm"}
    assert r["summary"]["none"]["-"] >= 0.5, "the no-eviction reference should find the needle"
    assert all(0.0 <= v <= 1.0 for cfg in r["summary"].values() for v in cfg.values())
    assert len(r["rows"]) == 2 * (1 + 2)  # 2 prompts x (reference + 2 policies x 1 budget)
    assert all(900 <= row["prompt_tokens"] <= 1100 for row in r["rows"])
    assert "none (no eviction)" in r["_stdout"]
    # the same prompt under every config: the bench's server must not reuse the first send's KV
    assert r["server"]["prefix_cache_hit_tokens"] == 0 and r["server"]["blocks_freed_by_eviction"] > 0


@pytest.mark.slow
def test_throughput_smoke(smollm2_model, tmp_path):
    r = _bench(tmp_path, "throughput")
    assert set(r["results"]) == {"stock", "kvevict-0.25"}
    for _name, res in r["results"].items():
        assert res["output_tokens"] == r["num_requests"] * r["output_len"]
        assert res["output_tok_per_s"] > 0 and res["req_per_s"] > 0
        assert 0 < res["ttft"]["median_s"] <= res["ttft"]["p90_s"] and res["tpot"]["median_s"] > 0
        assert 1 <= res["peak_running"] <= r["num_requests"] and 0 < res["peak_kv_usage"] <= 1
        assert len(res["requests"]) == r["num_requests"]
    # Stock vLLM, KV for one sequence: one request at a time, and the cache fills up.
    assert r["results"]["stock"]["peak_running"] == 1 and r["results"]["stock"]["peak_kv_usage"] > 0.9
    assert r["kvevict_over_stock"]["kvevict-0.25"]["output_tok_per_s"] > 0


@pytest.mark.slow
def test_memory_smoke(smollm2_model, tmp_path):
    r = _bench(tmp_path, "memory")
    stock, kv = r["series"]["stock"], r["series"]["kvevict"]
    assert len(stock["points"]) > 10 and len(kv["points"]) > 10
    bound = r["window_bound_blocks"]
    # Exact, from the engine: kvevict's request never held more than its window bound.
    assert 0 < kv["engine_peak_blocks"] <= bound < r["sequence_blocks"]
    # Every sample of a gauge that never exceeds the bound is within the bound.
    assert 0 < kv["peak_blocks"] <= kv["engine_peak_blocks"]
    # Stock vLLM holds more than kvevict's bound from its third prefill chunk (24 blocks) until the
    # request ends (34 blocks): seconds of 50 ms samples. Its sampled peak is a measurement, not
    # asserted to the block (a loaded machine can stall the sampler through the short final stretch).
    assert bound < stock["peak_blocks"] <= r["sequence_blocks"]
    assert "engine_peak_blocks" not in stock


@pytest.mark.slow
def test_overhead_smoke(smollm2_model, tmp_path):
    r = _bench(tmp_path, "overhead")
    assert list(r["results"]) == ["none", "keydiff", "snapkv", "keydiff:recall=true"]
    off = r["results"]["none"]
    # eviction off for the request: only the per-slot position bookkeeping runs after attention
    assert off["prefill"]["steps"] >= 4 and off["prefill"]["compacting_steps"] == 0
    assert off["prefill"]["evict_fraction"] < 0.2
    for name in ("keydiff", "snapkv"):
        p = r["results"][name]["prefill"]
        assert p["steps"] >= 4 and p["compacting_steps"] >= 2  # 1024 tokens in 256-token chunks, budget 256
        assert 0 < p["evict_ms"] < p["step_ms"] and 0 < p["evict_fraction"] < 1
        assert 0 < p["attn_ms"] < p["step_ms"]
        assert p["tier_peak_bytes"] == 0 and p["recall_ms"] == 0
    # Recall: its time is inside the eviction time; the tier held at most what the prompt's
    # compactions dropped (1024 tokens down to the 256 budget: 768 per layer and KV head) of
    # SmolLM2's 30 layers x 3 KV heads, each K and V (64 wide, float32) plus position and score.
    p = r["results"]["keydiff:recall=true"]["prefill"]
    assert 0 < p["recall_ms"] <= p["evict_fraction"] * p["total_ms"]
    assert 0 < p["tier_peak_bytes"] <= 30 * 768 * 3 * (2 * 64 * 4 + 8 + 4)


@pytest.mark.slow
def test_prefix_smoke(smollm2_model, tmp_path):
    """Shared prefixes (vLLM's own bench serve, prefix_repetition) and multi-turn chat on stock vLLM
    and kvevict with prefix caching (pure blocks and compacted windows), with recall (the windows
    with their tiers), with pure blocks only, and without: kvevict reuses the windows it compacted
    (more than the pure prefix alone), so does the recall server, the cache-off server reuses
    nothing; the multi-turn needle runs on stock, kvevict and kvevict with recall."""
    r = _bench(tmp_path, "prefix")
    res = r["results"]
    assert set(res) == {"stock", "kvevict", "kvevict-recall", "kvevict-pure", "kvevict-nocache"}
    for _name, v in res.items():
        s, m = v["shared_prefix"], v["multi_turn"]
        assert s["completed"] == r["num_prompts"] and s["median_ttft_s"] > 0 and s["output_tok_per_s"] > 0
        assert (
            len(m["per_turn"]) == r["turns"]
            and m["output_tokens"] == r["conversations"] * r["turns"] * r["turn_output_len"]
        )
    assert res["kvevict-nocache"]["shared_prefix"]["prefix_hit_rate"] == 0
    assert res["stock"]["shared_prefix"]["prefix_hit_rate"] > 0
    assert res["kvevict"]["shared_prefix"]["prefix_hit_rate"] > 0
    assert res["kvevict"]["multi_turn"]["prefix_hit_rate"] > res["kvevict-pure"]["multi_turn"]["prefix_hit_rate"]
    assert res["kvevict"]["multi_turn"]["compressed_hit_tokens"] > 0
    assert res["kvevict-pure"]["multi_turn"]["compressed_hit_tokens"] == 0
    recall = res["kvevict-recall"]["multi_turn"]
    assert recall["compressed_hit_tokens"] > 0 and recall["cached_tier_bytes"] > 0
    assert set(r["kvevict_over_stock"]) == {"kvevict", "kvevict-recall", "kvevict-pure", "kvevict-nocache"}
    for name in ("kvevict", "kvevict-recall", "kvevict-pure", "kvevict-nocache"):  # within their window bound
        assert res[name]["windows"]["requests"] > 0 and res[name]["windows"]["over_bound"] == 0
    # The multi-turn needle: stock and kvevict answer the same conversations, kvevict on its windows.
    needle = {n: res[n]["needle"] for n in ("stock", "kvevict", "kvevict-recall")}
    assert all("needle" not in res[n] for n in ("kvevict-pure", "kvevict-nocache"))
    for n in needle.values():
        assert len(n["conversations"]) == r["needle_conversations"] and 0 <= n["score"] <= 1
        assert n["last_prompt_tokens"] > 2 * r["budget"]
    for n in ("kvevict", "kvevict-recall"):
        assert [c["answer"] for c in needle["stock"]["conversations"]] == [
            c["answer"] for c in needle[n]["conversations"]
        ]
    assert needle["kvevict"]["compressed_hit_tokens"] > 0


@pytest.mark.slow
def test_speculative_smoke(smollm2_model, tmp_path):
    """vllm bench serve against four servers: drafts are accepted on the repetitive workload with and
    without eviction (how many is reported: a small budget leaves the model less of the text it
    repeats), and the kvevict servers evict."""
    r = _bench(tmp_path, "speculative")
    assert set(r["results"]) == {"stock", "stock+ngram", "kvevict", "kvevict+ngram"}
    for name, res in r["results"].items():
        assert res["completed"] == r["num_prompts"] and res["output_tok_per_s"] > 0
        assert (res["acceptance"] is not None) == name.endswith("+ngram")
        assert (res["blocks_freed"] > 0) == name.startswith("kvevict"), name
    assert all(res["acceptance"] > 0 for name, res in r["results"].items() if name.endswith("+ngram"))
    assert set(r["ngram_speedup"]) == {"stock", "kvevict"}


@pytest.mark.slow
def test_running_server(smollm2_model, tmp_path, monkeypatch):
    """throughput, memory and prefix against a server already running (--base-url, and
    --stock-base-url on the same one), at the smallest sizes: nothing else is started, each kvevict
    request evicts with its own budget (the server's default budget, larger than every prompt here,
    leaves the 'stock' runs alone), and the reports carry the server's own KV cache from /metrics."""
    from vllm_kvevict.bench import cli
    from vllm_kvevict.testing.server import VLLMServer, cpu_args

    args = [
        *cpu_args("1073741824"),
        "--max-model-len",
        "4096",
        "--attention-backend",
        "kvevict",
        "--additional-config",
        json.dumps({"kvevict": {"policy": "keydiff", "budget": 1024}}),
    ]
    out = tmp_path / "out"
    with VLLMServer(smollm2_model, args, log_path=tmp_path / "server.log", served_model_name="smol") as srv:

        def no_start(self):
            raise AssertionError(f"the benchmark started a server: {self.command()}")

        monkeypatch.setattr(VLLMServer, "start", no_start)
        urls = ["--base-url", srv.base_url, "--stock-base-url", srv.base_url, "--out", str(out)]

        def bench(*argv: str) -> dict:
            assert cli.main([argv[0], *urls, *argv[1:]]) == 0
            report = json.loads((out / f"{argv[0]}.json").read_text())
            assert (out / f"{argv[0]}.png").stat().st_size > 10_000
            for side in ("kvevict", "stock"):  # the server's own, from /v1/models and /metrics
                assert report["remote"][side] == {
                    "base_url": srv.base_url,
                    "served_model_name": "smol",
                    "block_size": 32,
                    "kv_blocks": report["remote"][side]["kv_blocks"],
                    "prefix_caching": True,
                }
                assert report["remote"][side]["kv_blocks"] > 100
            assert report["served_model_name"] == "smol" and report["model"] == str(smollm2_model)
            return report

        r = bench("throughput", "--num-prompts", "2", "--input-len", "128", "--output-len", "8")
        assert set(r["results"]) == {"stock", "kvevict-0.25"}
        for res in r["results"].values():
            assert res["output_tokens"] == 2 * 8 and len(res["requests"]) == 2
            assert res["output_tok_per_s"] > 0 and res["req_per_s"] > 0 and res["ttft"]["median_s"] > 0
            assert res["peak_running"] >= 1 and 0 < res["peak_kv_usage"] <= 1
        assert r["results"]["stock"]["blocks_freed"] == 0 and r["results"]["kvevict-0.25"]["blocks_freed"] > 0
        assert r["kvevict_over_stock"]["kvevict-0.25"]["output_tok_per_s"] > 0
        assert r["kv_blocks"] > 0 and r["kv_prompts"] > 0 and r["max_num_batched_tokens"] is None

        r = bench("memory", "--input-len", "256", "--output-len", "16", "--budget", "64")
        stock, kv = r["series"]["stock"], r["series"]["kvevict"]
        assert r["sequence_blocks"] == 9 and r["chunk"] is None
        # the exact peak from the plugin's counters; the window bound and the blocks held: its gauges,
        # sampled (a sample can miss the request, never exceed its bound)
        assert 0 < kv["engine_peak_blocks"] <= r["window_bound_blocks"] < stock["peak_blocks"] <= 9
        assert kv["window_peak_blocks"] <= r["window_bound_blocks"] and kv["peak_blocks"] <= r["window_bound_blocks"]
        assert "engine_peak_blocks" not in stock
        assert stock["latency_s"] > 0 and kv["latency_s"] > 0

        r = bench(
            "prefix",
            *("--budget", "64", "--num-prompts", "2", "--max-concurrency", "2"),
            *("--prefix-repetition-prefix-len", "128", "--prefix-repetition-suffix-len", "16"),
            *("--prefix-repetition-output-len", "4", "--conversations", "1", "--turns", "2"),
            *("--user-len", "96", "--turn-output-len", "4", "--needle-conversations", "0"),
        )
        assert set(r["results"]) == {"stock", "kvevict"} and set(r["kvevict_over_stock"]) == {"kvevict"}
        for res in r["results"].values():
            s, m = res["shared_prefix"], res["multi_turn"]
            assert s["completed"] == 2 and s["median_ttft_s"] > 0 and s["output_tok_per_s"] > 0
            assert m["output_tokens"] == 1 * 2 * 4 and m["output_tok_per_s"] > 0 and len(m["per_turn"]) == 2
            assert "windows" not in res and "needle" not in res  # the window peaks: in the server's log only
        assert r["results"]["stock"]["blocks_freed"] == 0 and r["results"]["kvevict"]["blocks_freed"] > 0
        assert all(v > 0 for v in r["kvevict_over_stock"]["kvevict"].values())
    assert not list(out.glob("server-*.log"))
