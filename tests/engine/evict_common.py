# SPDX-License-Identifier: Apache-2.0
"""Helpers shared by the engine tests that evict: requests with logprobs, and the reference check."""

from __future__ import annotations

import json
import random

from openai import OpenAI

from vllm_kvevict.testing.hf_reference import PolicyCheck, attempts_for, replay_attempts
from vllm_kvevict.testing.server import VLLMServer

TOL = 1e-4


def server_args(config: dict, *extra: str) -> list[str]:
    """``vllm serve`` arguments for a kvevict test server on this CPU machine: the backend, the
    machine's flags, ``extra``, and ``{"kvevict": config}`` as the additional configuration."""
    from tests.conftest import CPU_SERVER_ARGS

    return [
        "--attention-backend",
        "kvevict",
        *CPU_SERVER_ARGS,
        *extra,
        "--additional-config",
        json.dumps({"kvevict": config}),
    ]


def make_prompt(n: int, seed: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def complete(
    srv: VLLMServer,
    prompt: list[int],
    max_tokens: int,
    xargs: dict | None = None,
    extra: dict | None = None,
    headers: dict | None = None,
) -> dict:
    """A greedy completion of token ids, with the chosen tokens' ids and logprobs.

    ``xargs``: the request's ``vllm_xargs`` (per-request kvevict overrides); ``extra``: more
    fields of vLLM's request body (e.g. ``stop_token_ids``); ``headers``: HTTP headers (e.g.
    vLLM's ``X-data-parallel-rank``).
    """
    client = OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0)
    body = {"ignore_eos": True, "return_tokens_as_token_ids": True, **(extra or {})}
    if xargs is not None:
        body["vllm_xargs"] = xargs
    r = client.completions.create(
        model=srv.served_model_name,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        logprobs=1,
        extra_body=body,
        extra_headers=headers,
    )
    lp = r.choices[0].logprobs
    details = getattr(r.usage, "prompt_tokens_details", None)  # with --enable-prompt-tokens-details
    return {
        "id": r.id,
        "prompt": prompt,
        "tokens": [int(t.removeprefix("token_id:")) for t in lp.tokens],
        "logprobs": lp.token_logprobs,
        "cached_tokens": getattr(details, "cached_tokens", None),
        "finish_reason": r.choices[0].finish_reason,
    }


def check_against_reference(hf_model, out: dict, attempts, expect_compaction: bool = True, config=None) -> list:
    """Greedy tokens and logprobs of one engine request equal the reference's; returns its attempts.

    ``config``: the request's KVEvictConfig; when given, the reference also recomputes the policy's
    kept sets from its own tensors and compares them with the engine's (PolicyCheck).
    """
    atts = attempts_for(attempts, out["id"])
    assert atts, f"request {out['id']} not seen by the workers"
    assert any(a.events for a in atts) == expect_compaction, f"compactions of {out['id']}: {atts}"
    make_check = None
    if config is not None:
        from vllm_kvevict.request import resolve

        settings = resolve(config, None, 32)

        def make_check():
            check = PolicyCheck(
                hf_model,
                settings.policy,
                config.budget,
                decode_policy=settings.decode_policy,
                prompt_len=len(out["prompt"]),
            )
            checks.append(check)
            return check

    checks: list[PolicyCheck] = []
    logp = replay_attempts(hf_model, out["prompt"], out["tokens"], atts, make_check)
    if config is not None:  # every (event, layer) of every attempt was recomputed and compared
        # (with recall, those that take tokens back are replayed, not recomputed: all but the decode's)
        P = len(out["prompt"]) if config.recall.enabled else 0
        n_events = sum(len(layers) for a in atts for L, layers in a.events.items() if L > P)
        compared = sum(c.compared for c in checks)
        assert compared >= n_events if P else compared == n_events, (n_events, [c.compared for c in checks])
    for j, (tok, lp) in enumerate(zip(out["tokens"], out["logprobs"], strict=True)):
        row = logp[j]
        assert int(row.argmax()) == tok, f"{out['id']}: token {j}: engine {tok}, reference argmax {int(row.argmax())}"
        assert abs(float(row[tok]) - lp) <= TOL, f"{out['id']}: token {j}: logprob {lp} vs {float(row[tok])}"
    return atts
