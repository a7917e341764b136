# SPDX-License-Identifier: Apache-2.0
"""The operator's limits on the per-request keys (``kvevict.limits``) through the OpenAI API: what
they allow is served with the request's own settings, what they refuse is an HTTP 400 naming the
key and the limit, and the server keeps serving."""

from __future__ import annotations

import openai
import pytest

from tests.engine.evict_common import complete, make_prompt, released_line, server_args
from vllm_kvevict.testing.server import VLLMServer
from vllm_kvevict.window import WindowConfig, evicted_tokens

pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]

BS = 32
LIMITS = {
    "keys": ["kvevict_policy", "kvevict_budget", "kvevict_enabled", "kvevict_recall"],
    "policies": ["streamingllm", "keydiff"],
    "min_budget": 64,
    "max_budget": 256,
    "disable": False,
    "recall": False,
}


@pytest.fixture(scope="module")
def server(gqa_model, tmp_path_factory):
    base = tmp_path_factory.mktemp("limits")
    cfg = {"policy": "streamingllm", "budget": 80, "limits": LIMITS}
    args = server_args(cfg, "--max-model-len", "2048", "--max-num-batched-tokens", "64")
    with VLLMServer(gqa_model, args, log_path=base / "server.log") as srv:
        yield srv


def test_what_the_limits_allow_is_served_with_its_settings(server, hf_model):
    P, N = 300, 20
    out = complete(
        server,
        make_prompt(P, 41, hf_model.config.vocab_size),
        N,
        xargs={"kvevict_policy": "keydiff", "kvevict_budget": 128},
    )
    assert len(out["tokens"]) == N
    assert released_line(server, out["id"])[1] == evicted_tokens(P + N - 1, P, WindowConfig(128, BS)) // BS
    on = complete(server, make_prompt(P, 42, hf_model.config.vocab_size), N, xargs={"kvevict_enabled": True})
    assert len(on["tokens"]) == N


@pytest.mark.parametrize(
    "xargs, message",
    [
        ({"kvevict_budget": 32}, "kvevict_budget: 32 is outside the allowed [64, 256] (this server's kvevict.limits)"),
        ({"kvevict_budget": 257}, "kvevict_budget: 257 is outside the allowed [64, 256]"),
        ({"kvevict_policy": "h2o"}, "kvevict_policy: 'h2o' is not allowed (allowed: streamingllm, keydiff)"),
        ({"kvevict_enabled": False}, "kvevict_enabled: clients may not turn eviction off"),
        ({"kvevict_recall": True}, "kvevict_recall: clients may not turn recall on"),
        (
            {"kvevict_trigger": "once"},
            "kvevict_trigger: clients may not set this key "
            "(allowed keys: kvevict_policy, kvevict_budget, kvevict_enabled, kvevict_recall)",
        ),
    ],
)
def test_beyond_the_limits_is_http_400_naming_key_and_limit(server, hf_model, xargs, message):
    vocab = hf_model.config.vocab_size
    with pytest.raises(openai.BadRequestError) as ei:
        complete(server, make_prompt(50, 43, vocab), 4, xargs=xargs)
    assert ei.value.status_code == 400
    assert message in str(ei.value)
    assert len(complete(server, make_prompt(50, 44, vocab), 4)["tokens"]) == 4
