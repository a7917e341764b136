"""Fault isolation for the eviction step: one request's policy error never kills the engine.

vLLM declares the engine core dead when the attention forward raises, and every later request then
fails. The eviction step therefore never lets an exception out: when the batched step raises,
:func:`isolate` runs every row alone; a row whose policy raises again is given the safe policy
(:data:`SAFE_POLICY`: keep the newest tokens of each KV head) and compacted with it, inside the
same window, so the scheduler's block accounting (which only knows the window) stays right. The
request keeps the safe policy for the rest of its life, on every layer (its state in the worker's
registry says so: :func:`policy_of`); one WARNING names it, its policy and the error, and
:data:`FALLBACKS` counts it per policy.

The step writes nothing before every row is scored and selected
(:func:`~vllm_kvevict.backends.evict.evict_step`), so a retry starts from the untouched cache.

The backend's preparation of a row (its queries, query window, output projection ``W_O``) is
guarded the same way: a request whose preparation raises (for example a policy that needs ``W_O``
on a model where none is found) falls back before the step.

Testing: ``KVEVICT_TEST_FAULT=<policy>[,<policy>@prepare...]`` (read when a policy object is made;
off by default) makes the scoring (or the row preparation) of those policies raise, so a test can
fault one request among many. ``KVEVICT_TEST_HOLD=<dir>`` lets a test stop the engine at a point of
its choosing (:func:`hold_if_asked`).
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path

import torch

from vllm_kvevict import envs, metrics
from vllm_kvevict._logging import logger
from vllm_kvevict.policies import Policy
from vllm_kvevict.policies.streamingllm import StreamingLLM, StreamingLLMParams
from vllm_kvevict.request import RequestState
from vllm_kvevict.vllm_compat import distributed as vllm_distributed

TEST_FAULT_ENV = "KVEVICT_TEST_FAULT"
#: the longest a held step waits for its test (then it goes on, with a warning)
HOLD_DEADLINE_S = 600.0

#: Keeps the newest tokens per KV head (StreamingLLM without sinks): scores are the positions,
#: nothing it computes can fail for a window the engine could gather.
SAFE_POLICY: Policy = StreamingLLM(StreamingLLMParams(sink_tokens=0))

#: policy name -> requests that fell back to :data:`SAFE_POLICY` in this worker since start.
FALLBACKS: Counter[str] = Counter()


def policy_of(state: RequestState) -> Policy:
    """The policy a request runs with in this worker: its own, or the safe one after a fault."""
    if state.fell_back_from is not None:
        return SAFE_POLICY
    faults = envs.KVEVICT_TEST_FAULT
    return _faulty(state.settings.policy, faults) if faults else state.settings.policy


@lru_cache(maxsize=64)
def _faulty(policy: Policy, faults: frozenset[str]) -> Policy:
    return maybe_faulty(policy)


def fall_back(state: RequestState | None, req_id: str | None, policy: Policy, err: BaseException) -> None:
    name = getattr(policy, "name", type(policy).__name__)
    if state is not None:
        if state.fell_back_from is not None:
            return
        state.fell_back_from = name
    FALLBACKS[name] += 1
    rec = metrics.recorder("worker", vllm_distributed.tensor_parallel()[0])
    if rec is not None:
        rec.inc("fallbacks", name)
    logger.warning(
        "kvevict: request %s: policy %s failed (%s: %s); it keeps the newest tokens from now on",
        req_id or "?",
        name,
        type(err).__name__,
        str(err)[:200],
    )


def isolate(plan, work: list, step: Callable[[list], list[torch.Tensor]], err: BaseException):
    """The batched ``step(work)`` raised ``err``: run each row alone, replacing the policy of every
    row that fails again by :data:`SAFE_POLICY`. Returns the work as finally run and the kept
    positions of its compacting rows, in order (what ``step`` returns)."""
    from vllm_kvevict.backends.evict import RowWork

    logger.debug("kvevict: eviction step failed for %d rows (%r); retrying row by row", len(work), err)
    done: list = []
    kept: list[torch.Tensor] = []
    for w in work:
        try:
            out = step([w])
        except Exception as row_err:  # noqa: BLE001
            fall_back(
                plan.states[w.row] if plan.states else None,
                plan.req_ids[w.row] if plan.req_ids else None,
                w.policy,
                row_err,
            )
            # The safe policy reads nothing but keys and positions: none of the row's extras (queries,
            # W_O, ...) go with it, whatever broke the policy cannot break it; what it drops is
            # still handed to the recall tier.
            w = RowWork(w.row, SAFE_POLICY, w.compact, {}, w.keep_evicted)
            out = step([w])
        done.append(w)
        kept += out
    return done, kept


class _InjectedFault(RuntimeError):
    pass


def maybe_faulty(policy: Policy) -> Policy:
    """``policy``, or (under ``KVEVICT_TEST_FAULT``) a copy that raises: ``name`` makes its scoring
    raise (inside the eviction step), ``name@prepare`` makes the backend's preparation of its rows
    raise (where it reads the queries and W_O, before the step)."""
    names = envs.KVEVICT_TEST_FAULT
    cls = type(policy)
    if policy.name in names:

        def fail(*_args, **_kwargs):
            raise _InjectedFault(f"fault injected into {policy.name} by {TEST_FAULT_ENV}")

        methods = {
            "score": fail,
            "observe": fail,
            **({"evict": fail} if cls.evict is not Policy.evict else {}),
            **({"score_ragged": fail} if cls.score_ragged is not Policy.score_ragged else {}),
        }
    elif f"{policy.name}@prepare" in names:

        def fail_prepare(_self):
            raise _InjectedFault(f"fault injected into the preparation of {policy.name} by {TEST_FAULT_ENV}")

        methods = {"query_window": property(fail_prepare)}
    else:
        return policy
    return type(f"Faulty{cls.__name__}", (cls,), methods)(policy.params)


def hold_if_asked(plan) -> None:
    """Tests only, under ``KVEVICT_TEST_HOLD=<dir>``: while the file ``<dir>/hold`` exists, a step
    that runs on a window eviction has already moved (some row's ``e_prev > 0``) waits in the
    worker, before its forward, having created ``<dir>/held``; while ``<dir>/hold-compacting``
    exists, so does a step in which some row compacts (``e_new > e_prev``). The request is then
    provably in the middle of its prompt or its decoding (or in the step of a compaction), its
    earlier compactions done, whatever the machine's speed: a test can disconnect its client and
    remove the file; the engine core takes the abort before the next step."""
    d = envs.KVEVICT_TEST_HOLD
    if d is None:
        return
    if any(plan.e_prev) and Path(d, "hold").exists():
        hold = Path(d, "hold")
    elif any(b > a for a, b in zip(plan.e_prev, plan.e_new)) and Path(d, "hold-compacting").exists():
        hold = Path(d, "hold-compacting")
    else:
        return
    Path(d, "held").touch()
    deadline = time.monotonic() + HOLD_DEADLINE_S
    while hold.exists():
        if time.monotonic() > deadline:
            logger.warning("kvevict: %s held the step for %.0f s; going on", os.fspath(hold), HOLD_DEADLINE_S)
            return
        time.sleep(0.01)
