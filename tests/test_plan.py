# SPDX-License-Identifier: Apache-2.0
"""Step planning on the worker (backends/plan.py): each row's window from its request's own
settings (resolved once, kept while the runner holds the request); a dummy batch evicts nothing; a batch without the
hook's context is refused, never planned with guessed configurations."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch

from vllm_kvevict.backends.plan import MissingStepContext, plan_step
from vllm_kvevict.config import parse_config
from vllm_kvevict.vllm_compat.runner import RunnerStep

BS = 32
SERVER = parse_config({"policy": "keydiff", "budget": 64})


def _cm(seq_lens: list[int], query_lens: list[int]):
    """The fields of vLLM's CommonAttentionMetadata that plan_step reads."""
    n, T = len(seq_lens), sum(query_lens)
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    return SimpleNamespace(
        num_reqs=n,
        num_actual_tokens=T,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc_cpu=qsl,
        block_table_tensor=torch.zeros(n, 16, dtype=torch.int32),
        slot_mapping=torch.arange(T),
        positions=torch.arange(T),
    )


def _step(req_ids, prompt_lens, extra_args, dummy=False) -> RunnerStep:
    return RunnerStep(
        req_ids=req_ids,
        prompt_lens=prompt_lens,
        num_tokens=prompt_lens,
        extra_args=extra_args,
        live=frozenset(req_ids),
        dummy=dummy,
    )


def test_each_row_plans_with_its_own_configuration():
    # Two rows end a 64-token chunk at L = 256, a compaction point of both (strides 64 and 128);
    # the second request asks for budget 128.
    cm = _cm([256, 256], [64, 64])
    step = _step(["a", "b"], [512, 512], [None, {"kvevict_budget": 128}])
    plan = plan_step(cm, SERVER, BS, step)
    assert plan.L_prev == [192, 192] and plan.seq_lens == [256, 256]
    assert plan.e_prev == [128, 0] and plan.e_new == [256 - 64, 256 - 128] == [192, 128]
    assert [st.settings.budget for st in plan.states] == [64, 128]
    assert plan.req_ids == ["a", "b"] and plan.compact_rows == [0, 1]
    # A row whose request turns eviction off keeps everything.
    off = plan_step(cm, SERVER, BS, _step(["c", "d"], [512, 512], [{"kvevict_enabled": False}, None]))
    assert off.e_new[0] == 0 and off.e_new[1] == 192


