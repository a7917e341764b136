# SPDX-License-Identifier: Apache-2.0
"""Test hooks, installed in every process by ``register()`` only when a test asks for them through
the environment (the engine tests start real servers, so this is how they reach the engine core and
the workers). Nothing here is called from the forward path otherwise.

* ``KVEVICT_TEST_FAULT=<policy>[,<policy>@prepare...]``: those policies' classes are replaced, in
  this process's ``POLICIES``, by subclasses whose scoring (``<policy>``) or whose row preparation
  by the backend (``<policy>@prepare``: where it reads the queries and ``W_O``, before the step)
  raises, so a test can fault one request among many (backends/fault.py isolates it);
  ``<policy>#<n>``: only the first ``n`` scoring calls (``score``, ``score_ragged``, ``observe``,
  ``merge``) in this process raise, then the policy works again (a fault in one compaction and not
  the next: the batched step and its row-by-row retry are two calls); ``<policy>#<n>/rank<r>``:
  only on tensor-parallel rank ``r``;
  ``@alloc:<site>[#n]``: the eviction step's allocation at ``site`` (``positions``, ``state``,
  ``snapshot``, ``overlay``: ``backends/slots.per_slot`` and ``rows_of``) fails as an out-of-memory
  would (always, or its first ``n`` times). Three more
  names fault what the fault path itself runs on, in this process: ``@safe`` (the safe policy a
  failing request falls back to), ``@recall`` (recall's scoring at the prompt's end) and ``@tier``
  (adding evicted tokens to a recall tier).
* ``KVEVICT_TEST_HOLD=<dir>``: a plan listener (:func:`hold_if_asked`) stops a step before its
  forward at a point of the test's choosing.
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

from vllm_kvevict import envs
from vllm_kvevict._logging import logger
from vllm_kvevict.policies import POLICIES, Needs, Policy
from vllm_kvevict.vllm_compat import distributed as vllm_distributed

TEST_FAULT_ENV = "KVEVICT_TEST_FAULT"
#: the longest a held step waits for its test (then it goes on, with a warning)
HOLD_DEADLINE_S = 600.0


def install() -> None:
    """What the environment asks for (idempotent)."""
    faults = envs.KVEVICT_TEST_FAULT
    for name, cls in list(POLICIES.items()):
        faulty = faulty_class(cls, faults)
        if faulty is not cls:
            POLICIES[name] = faulty
    if faults & {"@safe", "@recall", "@tier"}:
        from vllm_kvevict.backends import fault, recall

        def fail(what: str):
            def raise_(*_args, **_kwargs):
                raise InjectedFault(f"fault injected into {what} by {TEST_FAULT_ENV}")

            return raise_

        if "@safe" in faults and not getattr(fault.SAFE_POLICY, "kvevict_faulty", False):
            safe = fault.SAFE_POLICY
            fault.SAFE_POLICY = faulty_class(type(safe), frozenset({safe.name}))(safe.params)
        if "@recall" in faults:
            recall.recall_scores = fail("recall")
        if "@tier" in faults:
            recall.Tier.add = fail("the recall tier")  # type: ignore[method-assign]
    allocs = _counted({n.removeprefix("@alloc:") for n in faults if n.startswith("@alloc:")})
    if allocs:
        from vllm_kvevict.backends import slots

        if not getattr(slots.per_slot, "kvevict_faulty", False):
            slots.per_slot = _failing_allocation(slots.per_slot, allocs)
            slots.rows_of = _failing_allocation(slots.rows_of, allocs)
    if envs.KVEVICT_TEST_HOLD is not None:
        from vllm_kvevict.backends.plan import add_plan_listener

        add_plan_listener(hold_if_asked)


class InjectedFault(RuntimeError):
    pass


def _spec(name: str) -> tuple[str, int, int | None]:
    """``"h2o#2/rank1"`` as ``("h2o", 2, 1)``: what fails, how many times (-1: always), on which
    tensor-parallel rank (None: every rank)."""
    name, _, rank = name.partition("/rank")
    name, _, count = name.partition("#")
    return name, int(count) if count else -1, int(rank) if rank else None


def _counted(names: set[str]) -> dict[str, int]:
    """``{"name", "other#2"}`` as ``{name: calls left to fail}`` (-1: every call)."""
    return {name: count for name, count, _rank in map(_spec, names)}


def _failing_allocation(fn, left: dict[str, int]):
    """``fn(site, ...)`` (one of the eviction step's allocations, ``backends/slots.py``) failing as
    an out-of-memory would, at the sites in ``left`` (the first ``n`` times, or always)."""

    def allocate(site: str, *args, **kwargs):
        n = left.get(site, 0)
        if n == 0:
            return fn(site, *args, **kwargs)
        left[site] = max(-1, n - 1)
        raise InjectedFault(f"out of memory: allocation at {site!r} failed (injected by {TEST_FAULT_ENV})")

    allocate.kvevict_faulty = True  # type: ignore[attr-defined]
    return allocate


class _FailingNeeds(Needs):
    """A policy's needs whose query window raises: the backend reads it first when it prepares
    the policy's rows (``name@prepare``)."""

    _kvevict_name: str  # set past the frozen dataclass's guard, not a field

    def __init__(self, name: str, needs: Needs) -> None:
        super().__init__(**{f.name: getattr(needs, f.name) for f in dataclasses.fields(needs)})
        object.__setattr__(self, "_kvevict_name", name)

    @property
    def query_window(self) -> int:
        raise InjectedFault(f"fault injected into the preparation of {self._kvevict_name} by {TEST_FAULT_ENV}")


def faulty_class(cls: type[Policy], names: frozenset[str]) -> type[Policy]:
    """``cls``, or a subclass that raises: ``name`` in ``names`` makes its scoring raise (inside the
    eviction step), ``name#n`` its first ``n`` scoring calls (``name#n/rank<r>``: on that
    tensor-parallel rank only), ``name@prepare`` the backend's preparation of its rows."""
    if getattr(cls, "kvevict_faulty", False):
        return cls
    specs = [_spec(n) for n in names]
    mine = [(count, rank) for name, count, rank in specs if name == cls.name]
    if mine:
        count, rank = mine[0]
        left = [count]

        def failing(method: str):
            def fail(self, *args, **kwargs):
                if left[0] == 0 or (rank is not None and vllm_distributed.tensor_parallel()[0] != rank):
                    return getattr(cls, method)(self, *args, **kwargs)
                left[0] = max(-1, left[0] - 1)
                raise InjectedFault(f"fault injected into {cls.name} by {TEST_FAULT_ENV}")

            return fail

        methods = {
            "score": failing("score"),
            "observe": failing("observe"),
            **{
                m: failing(m)
                for m in ("score_ragged", "score_paged", "score_columns", "observe_columns", "merge", "merge_columns")
                if getattr(cls, m) is not getattr(Policy, m)
            },
        }
    elif f"{cls.name}@prepare" in names:

        def init(self, params=None):
            cls.__init__(self, params)
            self.needs = _FailingNeeds(cls.name, self.needs)

        methods = {"__init__": init}
    else:
        return cls
    return type(f"Faulty{cls.__name__}", (cls,), {**methods, "kvevict_faulty": True})


def hold_if_asked(plan) -> None:
    """Under ``KVEVICT_TEST_HOLD=<dir>``: while the file ``<dir>/hold`` exists, a step that runs on
    a window eviction has already moved (some row's ``e_prev > 0``) waits in the worker, before its
    forward, having created ``<dir>/held``; while ``<dir>/hold-compacting`` exists, so does a step
    in which some row compacts (``e_new > e_prev``). The request is then provably in the middle of
    its prompt or its decoding (or in the step of a compaction), its earlier compactions done,
    whatever the machine's speed: a test can disconnect its client and remove the file; the engine
    core takes the abort before the next step."""
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
