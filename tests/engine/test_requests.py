# SPDX-License-Identifier: Apache-2.0
"""Per-request overrides through the OpenAI API (``vllm_xargs``): policy, budget, enabled.

Both sides honour them: the workers keep the request's own budget with its own policy (checked
against the transformers reference), and the engine core frees blocks by the request's window.
A bad value is refused with HTTP 400 naming the key, and the server keeps serving.
"""

from __future__ import annotations

import json

import openai
import pytest

from tests.conftest import CPU_SERVER_ARGS
from tests.engine.evict_common import check_against_reference, complete, make_prompt, released_line
from vllm_kvevict.testing.hf_reference import attempts_for, load_attempts
from vllm_kvevict.testing.server import VLLMServer
from vllm_kvevict.window import WindowConfig, evicted_tokens

pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]

BS, MAX_TOKENS = 32, 40


@pytest.fixture(scope="module")
def server(gqa_model, tmp_path_factory):
    base = tmp_path_factory.mktemp("requests")
    cfg = {"kvevict": {"policy": "streamingllm", "budget": 80}}
    args = [
        "--attention-backend",
        "kvevict",
        *CPU_SERVER_ARGS,
        "--max-model-len",
        "4096",
        "--max-num-batched-tokens",
        "64",
        "--additional-config",
        json.dumps(cfg),
    ]
    with VLLMServer(gqa_model, args, log_path=base / "server.log", env={"KVEVICT_DUMP_DIR": str(base / "dump")}) as srv:
        srv.dump_dir = base / "dump"
        yield srv


def _kept_counts(srv, out) -> set[int]:
    (att,) = attempts_for(load_attempts(srv.dump_dir), out["id"])
    return {len(h) for layers in att.events.values() for kept in layers.values() for h in kept}


def _freed(srv, out) -> int:
    return released_line(srv, out["id"])[1]


def test_overrides_apply_on_both_sides(server, hf_model):
    vocab = hf_model.config.vocab_size
    P = 400
    default = complete(server, make_prompt(P, 31, vocab), MAX_TOKENS)
    assert _kept_counts(server, default) <= set(range(80, 80 + BS))
    assert _freed(server, default) == evicted_tokens(P + MAX_TOKENS - 1, P, WindowConfig(80, BS)) // BS

    own = complete(
        server, make_prompt(P, 32, vocab), MAX_TOKENS, xargs={"kvevict_policy": "keydiff", "kvevict_budget": 128}
    )
    assert _kept_counts(server, own) <= set(range(128, 128 + BS))
    assert _freed(server, own) == evicted_tokens(P + MAX_TOKENS - 1, P, WindowConfig(128, BS)) // BS
    check_against_reference(hf_model, own, load_attempts(server.dump_dir))

    off = complete(server, make_prompt(P, 33, vocab), MAX_TOKENS, xargs={"kvevict_enabled": False})
    assert not attempts_for(load_attempts(server.dump_dir), off["id"])[0].events  # nothing compacted
    assert _freed(server, off) == 0


@pytest.mark.parametrize(
    "xargs, message",
    [
        ({"kvevict_budget": 3}, "kvevict_budget: budget 3 is below the minimum 5 for policy 'streamingllm'"),
        (
            {"kvevict_policy": "h3o"},
            "kvevict_policy: unknown policy 'h3o'; allowed values: caote, criticalkv, fastcaote, h2o, keydiff, knorm, kvmerger, lshe, none, random, snapkv, streamingllm, tova",
        ),
        ({"kvevict_enabled": "perhaps"}, "kvevict_enabled: Input should be a valid boolean"),
        ({"kvevict_budgte": 64}, "unknown request key 'kvevict_budgte'; allowed keys: kvevict_budget, kvevict_enabled"),
    ],
)
def test_bad_override_is_http_400_and_server_keeps_serving(server, hf_model, xargs, message):
    with pytest.raises(openai.BadRequestError) as ei:
        complete(server, make_prompt(50, 34, hf_model.config.vocab_size), 4, xargs=xargs)
    assert ei.value.status_code == 400
    assert message in str(ei.value)
    ok = complete(server, make_prompt(50, 35, hf_model.config.vocab_size), 4)
    assert len(ok["tokens"]) == 4
