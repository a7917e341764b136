# SPDX-License-Identifier: Apache-2.0
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
Should the safe policy raise too, the last resort writes nothing: the safe policy's kept set is the
newest ``L - E_new`` tokens of each head, which are exactly the slots ``[E_new, L)`` as they are
(each head holds its window in position order), so leaving them is its compaction, and nothing
there can fail (:func:`isolate`'s ``in_place``).

The backend's preparation of a row (its queries, query window, output projection ``W_O``) is
guarded the same way: a request whose preparation raises (for example a policy that needs ``W_O``
on a model where none is found) falls back before the step.

The engine core must hear of every fallback before it caches anything of that attempt: a window
the safe policy compacted, cached under the request's configuration, would be read by every later
request with that prefix as if its policy had made it. :func:`fall_back` notes the request for the
step; once the step's forward has run, :func:`step_fallbacks` hands the step's fallbacks of every
tensor-parallel rank to the model runner's output (``vllm_compat/runner.py``), which the engine core
reads before it looks at the step's results (``kv_manager.SchedulerHooks.fallbacks``).

Testing: :mod:`vllm_kvevict.testing.hooks` makes policies raise on demand (``KVEVICT_TEST_FAULT``),
outside this module and the forward path.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import torch

from vllm_kvevict import metrics
from vllm_kvevict._logging import logger
from vllm_kvevict.policies import Policy
from vllm_kvevict.policies.streamingllm import StreamingLLM, StreamingLLMParams
from vllm_kvevict.request import WORKER, RequestState
from vllm_kvevict.vllm_compat import distributed as vllm_distributed

#: Keeps the newest tokens per KV head (StreamingLLM without sinks): scores are the positions,
#: nothing it computes can fail for a window the engine could gather.
SAFE_POLICY: Policy = StreamingLLM(StreamingLLMParams(sink_tokens=0))

#: policy name -> requests that fell back to :data:`SAFE_POLICY` in this worker since start.
FALLBACKS: Counter[str] = Counter()

#: requests that fell back in this worker since the last :func:`step_fallbacks`
_unreported: set[str] = set()
#: requests whose windows must no longer be cached, their policy kept (a recall tier trimmed or
#: lost: it is no longer what the request's configuration computes), since the last report
_uncached: set[str] = set()
#: how another rank's report of :data:`_uncached` reads in the gathered set (never a request id)
_UNCACHED_TAG = "\x00uncached:"


def stop_caching(req_id: str | None) -> None:
    """Nothing more of ``req_id``'s attempt may be cached (its policy stays): reported to the engine
    core with the step's fallbacks, before it caches anything of the step."""
    if req_id is not None:
        _uncached.add(req_id)


def policy_of(state: RequestState, decoding: bool = False) -> Policy:
    """The policy a request runs with in this worker: its own (once its prompt is complete,
    ``decoding``, the settings' :attr:`~vllm_kvevict.request.RequestSettings.decode_policy`, unless
    its recall failed: the window is then its policy's), or the safe one after a fault."""
    if state.fell_back_from is not None:
        return SAFE_POLICY
    return state.settings.decode_policy if decoding and not state.recall_failed else state.settings.policy


def fall_back(state: RequestState | None, req_id: str | None, policy: Policy, err: BaseException) -> None:
    name = getattr(policy, "name", type(policy).__name__)
    if state is not None:
        if state.fell_back_from is not None:
            return
        state.fell_back_from = name
    if req_id is not None:
        _unreported.add(req_id)
    FALLBACKS[name] += 1
    rec = metrics.worker_recorder()
    if rec is not None:
        rec.inc("fallbacks", name)
    logger.warning(
        "kvevict: request %s: policy %s failed (%s: %s); it keeps the newest tokens from now on",
        req_id or "?",
        name,
        type(err).__name__,
        str(err)[:200],
    )


def fall_back_rows(plan, err: BaseException, rows=None) -> None:
    """Every evicting request of the step's ``rows`` (all of them by default) falls back, for
    ``err``: what this layer's step could not do for them (an allocation that failed, any error
    outside the isolated step) is not done, and each compacting row's window is left as it is
    (the safe policy's kept set)."""
    for r in range(len(plan.states)) if rows is None else rows:
        st = plan.states[r]
        if st.settings.evicts:
            fall_back(st, plan.req_ids[r] if plan.req_ids else None, policy_of(st), err)


def step_fallbacks() -> frozenset[str]:
    """The requests that fell back in the step just run, or whose windows must no longer be cached
    (:func:`stop_caching`), on this rank or any other of its tensor-parallel group (called by every
    rank once per step: the ranks agree), for the step's output to the engine core, which caches
    nothing of them from then on. A request that fell back on another rank falls back here too:
    every rank runs the safe policy from the next step on."""
    mine = frozenset(_unreported) | frozenset(_UNCACHED_TAG + r for r in _uncached - _unreported)
    _unreported.clear()
    _uncached.clear()
    every = vllm_distributed.union_over_ranks(mine)
    for rid in every - mine:
        st = WORKER.get(rid)
        if st is not None and st.fell_back_from is None:
            st.fell_back_from = "another rank's fallback"
    return frozenset(r.removeprefix(_UNCACHED_TAG) for r in every)


def isolate(
    plan,
    work: list,
    step: Callable[[list], list[torch.Tensor | None]],
    err: BaseException,
    in_place: Callable[[int], torch.Tensor],
):
    """The batched ``step(work)`` raised ``err``: run each row alone, replacing the policy of every
    row that fails again by :data:`SAFE_POLICY`; a row that fails with it too is left in place
    (``in_place(row)``: the kept positions of its slots ``[E_new, L)``, nothing written). Returns
    the work as finally run and the kept positions of its compacting rows, in order (what ``step``
    returns)."""
    from vllm_kvevict.backends.evict import RowWork

    logger.debug("kvevict: eviction step failed for %d rows (%r); retrying row by row", len(work), err)
    done: list = []
    kept: list[torch.Tensor | None] = []
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
            w = RowWork(w.row, SAFE_POLICY, w.compact, keep_evicted=w.keep_evicted)
            try:
                out = step([w])
            except Exception as safe_err:  # noqa: BLE001 - the last resort: the window as it is
                logger.debug(
                    "kvevict: request %s: the safe policy failed too (%r); its window is left in place",
                    plan.req_ids[w.row] if plan.req_ids else "?",
                    safe_err,
                )
                out = [_in_place(in_place, w.row)] if w.compact else []
        done.append(w)
        kept += out
    return done, kept


def _in_place(in_place: Callable[[int], torch.Tensor], row: int) -> torch.Tensor:
    """The kept positions of a row left in place (only logged and dumped: empty if even they
    cannot be read)."""
    try:
        return in_place(row)
    except Exception:  # noqa: BLE001
        return torch.empty(0, 0, dtype=torch.long)
