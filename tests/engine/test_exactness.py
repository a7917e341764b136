"""Exactness: the engine with eviction equals a transformers reference that evicts the same tokens.

The engine dumps the positions it kept per (request, layer, KV head) at every compaction
(``KVEVICT_DUMP_DIR``); the reference replays them (vllm_kvevict/testing/hf_reference.py). Prompts
span many chunks (``--max-num-batched-tokens 64``), generation runs through decode-time
compactions, float32; greedy tokens must match and logprobs agree to 1e-4.
"""

from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from openai import OpenAI

from tests.conftest import CPU_SERVER_ARGS
from vllm_kvevict.testing.hf_reference import events_for, load_events, replay
from vllm_kvevict.testing.models import tiny_path
from vllm_kvevict.testing.server import VLLMServer

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]

TOL = 1e-4
BUDGET = 80  # not a multiple of the block size (32)
MAX_TOKENS = 72  # crosses at least two decode-time compactions


@pytest.fixture(scope="module")
def gqa_model():
    # 4 query heads over 2 KV heads (so KV heads can keep different tokens), head size 64.
    return tiny_path(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, intermediate_size=512)


@pytest.fixture(scope="module")
def hf_model(gqa_model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(gqa_model, dtype=torch.float32, attn_implementation="eager").eval()


def _prompt(n: int, seed: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def _complete(srv: VLLMServer, prompt: list[int]) -> dict:
    client = OpenAI(base_url=srv.base_url + "/v1", api_key="unused")
    r = client.completions.create(
        model=srv.served_model_name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, logprobs=1,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
    )
    lp = r.choices[0].logprobs
    return {
        "id": r.id, "prompt": prompt,
        "tokens": [int(t.removeprefix("token_id:")) for t in lp.tokens], "logprobs": lp.token_logprobs,
    }


def _check_against_reference(hf_model, out: dict, events) -> dict:
    ev = events_for(events, out["id"])
    assert ev, f"no compaction recorded for {out['id']}"
    ids = out["prompt"] + out["tokens"][:-1]
    logp = replay(hf_model, ids, ev)
    P = len(out["prompt"])
    for j, (tok, lp) in enumerate(zip(out["tokens"], out["logprobs"], strict=True)):
        row = logp[P - 1 + j]
        assert int(row.argmax()) == tok, f"{out['id']}: token {j}: engine {tok}, reference argmax {int(row.argmax())}"
        assert abs(float(row[tok]) - lp) <= TOL, f"{out['id']}: token {j}: logprob {lp} vs {float(row[tok])}"
    return ev


@pytest.mark.parametrize("policy", ["keydiff", "streamingllm"])
def test_engine_equals_reference_with_same_kept_sets(policy, gqa_model, hf_model, tmp_path, server_log):
    dump = tmp_path / "dump"
    cfg = {"kvevict": {"policy": policy, "budget": BUDGET}}
    args = ["--attention-backend", "kvevict", *CPU_SERVER_ARGS, "--max-model-len", "2048",
            "--max-num-batched-tokens", "64", "--max-num-seqs", "4", "--additional-config", json.dumps(cfg)]
    vocab = hf_model.config.vocab_size
    with VLLMServer(gqa_model, args, log_path=server_log(policy), env={"KVEVICT_DUMP_DIR": str(dump)}) as srv:
        single = _complete(srv, _prompt(300, 1, vocab))
        with ThreadPoolExecutor(3) as pool:  # three concurrent requests of different lengths
            concurrent = list(pool.map(lambda a: _complete(srv, _prompt(*a, vocab)), [(190, 2), (411, 3), (97, 4)]))
    events = load_events(dump)
    for out in [single, *concurrent]:
        ev = _check_against_reference(hf_model, out, events)
        P = len(out["prompt"])
        # Every compaction keeps the same count per head, within [budget, budget + block_size).
        for L, layers in ev.items():
            for kept in layers.values():
                assert all(BUDGET <= len(h) < BUDGET + 32 for h in kept) and len({len(h) for h in kept}) == 1
        assert sum(L > P for L in ev) >= 2, "expected compactions during decoding"
        if P > BUDGET + 64:
            assert sum(L <= P for L in ev) >= 2, "expected several compactions during the prompt"
