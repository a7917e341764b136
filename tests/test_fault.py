# SPDX-License-Identifier: Apache-2.0
"""Fault isolation in the eviction step (backends/fault.py): a policy that raises for one row
leaves every other row exactly as a step without the fault computes it, and the faulty row is
compacted with the safe policy inside the same window. The engine-level twin (concurrent requests
on a real server, one of them faulty) is in tests/engine/test_hardening.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.test_evict_step import BS, HQ, H, _setup
from vllm_kvevict.backends import fault
from vllm_kvevict.backends import flash_layout as flash_cache
from vllm_kvevict.backends.evict import RowWork, evict_step
from vllm_kvevict.testing import hooks

FAULTY_ROW = 6  # snapkv: scored after the observing rows 1, 3 and 5 (h2o, lshe, h2o)


def _step(cache, slot_pos, state, plan):
    def step(items):
        return evict_step(
            plan,
            items,
            BS,
            gather=lambda b, o: flash_cache.gather_tokens(cache, b, o),
            write=lambda s, K, V: flash_cache.write_tokens(cache, s, K, V),
            slot_pos=slot_pos,
            slot_state=state,
            G=HQ // H,
            views=flash_cache.cache_views(cache),
        )

    return step


def _in_place(plan, slot_pos):
    """The backend's last resort: a row's slots ``[E_new, L)`` as they are."""

    def kept(r: int) -> torch.Tensor:
        i = torch.arange(plan.e_new[r], plan.seq_lens[r], device=plan.block_table.device)
        return slot_pos[plan.block_table[r][i // BS] * BS + i % BS].long()

    return kept


@pytest.fixture(autouse=True)
def _clean():
    fault.FALLBACKS.clear()
    yield
    fault.FALLBACKS.clear()


def test_faulty_row_falls_back_and_others_are_untouched(monkeypatch, caplog):
    # Reference: the same step with the faulty row's policy replaced by the safe one up front.
    cache_r, _, pos_r, state_r, plan_r, work_r = _setup("flash", torch.float32)
    w = work_r[FAULTY_ROW]
    work_r[FAULTY_ROW] = RowWork(w.row, fault.SAFE_POLICY, w.compact, w.inputs)
    kept_r = _step(cache_r, pos_r, state_r, plan_r)(work_r)

    cache, _, slot_pos, state, plan, work = _setup("flash", torch.float32)
    w = work[FAULTY_ROW]
    faulty = hooks.faulty_class(type(w.policy), frozenset({"snapkv"}))(w.policy.params)
    work[FAULTY_ROW] = RowWork(w.row, faulty, w.compact, w.inputs)
    step = _step(cache, slot_pos, state, plan)
    with pytest.raises(RuntimeError, match="fault injected into snapkv"):
        step(work)  # the batched step raises, having written nothing
    done, kept = fault.isolate(plan, work, step, RuntimeError("batched"), _in_place(plan, slot_pos))

    assert [x.policy is fault.SAFE_POLICY for x in done] == [r == FAULTY_ROW for r in range(len(work))]
    assert torch.equal(cache, cache_r) and torch.equal(slot_pos, pos_r)
    for k in state:  # observed state applied exactly once (not once per attempt)
        assert torch.equal(state[k], state_r[k]), k
    assert all(torch.equal(a, b) for a, b in zip(kept, kept_r))
    assert plan.states[FAULTY_ROW].fell_back_from == "snapkv" and fault.FALLBACKS == {"snapkv": 1}
    assert fault.policy_of(plan.states[FAULTY_ROW]) is fault.SAFE_POLICY
    assert [s.fell_back_from for i, s in enumerate(plan.states) if i != FAULTY_ROW] == [None] * (len(work) - 1)
    assert sum("policy snapkv failed" in r.message for r in caplog.records) == 1


def test_fallback_runs_without_what_broke_the_policy():
    """Whatever made a row's policy fail (here queries of the wrong head size among its inputs)
    cannot break the safe policy: it runs on the keys and positions alone, for a compacting row and
    for an observing row that does not compact in this step (where the engine once died: the retry
    raised again, out of the step)."""
    cache_r, _, pos_r, state_r, plan_r, work_r = _setup("flash", torch.float32)
    cache, _, slot_pos, state, plan, work = _setup("flash", torch.float32)
    observing = next(i for i, w in enumerate(work) if w.policy.needs.observes)
    bad = {observing, FAULTY_ROW}
    for i in bad:
        w = work[i]
        broken = dataclasses.replace(w.inputs, Q=w.inputs.Q[..., :-1])
        work[i] = RowWork(w.row, w.policy, i == FAULTY_ROW, broken)
        work_r[i] = RowWork(w.row, fault.SAFE_POLICY, i == FAULTY_ROW)
    kept_r = _step(cache_r, pos_r, state_r, plan_r)(work_r)
    step = _step(cache, slot_pos, state, plan)
    with pytest.raises(RuntimeError):
        step(work)
    done, kept = fault.isolate(plan, work, step, RuntimeError("batched"), _in_place(plan, slot_pos))
    assert [x.policy is fault.SAFE_POLICY for x in done] == [i in bad for i in range(len(work))]
    assert torch.equal(cache, cache_r) and torch.equal(slot_pos, pos_r)
    assert all(torch.equal(a, b) for a, b in zip(kept, kept_r))


def test_fallback_is_sticky_and_forgotten_when_the_request_ends():
    from vllm_kvevict.config import parse_config
    from vllm_kvevict.request import WORKER, resolve

    settings = resolve(parse_config({"policy": "snapkv"}), None, BS)
    st = WORKER.open("req-1", lambda: settings)
    fault.fall_back(st, "req-1", settings.policy, ValueError("x"))
    fault.fall_back(st, "req-1", settings.policy, ValueError("again"))  # counted and logged once
    assert fault.policy_of(st) is fault.SAFE_POLICY and fault.FALLBACKS == {"snapkv": 1}
    st.restart(0)  # preempted and resumed: still the safe policy (the fault was the policy's)
    assert fault.policy_of(st) is fault.SAFE_POLICY
    WORKER.retain(frozenset({"req-2"}))  # the runner no longer holds it
    assert WORKER.open("req-1", lambda: settings).fell_back_from is None
    WORKER.clear()


def test_injection_is_off_by_default(monkeypatch):
    """Without KVEVICT_TEST_FAULT no policy class is replaced (``register()`` does not even import
    the hooks); asked for, only the named ones are, once."""
    from vllm_kvevict.policies import POLICIES

    monkeypatch.delenv(hooks.TEST_FAULT_ENV, raising=False)
    before = dict(POLICIES)
    hooks.install()
    assert POLICIES == before
    monkeypatch.setenv(hooks.TEST_FAULT_ENV, "snapkv,h2o@prepare")
    try:
        hooks.install()
        hooks.install()
        changed = {n for n in POLICIES if POLICIES[n] is not before[n]}
        assert changed == {"snapkv", "h2o"} and POLICIES["snapkv"].__mro__[1] is before["snapkv"]
    finally:
        POLICIES.update(before)


def test_injection_reaches_a_merging_policy(monkeypatch):
    """A merging policy fails where it merges: one request alone (``merge``) and the step's
    requests together (``merge_columns``)."""
    from tests.policy_reference import build
    from vllm_kvevict.policies import POLICIES
    from vllm_kvevict.policies.base import Columns, Packed

    before = dict(POLICIES)
    monkeypatch.setenv(hooks.TEST_FAULT_ENV, "kvmerger")
    try:
        hooks.install()
        pol = POLICIES["kvmerger"]()
        view, _ = build(pol, H=2, G=1, n=20, d=8)
        view.state["h2o"] = torch.rand(2, 20)
        with pytest.raises(hooks.InjectedFault):
            pol.evict(view, 10)
        x = Packed(None, view.pos.T, {"h2o": view.state["h2o"].T}, view.V.transpose(0, 1), K=view.K.transpose(0, 1))
        with pytest.raises(hooks.InjectedFault):
            pol.merge_columns(x, Columns.of_view(view, 0))
    finally:
        POLICIES.update(before)


def test_hold_waits_on_a_moved_window_until_the_file_goes(monkeypatch, tmp_path):
    """KVEVICT_TEST_HOLD (what tests/engine use to disconnect a client mid-prefill): a step whose
    window has moved waits while ``hold`` exists, after creating ``held``; other steps never wait."""
    from concurrent.futures import ThreadPoolExecutor
    from types import SimpleNamespace

    from vllm_kvevict.testing.server import wait_until

    moved, fresh = SimpleNamespace(e_prev=[0, 64], e_new=[0, 64]), SimpleNamespace(e_prev=[0, 0], e_new=[0, 0])
    hooks.hold_if_asked(moved)  # unset: returns at once
    monkeypatch.setenv("KVEVICT_TEST_HOLD", str(tmp_path))
    hooks.hold_if_asked(moved)  # no hold file: returns at once
    (tmp_path / "hold").touch()
    hooks.hold_if_asked(fresh)  # nothing evicted yet: returns at once
    assert not (tmp_path / "held").exists()
    with ThreadPoolExecutor(1) as pool:
        step = pool.submit(hooks.hold_if_asked, moved)
        wait_until((tmp_path / "held").exists, 30, "the step held")
        assert not step.done()
        (tmp_path / "hold").unlink()
        step.result(timeout=30)
    # hold-compacting: a step in which a window moves waits; a step on a moved window that does
    # not compact, and a step in which nothing moves, do not
    (tmp_path / "held").unlink()
    (tmp_path / "hold-compacting").touch()
    hooks.hold_if_asked(SimpleNamespace(e_prev=[0, 64], e_new=[0, 64]))
    hooks.hold_if_asked(SimpleNamespace(e_prev=[0, 0], e_new=[0, 0]))
    assert not (tmp_path / "held").exists()
    with ThreadPoolExecutor(1) as pool:
        step = pool.submit(hooks.hold_if_asked, SimpleNamespace(e_prev=[0, 0], e_new=[0, 384]))
        wait_until((tmp_path / "held").exists, 30, "the compacting step held")
        assert not step.done()
        (tmp_path / "hold-compacting").unlink()
        step.result(timeout=30)


def test_when_the_safe_policy_fails_too_the_window_is_left_in_place(monkeypatch, caplog):
    """The last resort writes nothing: a row whose policy and then the safe policy raise keeps its
    slots ``[E_new, L)`` as they are (the newest tokens of each head: what the safe policy would
    have kept), and every other row is what the step computes without that row."""
    cache_r, _, pos_r, state_r, plan_r, work_r = _setup("flash", torch.float32)
    kept_r = _step(cache_r, pos_r, state_r, plan_r)([w for w in work_r if w.row != FAULTY_ROW])

    cache, _, slot_pos, state, plan, work = _setup("flash", torch.float32)
    before = _in_place(plan, slot_pos)(FAULTY_ROW)
    w = work[FAULTY_ROW]
    work[FAULTY_ROW] = RowWork(
        w.row, hooks.faulty_class(type(w.policy), frozenset({"snapkv"}))(w.policy.params), True, w.inputs
    )
    safe = fault.SAFE_POLICY
    monkeypatch.setattr(fault, "SAFE_POLICY", hooks.faulty_class(type(safe), frozenset({"streamingllm"}))(safe.params))
    step = _step(cache, slot_pos, state, plan)
    with pytest.raises(RuntimeError):
        step(work)
    done, kept = fault.isolate(plan, work, step, RuntimeError("batched"), _in_place(plan, slot_pos))
    assert torch.equal(cache, cache_r) and torch.equal(slot_pos, pos_r)
    for k in state:
        assert torch.equal(state[k], state_r[k]), k
    compacting = [x.row for x in done if x.compact]
    mine = dict(zip(compacting, kept))
    assert torch.equal(mine.pop(FAULTY_ROW), before)
    assert all(torch.equal(a, b) for a, b in zip(mine.values(), kept_r))
    assert sum("policy snapkv failed" in r.message for r in caplog.records) == 1  # one WARNING
    assert sum(r.levelname == "WARNING" for r in caplog.records) == 1


@pytest.mark.parametrize("calls, falls_back", [(1, False), (2, True)])
def test_a_counted_fault_raises_its_first_calls_then_the_policy_works(calls, falls_back):
    """``KVEVICT_TEST_FAULT=snapkv#n``: the first ``n`` scoring calls of the policy raise, then it
    works. The batched step and its row-by-row retry are two calls: with one, the retry succeeds
    and the row keeps its policy (nothing else changes); with two, the row falls back."""
    cache_r, _, pos_r, state_r, plan_r, work_r = _setup("flash", torch.float32)
    if falls_back:
        w = work_r[FAULTY_ROW]
        work_r[FAULTY_ROW] = RowWork(w.row, fault.SAFE_POLICY, w.compact, w.inputs)
    kept_r = _step(cache_r, pos_r, state_r, plan_r)(work_r)

    cache, _, slot_pos, state, plan, work = _setup("flash", torch.float32)
    w = work[FAULTY_ROW]
    faulty = hooks.faulty_class(type(w.policy), frozenset({f"snapkv#{calls}"}))(w.policy.params)
    work[FAULTY_ROW] = RowWork(w.row, faulty, w.compact, w.inputs)
    step = _step(cache, slot_pos, state, plan)
    with pytest.raises(RuntimeError, match="fault injected into snapkv"):
        step(work)
    done, kept = fault.isolate(plan, work, step, RuntimeError("batched"), _in_place(plan, slot_pos))
    assert (done[FAULTY_ROW].policy is fault.SAFE_POLICY) == falls_back
    assert (plan.states[FAULTY_ROW].fell_back_from == "snapkv") == falls_back
    assert torch.equal(cache, cache_r) and all(torch.equal(a, b) for a, b in zip(kept, kept_r))
    assert len(_step(cache, slot_pos, state, plan)(work)) == len(kept)  # the policy works again


def test_a_steps_fallbacks_travel_with_its_output():
    """What the engine core reads (``kv_manager``'s ``on_fallbacks``): the requests that fell back in
    the step, once, on the output vLLM pickles to the engine core (never on its shared empty one)."""
    import pickle

    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput

    from vllm_kvevict.config import parse_config
    from vllm_kvevict.request import WORKER, resolve
    from vllm_kvevict.vllm_compat.runner import attach_fallbacks, output_fallbacks

    fault.step_fallbacks()
    settings = resolve(parse_config({"policy": "snapkv"}), None, BS)
    for rid in ("a", "b"):
        fault.fall_back(WORKER.open(rid, lambda: settings), rid, settings.policy, ValueError("x"))
    fault.fall_back(WORKER.get("a"), "a", settings.policy, ValueError("again"))
    took = fault.step_fallbacks()
    assert took == {"a", "b"} and fault.step_fallbacks() == frozenset()
    out = ModelRunnerOutput(req_ids=["a", "b", "c"], req_id_to_index={"a": 0, "b": 1, "c": 2})
    assert attach_fallbacks(out, took) and attach_fallbacks(out, frozenset({"c"}))
    assert output_fallbacks(pickle.loads(pickle.dumps(out))) == {"a", "b", "c"}
    assert not attach_fallbacks(EMPTY_MODEL_RUNNER_OUTPUT, took) and not output_fallbacks(EMPTY_MODEL_RUNNER_OUTPUT)
    assert output_fallbacks(ModelRunnerOutput(req_ids=[], req_id_to_index={})) == frozenset()
    WORKER.clear()
