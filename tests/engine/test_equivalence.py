# SPDX-License-Identifier: Apache-2.0
"""With eviction disabled, or a budget larger than the prompt, our backend equals stock CPU_ATTN.

SmolLM2-135M-Instruct in float32, greedy: the generated tokens are identical and the per-token
logprobs (chosen token and top-5 alternatives) agree to 1e-5. The budget>prompt server is started
through `make serve`, the README's own command.
"""

from __future__ import annotations

import json

import pytest
from openai import OpenAI

from tests.conftest import CPU_SERVER_ARGS, ROOT
from vllm_kvevict.testing.server import VLLMServer, free_port

pytestmark = [pytest.mark.engine, pytest.mark.smollm2, pytest.mark.timeout(900)]

MAX_TOKENS = 32
TOL = 1e-5

_FILLER = (
    "The history of the city goes back many centuries. Merchants came from distant lands to trade "
    "spices, silk and silver, and the harbour grew busy with ships. "
)
PROMPTS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    _FILLER * 6 + "Summarise the text above in one sentence.",
    "List three prime numbers and explain why they are prime.",
]


def _generate(srv: VLLMServer) -> list[dict]:
    client = OpenAI(base_url=srv.base_url + "/v1", api_key="unused")
    tok_prompts = []
    out = []
    for text in PROMPTS:
        # The chat template applied by the server, then a plain completion with logprobs.
        chat = client.chat.completions.create(
            model=srv.served_model_name,
            messages=[{"role": "user", "content": text}],
            max_tokens=MAX_TOKENS,
            temperature=0,
            logprobs=True,
            top_logprobs=5,
        )
        c = chat.choices[0]
        out.append(
            {
                "tokens": [t.token for t in c.logprobs.content],
                "logprobs": [t.logprob for t in c.logprobs.content],
                "top": [{a.token: a.logprob for a in t.top_logprobs} for t in c.logprobs.content],
                "prompt_tokens": chat.usage.prompt_tokens,
            }
        )
        tok_prompts.append(chat.usage.prompt_tokens)
    return out


def _assert_same(ref: list[dict], got: list[dict], label: str) -> None:
    for i, (a, b) in enumerate(zip(ref, got, strict=True)):
        assert a["tokens"] == b["tokens"], f"{label}: prompt {i} generated different tokens"
        for j, (x, y) in enumerate(zip(a["logprobs"], b["logprobs"], strict=True)):
            assert abs(x - y) <= TOL, f"{label}: prompt {i} token {j}: logprob {x} vs {y}"
        for j, (ta, tb) in enumerate(zip(a["top"], b["top"], strict=True)):
            assert ta.keys() == tb.keys(), f"{label}: prompt {i} token {j}: top-5 differ"
            for k in ta:
                assert abs(ta[k] - tb[k]) <= TOL, f"{label}: prompt {i} token {j} alt {k!r}"


@pytest.fixture(scope="module")
def stock_outputs(smollm2_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("stock") / "stock.log"
    with VLLMServer(
        smollm2_model, [*CPU_SERVER_ARGS, "--max-model-len", "4096"], log_path=log, env={"KVEVICT_CONFIG": ""}
    ) as srv:
        outs = _generate(srv)
    text = srv.log()
    assert "kvevict: attention backend" not in text  # stock really is stock
    assert all(o["tokens"] for o in outs)
    return outs


def test_disabled_equals_stock(smollm2_model, stock_outputs, server_log):
    args = [
        "--attention-backend",
        "kvevict",
        *CPU_SERVER_ARGS,
        "--max-model-len",
        "4096",
        "--additional-config",
        json.dumps({"kvevict": {"enabled": False}}),
    ]
    with VLLMServer(smollm2_model, args, log_path=server_log("disabled")) as srv:
        outs = _generate(srv)
    assert "kvevict: attention backend KVEvictCPUImpl (base CPU_ATTN)" in srv.log()
    _assert_same(stock_outputs, outs, "enabled=false")


def test_budget_above_prompt_equals_stock_via_make_serve(stock_outputs, server_log):
    budget = 4096
    assert max(o["prompt_tokens"] for o in stock_outputs) + MAX_TOKENS < budget
    port = free_port()
    cfg = json.dumps({"kvevict": {"policy": "keydiff", "budget": budget}})
    cmd = ["make", "-s", "-C", str(ROOT), "serve", f"PORT={port}", f"KVEVICT={cfg}"]
    srv = VLLMServer(
        "smollm2",
        log_path=server_log("make_serve"),
        port=port,
        command=cmd,
        served_model_name="smollm2",
        env={"KVEVICT_CONFIG": ""},
    )
    with srv:
        outs = _generate(srv)
    assert f"policy=keydiff, budget={budget}" in srv.log()
    _assert_same(stock_outputs, outs, f"budget={budget}")