def test_once_policy_uses_the_prompt_length():
    cm = _cm([256], [128])
    once = {"kvevict_policy": "criticalkv", "kvevict_budget": 64}
    mid = plan_step(cm, SERVER, BS, _step(["a"], [512], [once]))
    assert mid.e_new == [0]  # the prompt is not complete yet
    done = plan_step(_cm([512], [256]), SERVER, BS, _step(["a"], [512], [once]))
    assert done.e_new == [BS * ((512 - 64) // BS)]


def test_dummy_batch_evicts_nothing():
    cm = _cm([4096, 4096], [1024, 1024])
    plan = plan_step(cm, SERVER, BS, _step([], [], [], dummy=True))
    assert plan.e_prev == plan.e_new == [0, 0] and plan.compact_rows == []
    assert plan.states == []


@pytest.mark.parametrize("step", [None, _step(["a"], [512], [None])])
def test_without_the_runner_context_the_step_is_refused(step):
    """No request ids for some rows: their windows would be guessed from the server's
    configuration, which is wrong for any request with its own. Refused instead."""
    with pytest.raises(MissingStepContext, match="step hook"):
        plan_step(_cm([256, 256], [128, 128]), SERVER, BS, step)


def test_rows_configuration_matches_the_engine_core():
    """The worker resolves a request's settings with the same function as the engine core's manager
    (request.resolve): both sides agree on E. Resolved once: a later step reads the worker's
    registry, not the request's keys."""
    from vllm_kvevict.request import resolve

    xargs = {"kvevict_policy": "snapkv", "kvevict_budget": 96, "kvevict_params": json.dumps({"window": 8})}
    plan = plan_step(_cm([300], [44]), SERVER, BS, _step(["a"], [300], [xargs]))
    assert plan.states[0].settings == resolve(SERVER, xargs, BS)
    assert plan.states[0].settings.window.budget == 96 and plan.states[0].settings.params.window == 8
    again = plan_step(_cm([301], [1]), SERVER, BS, _step(["a"], [300], [{"kvevict_budget": "not parsed again"}]))
    assert again.states[0] is plan.states[0]


def test_requests_the_runner_no_longer_holds_are_gone():
    from vllm_kvevict.request import WORKER

    plan_step(_cm([100, 100], [100, 100]), SERVER, BS, _step(["a", "b"], [100, 100], [None, None]))
    assert "a" in WORKER and "b" in WORKER
    plan_step(_cm([101], [1]), SERVER, BS, _step(["b"], [100], [None]))  # a finished: the runner dropped it
    assert "a" not in WORKER and "b" in WORKER


@pytest.fixture(autouse=True)
def _no_requests_between_tests():
    from vllm_kvevict.request import WORKER

    WORKER.clear()
    yield
    WORKER.clear()


def test_a_request_on_a_pure_hit_plans_as_without_it():
    """The engine core cuts a pure prefix-cache hit to the E of the request's first compaction
    (budget 64: 64 tokens; the first compaction point is 128), so a request that starts on it (its
    first step begins at L_prev = 64) plans every step as a request that computed those tokens
    itself: the first compaction frees the hit and writes only above it."""
    from vllm_kvevict.window import pure_hit_limit

    assert pure_hit_limit(1000, 1100, SERVER.window(BS)) == 64
    start = RunnerStep(**{**_step(["a"], [1000], [None]).__dict__, "starts": frozenset({"a"})})
    first = plan_step(_cm([128], [64]), SERVER, BS, start)  # starts at 64, computes 64
    assert (first.e_prev, first.e_new) == ([0], [64])
    fresh = plan_step(_cm([128], [128]), SERVER, BS, _step(["b"], [1000], [None]))
    assert fresh.e_new == first.e_new
    later = plan_step(_cm([256], [64]), SERVER, BS, _step(["a"], [1000], [None]))
    assert (later.e_prev, later.e_new) == ([128], [192])


def test_cascade_attention_is_off_once_any_row_has_moved():
    """vLLM's cascade attention reads the prefix every row shares through row 0's logical block
    table; a row attending over a shifted window no longer starts with those blocks."""
    from vllm_kvevict.backends.base import KVEvictBuilderMixin, KVEvictMetadata
    from vllm_kvevict.vllm_compat import runner

    @dataclasses.dataclass
    class BaseMetadata:
        common_prefix_len: int

    @dataclasses.dataclass
    class WithPlan(KVEvictMetadata, BaseMetadata):
        kvevict_plan: object = None

    class Base:
        def build(self, common_prefix_len, cm, fast_build=False, **kwargs):
            return BaseMetadata(common_prefix_len)

    class Builder(KVEvictBuilderMixin, Base):
        kvevict_config, kvevict_block_size, kvevict_metadata = SERVER, BS, WithPlan

        def __init__(self):  # vLLM's builder is not built here
            pass

    @dataclasses.dataclass
    class Metadata:  # the fields of CommonAttentionMetadata the builder reads (it replaces some)
        num_reqs: int
        num_actual_tokens: int
        seq_lens: torch.Tensor
        query_start_loc_cpu: torch.Tensor
        block_table_tensor: torch.Tensor
        slot_mapping: torch.Tensor
        positions: torch.Tensor
        max_seq_len: int = 0

    def built(seq_lens, query_lens):
        runner._tls.step = _step(["a", "b"], [1024, 1024], [None, None])
        try:
            md = Builder().build(64, Metadata(**vars(_cm(seq_lens, query_lens))))
            assert isinstance(md, BaseMetadata) and md.kvevict_plan.req_ids == ["a", "b"]  # the plan rides along
            return md.common_prefix_len
        finally:
            runner._tls.step = None

    assert built([96, 90], [64, 32]) == 64  # no row has evicted yet: the shared prefix stands
    assert built([96, 400], [64, 32]) == 0  # row b attends over [E_prev, L) with E_prev = 288


def test_an_attempt_starts_its_query_window_afresh():
    """A request resumed after preemption on its own prefix-cache hit starts at L_prev > 0; its
    query window must not carry the previous attempt's queries."""
    from vllm_kvevict.backends.flash_layout import FLASH_LAYOUT
    from vllm_kvevict.backends.layer import LayerEviction
    from vllm_kvevict.backends.layout import Heads
    from vllm_kvevict.policies.snapkv import SnapKV, SnapKVParams

    layer = LayerEviction(FLASH_LAYOUT, Heads(2, 1, 0.5), "model.layers.0.self_attn.attn", 0)

    policy = SnapKV(SnapKVParams(window=8))

    def window(L_prev, m, start):
        step = RunnerStep(**{**_step(["a"], [1000], [None]).__dict__, "starts": frozenset({"a"} if start else ())})
        plan = plan_step(_cm([L_prev + m], [m]), SERVER, BS, step)
        query = torch.full((m, 2, 4), float(L_prev))
        return layer.query_windows(plan, [policy], query)[0]

    assert window(0, 5, True).shape[1] == 5
    assert window(5, 5, False).shape[1] == 8  # the attempt's queries accumulate up to the window
    resumed = window(64, 3, True)  # preempted, resumed on a 64-token hit
    assert resumed.shape[1] == 3 and bool((resumed == 64).all())
