# SPDX-License-Identifier: Apache-2.0
"""Helpers shared by the engine tests that evict: requests with logprobs, and the reference check."""

from __future__ import annotations

import contextlib
import json
import math
import random
import re
from collections.abc import Iterator, Sequence
from pathlib import Path

from openai import OpenAI

from vllm_kvevict.testing.hf_reference import PolicyCheck, attempts_for, replay_attempts
from vllm_kvevict.testing.server import VLLMServer, wait_until

TOL = 1e-4
#: the engine core's release line, one per attempt of a request (kv_manager.py)
RELEASED = re.compile(
    r"kvevict: request (\S+) released: (\d+) blocks freed by eviction, peak (\d+) blocks held "
    r"\(window bound (\d+|None)\); pool (\d+)/(\d+) blocks free, peak (\d+) used"
)


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


@contextlib.contextmanager
def pool_server(
    model: str,
    base: Path,
    config: dict,
    *,
    pool: int,
    chunk: int,
    max_len: int,
    max_seqs: int = 4,
    extra: Sequence[str] = ("--enable-prompt-tokens-details", "--enable-log-requests"),
    env: dict | None = None,
    dump: bool = True,
) -> Iterator[VLLMServer]:
    """A kvevict server (``{"kvevict": config}``) over a pool of exactly ``pool`` blocks (plus
    vLLM's null block), ``chunk`` tokens per step, its log in ``base`` and every compaction's
    kept positions dumped under ``base / "dump"`` (``srv.dump_dir``, for the transformers replay).
    ``extra``: more ``vllm serve`` flags (default: cached-token counts in responses, request logs);
    ``dump``: False, nothing dumped."""
    limits = ["--num-gpu-blocks-override", str(pool + 1), "--max-model-len", str(max_len)]
    limits += ["--max-num-batched-tokens", str(chunk), "--max-num-seqs", str(max_seqs)]
    env = {**({"KVEVICT_DUMP_DIR": str(base / "dump")} if dump else {}), **(env or {})}
    with VLLMServer(model, server_args(config, *limits, *extra), log_path=base / "server.log", env=env) as srv:
        srv.dump_dir = base / "dump"  # type: ignore[attr-defined]
        yield srv


def release_lines(srv: VLLMServer, request_id: str | None = None) -> list[tuple]:
    """The release lines logged so far (of ``request_id``'s attempts, or all): ``(request id, blocks
    freed, peak blocks, window bound or None, free blocks, pool blocks, pool peak)``."""
    return [
        (m[1], *(None if g == "None" else int(g) for g in m.groups()[1:]))
        for m in RELEASED.finditer(srv.log())
        if request_id is None or m[1].startswith(request_id + "-")
    ]


def released_line(srv: VLLMServer, request_id: str, timeout: float = 60.0) -> tuple:
    """The last release line of a request, once the engine core has logged it (it frees the request
    right after the last output reaches the client: wait for it, never sleep)."""
    wait_until(lambda: bool(release_lines(srv, request_id)), timeout, f"the release line of {request_id}")
    return release_lines(srv, request_id)[-1]


def reset_prefix_cache(srv: VLLMServer) -> None:
    """vLLM's /reset_prefix_cache (the server needs ``VLLM_SERVER_DEV_MODE=1``)."""
    assert srv.post("/reset_prefix_cache") == 200


def computed_alone(srv: VLLMServer, prompt: list[int], max_tokens: int, xargs: dict | None = None) -> dict:
    """The request computed alone, on an empty prefix cache (what it caches is dropped after)."""
    reset_prefix_cache(srv)
    out = complete(srv, prompt, max_tokens, xargs)
    assert out["cached_tokens"] == 0
    released_line(srv, out["id"])
    reset_prefix_cache(srv)
    return out


def same_as_alone(out: dict, ref: dict) -> None:
    """``out`` chose the tokens of ``ref`` (:func:`computed_alone`), each logprob within :data:`TOL`."""
    assert out["tokens"] == ref["tokens"], (out["id"], out["tokens"], ref["tokens"])
    for j, (a, b) in enumerate(zip(out["logprobs"], ref["logprobs"])):
        assert math.isclose(a, b, abs_tol=TOL), f"{out['id']}: token {j}: logprob {a} vs {b} alone"


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
    prompt_lp = getattr(r.choices[0], "prompt_logprobs", None)  # vLLM's, with "prompt_logprobs": 0
    return {
        "id": r.id,
        "prompt": prompt,
        "tokens": [int(t.removeprefix("token_id:")) for t in lp.tokens],
        "logprobs": lp.token_logprobs,
        "cached_tokens": getattr(details, "cached_tokens", None),
        "finish_reason": r.choices[0].finish_reason,
        # each prompt token's logprob given the tokens before it (the first has none)
        "prompt_logprobs": [next(iter(d.values()))["logprob"] if d else None for d in prompt_lp or []],
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
