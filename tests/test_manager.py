# SPDX-License-Identifier: Apache-2.0
"""The engine-core side on vLLM's real KVCacheManager (no server): admission reserves each
request's own window, and a request's bookkeeping ends on both of vLLM's free paths (``free`` and
the deferred ``pop_blocks_for_free``)."""

from __future__ import annotations

import logging

import pytest
import torch

pytest.importorskip("vllm")

from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheManager  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402

from vllm_kvevict import kv_manager as mgr  # noqa: E402
from vllm_kvevict.config import parse_config  # noqa: E402
from vllm_kvevict.request import ENGINE  # noqa: E402
from vllm_kvevict.spec import KVEvictSpec  # noqa: E402
from vllm_kvevict.vllm_compat import kv_cache as vllm_kv_cache  # noqa: E402
from vllm_kvevict.window import WindowConfig, evicted_tokens, window_bound_blocks  # noqa: E402

BS, CHUNK, NUM_BLOCKS, BUDGET, MAX_LEN = 32, 64, 41, 96, 8192


@pytest.fixture(scope="module")
def kv():
    mgr.register_spec()
    mgr.install_scheduler_hooks()
    base = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=64, dtype=torch.float32)
    spec = KVEvictSpec.from_spec(base, parse_config({"policy": "keydiff", "budget": BUDGET}), CHUNK)
    config = KVCacheConfig(
        num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)]
    )
    return KVCacheManager(
        config,
        max_model_len=MAX_LEN,
        scheduler_block_size=BS,
        hash_block_size=BS,
        max_in_flight_tokens=CHUNK,
        enable_caching=False,
    )


def _request(rid: str, n: int, xargs: dict | None = None) -> Request:
    params = SamplingParams(max_tokens=16, extra_args=xargs)
    return Request(rid, list(range(3, 3 + n)), params, None)


@pytest.fixture(autouse=True)
def _fresh_registry():
    """Requests these tests free without finishing them keep their settings (as preempted ones do)."""
    yield
    ENGINE.clear()


def _single(kv) -> mgr.KVEvictManager:
    (m,) = kv.coordinator.single_type_managers
    assert isinstance(m, mgr.KVEvictManager)
    return m


def _admission(kv, req: Request) -> int:
    """The blocks vLLM's admission gate asks the manager for (``apply_admission_cap``), with the
    request's settings resolved as the ``allocate_slots`` hook resolves them."""
    _single(kv).state_of(req)
    try:
        return _single(kv).get_num_blocks_to_allocate(
            req.request_id, req.num_tokens, [], 0, 0, req.num_tokens, apply_admission_cap=True
        )
    finally:
        ENGINE.end(req.request_id)


def test_admission_reserves_the_requests_own_window(kv):
    server_bound = window_bound_blocks(WindowConfig(BUDGET, BS), CHUNK)
    assert _admission(kv, _request("a", 2000)) == server_bound
    assert _admission(kv, _request("b", 2000, {"kvevict_budget": 400})) == window_bound_blocks(
        WindowConfig(400, BS), CHUNK
    )
    assert _admission(kv, _request("c", 2000, {"kvevict_enabled": False})) == 2000 // BS + 1  # whole prompt
    assert _admission(kv, _request("d", 2000, {"kvevict_policy": "criticalkv"})) == 2000 // BS + 1  # once
    assert _admission(kv, _request("e", 100)) == 4  # a short prompt needs only itself
    assert _single(kv).max_admission_blocks_per_request == server_bound  # restored after each call


def test_bookkeeping_ends_on_both_free_paths(kv, caplog):
    caplog.set_level(logging.INFO, logger="vllm.kvevict")
    m = _single(kv)
    free_before = kv.block_pool.get_num_free_blocks()
    for rid, deferred in (("f", False), ("g", True)):
        req = _request(rid, 300, {"kvevict_budget": 128})
        assert kv.allocate_slots(req, 300) is not None
        st = ENGINE.get(rid)
        assert st is not None and st.settings.budget == 128 and st.request is req and m.tracked_requests == 1
        # Preempted (vLLM frees its blocks while it is still RUNNING): its attempt ends, its settings stay.
        req.status = RequestStatus.RUNNING
        kv.free(req)
        assert ENGINE.get(rid) is st and st.request is None and m.tracked_requests == 0
        assert kv.allocate_slots(req, 300) is not None and st.request is req and m.tracked_requests == 1
        req.status = RequestStatus.FINISHED_STOPPED  # vLLM sets it before it frees a finished request
        if deferred:
            blocks = kv.pop_blocks_for_free(req)
            kv.block_pool.free_blocks(reversed(blocks))
        else:
            kv.free(req)
        assert rid not in ENGINE and m.tracked_requests == 0
        assert sum(f"request {rid} released" in r.message for r in caplog.records) == 2  # once per attempt
    assert kv.block_pool.get_num_free_blocks() == free_before


def test_evicted_blocks_come_back_on_both_free_paths(kv):
    """Blocks freed by eviction go back to the pool at once; the rest come back when the request is
    freed, on either path. vLLM 0.33's ``pop_blocks_for_free`` drops the leading null blocks that
    eviction leaves (0.32 hands them on and the pool skips them): the pool ends whole either way."""
    m = _single(kv)
    pool = kv.block_pool
    free_before = pool.get_num_free_blocks()
    for rid, deferred in (("h", False), ("i", True)):
        req = _request(rid, 300, {"kvevict_budget": 64})
        assert kv.allocate_slots(req, 300) is not None
        held = -(-300 // BS)
        assert pool.get_num_free_blocks() == free_before - held
        m.remove_skipped_blocks(rid, 300, 1000)  # 300 tokens processed of a 1000-token prompt
        evicted = evicted_tokens(300, 1000, WindowConfig(64, BS)) // BS  # E at the last compaction point
        assert pool.get_num_free_blocks() == free_before - held + evicted
        if deferred:
            blocks = kv.pop_blocks_for_free(req)
            assert len([b for b in blocks if not b.is_null]) == held - evicted
            pool.free_blocks(reversed(blocks))
        else:
            kv.free(req)
        assert pool.get_num_free_blocks() == free_before


def test_spec_keeps_every_field_of_vllms_spec():
    """``KVEvictSpec.from_spec`` copies every init field of vLLM's ``FullAttentionSpec``, whatever
    the release adds (0.33: ``is_draft``), so a spec vLLM rewrites survives the conversion."""
    import dataclasses

    base = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=64, dtype=torch.float32)
    fields = [f.name for f in dataclasses.fields(FullAttentionSpec) if f.init]
    if "is_draft" in fields:  # vLLM 0.33
        base = dataclasses.replace(base, is_draft=True)
    spec = KVEvictSpec.from_spec(base, parse_config({"policy": "keydiff", "budget": BUDGET}), CHUNK)
    assert all(getattr(spec, f) == getattr(base, f) for f in fields)
    assert spec.page_size_bytes == base.page_size_bytes
    merged = KVEvictSpec.merge([spec, spec])
    assert isinstance(merged, KVEvictSpec) and merged.evict_config == spec.evict_config


def test_metrics_follow_the_windows(tmp_path, monkeypatch):
    """On vLLM's real KVCacheManager: the engine core's counters move with each window move, the
    gauges follow the blocks held by requests with a bounded window, and drop to 0 when freed."""
    from vllm_kvevict import metrics

    monkeypatch.setenv(metrics.METRICS_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(metrics, "_recorder", None)
    monkeypatch.setattr(mgr, "_metrics_owner", None)
    base = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=64, dtype=torch.float32)
    spec = KVEvictSpec.from_spec(base, parse_config({"policy": "keydiff", "budget": BUDGET}), CHUNK)
    config = KVCacheConfig(
        num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)]
    )
    kv = KVCacheManager(
        config,
        max_model_len=MAX_LEN,
        scheduler_block_size=BS,
        hash_block_size=BS,
        max_in_flight_tokens=CHUNK,
        enable_caching=False,
    )
    m = _single(kv)
    rec = m._metrics
    assert rec is not None

    def val(kind, name, policy=None):
        if kind == "gauge":
            return rec.values[metrics.LAYOUT.gauges[name]]
        return rec.values[metrics.LAYOUT.counters[name] + metrics.POLICY_LABELS.index(policy)]

    a, b = _request("ga", 300, {"kvevict_policy": "knorm"}), _request("gb", 300, {"kvevict_enabled": False})
    assert kv.allocate_slots(a, 300) is not None and kv.allocate_slots(b, 300) is not None
    bound = window_bound_blocks(WindowConfig(BUDGET, BS), CHUNK)
    assert (val("gauge", "window_blocks_held"), val("gauge", "window_blocks_bound")) == (10, bound)  # b: unbounded
    m.remove_skipped_blocks("ga", 300, 1000)
    evicted = (300 - BUDGET) // BS
    assert val("counter", "blocks_freed", "knorm") == evicted and val("counter", "compactions", "knorm") == 1
    assert val("counter", "tokens_evicted", "knorm") == evicted * BS
    assert val("gauge", "window_blocks_held") == 10 - evicted
    m.remove_skipped_blocks("ga", 300, 1000)  # the window did not move: nothing counted
    assert val("counter", "compactions", "knorm") == 1
    kv.free(a)
    kv.free(b)
    assert (val("gauge", "window_blocks_held"), val("gauge", "window_blocks_bound")) == (0, 0)


def test_a_cut_hit_stays_consistent_across_kv_cache_groups():
    """A hit the plugin cuts (here to its first compaction's E) is looked up again
    through vLLM's coordinator with that maximum length: a sliding-window group gets the blocks of
    its window at the end of the shorter hit, not the null blocks that a truncated list holds."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    mgr.register_spec()
    mgr.install_scheduler_hooks()
    init_none_hash(get_hash_fn_by_name("sha256"))
    hasher = get_request_block_hasher(BS, get_hash_fn_by_name("sha256"))
    budget, window, num_blocks = 1000, 128, 100
    full = KVEvictSpec.from_spec(
        FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=64, dtype=torch.float32),
        parse_config({"policy": "keydiff", "budget": budget}),
        CHUNK,
    )
    swa = SlidingWindowSpec(block_size=BS, num_kv_heads=2, head_size=64, dtype=torch.float32, sliding_window=window)
    config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer.0"], full), KVCacheGroupSpec(["layer.1"], swa)],
    )
    kv = KVCacheManager(
        config,
        max_model_len=MAX_LEN,
        scheduler_block_size=BS,
        hash_block_size=BS,
        max_in_flight_tokens=CHUNK,
        enable_caching=True,
    )
    prompt = list(range(3, 3 + 2000))

    def request(rid, tokens, xargs):
        return Request(rid, tokens, SamplingParams(max_tokens=100, extra_args=xargs), None, block_hasher=hasher)

    a = request("mg-a", prompt, {"kvevict_enabled": False})  # caches as vLLM does, in both groups
    for start in range(0, len(prompt), CHUNK):  # chunked prefill, the sliding window freeing behind it
        assert kv.allocate_slots(a, min(CHUNK, len(prompt) - start)) is not None
        a.num_computed_tokens += min(CHUNK, len(prompt) - start)
    kv.free(a)
    b = request("mg-b", prompt + [7, 8, 9], None)  # hits up to its first compaction's E (1024, at 2048)
    uncut, n_uncut, _ = kv.coordinator.find_longest_cache_hit(b.block_hashes, b.num_tokens - 1)
    blocks, n, _ = kv.get_computed_blocks(b)
    full_m = kv.coordinator.single_type_managers[0]
    allowed = full_m.usable_hit(b, n_uncut)
    assert 0 < n <= allowed < n_uncut and n % BS == 0
    assert ENGINE.get("mg-b").shared == n  # the engine core's hold rule uses the hit the request really got
    full_hit, swa_hit = blocks.blocks
    assert len(full_hit) == len(swa_hit) == n // BS
    in_window = swa_hit[-(window // BS) :]
    assert not any(blk.is_null for blk in in_window), "the sliding-window group's hit must end with real blocks"
    assert uncut[1][n // BS - 1].is_null  # what truncating the uncut lookup would have handed over
    ENGINE.end("mg-b")


def _caching_manager(
    server: dict, in_flight: int = CHUNK, max_chunk: int | None = None, spec_tokens: int = 0
) -> KVCacheManager:
    """vLLM's KVCacheManager with prefix caching, one group of this plugin's spec."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import init_none_hash

    mgr.register_spec()
    mgr.install_scheduler_hooks()
    init_none_hash(get_hash_fn_by_name("sha256"))
    spec = KVEvictSpec.from_spec(
        FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=64, dtype=torch.float32),
        parse_config(server),
        in_flight,
        max_chunk or in_flight,
        spec_tokens=spec_tokens,
    )
    config = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l"], spec)])
    kv = KVCacheManager(
        config,
        max_model_len=MAX_LEN,
        scheduler_block_size=BS,
        hash_block_size=BS,
        max_in_flight_tokens=in_flight,
        enable_caching=True,
    )
    return kv


def _hashed_request(rid: str, tokens: list[int], max_tokens: int = 4) -> Request:
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher

    hasher = get_request_block_hasher(BS, get_hash_fn_by_name("sha256"))
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens), None, block_hasher=hasher)


def _run_step(kv: KVCacheManager, req: Request, n: int) -> None:
    """Schedule ``n`` tokens of ``req`` and let the step run (synchronous scheduling)."""
    assert kv.allocate_slots(req, n) is not None
    req.num_computed_tokens += n


def test_hashing_does_not_wait_for_processed_tokens():
    """Under async scheduling the core may first hear of a request's processed tokens when they have
    passed two compaction points at once (``remove_skipped_blocks`` sees ``E2``, never ``E1``). What
    is hashed as pure is decided when each step is scheduled: ``[0, E1)`` at the first compacting
    step, and nothing at or after ``E1`` ever, however late the processed count catches up. The
    windows compacted at both points are cached once the core knows their steps have run."""
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

    kv = _caching_manager({"policy": "keydiff", "budget": BUDGET}, 2 * 96, 96)
    req = _hashed_request("jump", list(range(3, 403)))
    pure_keys = {make_block_hash_with_group_id(h, 0) for h in req.block_hashes}

    def cached() -> tuple[int, int]:
        """(pure blocks, window blocks) in the prefix cache."""
        hashed = [b.block_hash for b in kv.block_pool.blocks if b.block_hash is not None]
        pure = sum(h in pure_keys for h in hashed)
        return pure, len(hashed) - pure

    # budget 96, stride 96: compaction points 192 (E1 = 96) and 288 (E2 = 192)
    e1 = 96
    for n, pure in ((96, 0), (96, e1 // BS), (96, e1 // BS)):  # scheduled back to back, none processed
        assert kv.allocate_slots(req, n) is not None
        req.num_computed_tokens += n
        req.num_in_flight_tokens += n
        assert cached() == (pure, 0)  # [0, E1) from the moment the first compacting step was scheduled
    req.num_in_flight_tokens = 0  # every output arrives; the next allocation sees L = 288 processed
    assert kv.allocate_slots(req, 32) is not None
    # not [0, E2) as pure: the first compaction rewrote [96, 192); the windows at 192 and 288 (3 blocks each)
    assert cached() == (e1 // BS, 6)
    kv.free(req)
    assert cached() == (e1 // BS, 6)


def test_a_step_taken_back_hashes_nothing_it_would_have_computed():
    """vLLM's priority scheduling may preempt a request it has already scheduled in the step being
    built (the step is taken back: it never runs). When that step would have reached the attempt's
    first compaction point from below ``E1`` (budget 96, stride 192: E1 = 96 at 192; the step
    [64, 192)), the blocks it would have computed below ``E1`` are not hashed: only what earlier
    steps computed."""
    kv = _caching_manager({"policy": "keydiff", "budget": BUDGET, "stride": 192})
    req = _hashed_request("taken-back", list(range(3, 403)))
    kv.get_computed_blocks(req)  # the scheduler's lookup resolves its settings
    _run_step(kv, req, 64)
    assert kv.allocate_slots(req, 128) is not None  # [64, 192): scheduled, sets the fence at 96 ...
    req.status = RequestStatus.RUNNING
    kv.free(req)  # ... and preempted in the same schedule (num_computed_tokens still 64)
    hashed = [b for b in kv.block_pool.blocks if b.block_hash is not None]
    assert len(hashed) == 64 // BS  # [0, 64); [64, 96) was never computed
    ENGINE.end("taken-back")


def test_the_rest_of_the_fence_is_hashed_once_its_step_has_run():
    """The same step run (not taken back): [64, 96) is hashed once the core knows it ran (the
    request's next allocation, with 192 tokens processed), before its blocks go back."""
    kv = _caching_manager({"policy": "keydiff", "budget": BUDGET, "stride": 192})
    req = _hashed_request("fence-rest", list(range(3, 403)))
    kv.get_computed_blocks(req)
    _run_step(kv, req, 64)
    _run_step(kv, req, 128)

    def pure() -> int:
        return sum(b.block_hash is not None for b in kv.block_pool.blocks)

    assert pure() == 64 // BS
    _run_step(kv, req, 32)  # the core sees 192 processed: [0, 96) pure (and the window at 192)
    m = _single(kv)
    assert m._attempts["fence-rest"].pure_pending is None and pure() >= 96 // BS
    req.status = RequestStatus.FINISHED_STOPPED
    kv.free(req)


def test_a_fallback_reported_by_a_worker_caches_nothing_of_the_attempt():
    """A worker's fallback (the step's output names the request) reaches the manager before the
    core caches anything of that step: the window the safe policy compacted is never cached, nor
    any later one, nor its last tail; its pure prefix is (computed before anything was evicted)."""
    kv = _caching_manager({"policy": "keydiff", "budget": BUDGET})
    m = _single(kv)
    req = _hashed_request("fell-back", list(range(3, 403)))
    kv.get_computed_blocks(req)
    _run_step(kv, req, 192)  # compacts at 192 (E1 = 96)
    m.fell_back("fell-back")  # what update_from_output's hook does, for each manager
    ENGINE.get("fell-back").fell_back_from = "a worker"
    _run_step(kv, req, 96)  # the core sees 192 processed; compacts at 288
    _run_step(kv, req, 32)
    req.status = RequestStatus.FINISHED_STOPPED
    kv.free(req)
    pure_keys = {b.block_hash for b in kv.block_pool.blocks if b.block_hash is not None}
    assert len(pure_keys) == 96 // BS  # [0, E1) only: no window, no tail


def test_a_partly_cached_window_is_replaced_whole():
    """A window whose first block left vLLM's LRU while the others stayed cached, computed again by
    another request: cached whole from that computation, never mixed with the other's blocks (two
    computations may keep different tokens: numerics depend on the batch on a GPU)."""
    kv = _caching_manager({"policy": "keydiff", "budget": BUDGET})
    m = _single(kv)
    prompt = list(range(3, 403))
    settings = m.state_of(_hashed_request("probe", prompt)).settings
    ENGINE.end("probe")

    def window_blocks(req) -> list:
        keys = m.window_cache.window_keys(req, settings, 192, 3)
        return [vllm_kv_cache.cached_block(kv.block_pool, k) for k in keys]

    def compute(rid: str) -> list:
        req = _hashed_request(rid, prompt)
        kv.get_computed_blocks(req)
        _run_step(kv, req, 192)
        _run_step(kv, req, 32)  # the core sees 192 processed: the window at 192 is cached
        held = list(m.req_to_blocks[rid][96 // BS : 192 // BS])
        req.status = RequestStatus.FINISHED_STOPPED
        kv.free(req)
        return held

    first = compute("w-first")
    a = _hashed_request("keys", prompt)
    assert [b.block_id for b in window_blocks(a)] == [b.block_id for b in first]
    vllm_kv_cache.uncache_blocks(kv.block_pool, first[:1])  # vLLM's LRU took the first block
    second = compute("w-second")
    got = window_blocks(a)
    assert all(b is not None for b in got)
    assert [b.block_id for b in got] == [b.block_id for b in second]
    assert not {b.block_id for b in got} & {b.block_id for b in first[1:]}
    ENGINE.clear()


def test_steps_vllm_pads_for_drafts_are_run_whole_or_not_at_all():
    """With speculative decoding vLLM pads a waiting request's one-token step with ``k``
    placeholder drafts and asserts that the step runs whole. The plugin cuts a step at its next
    compaction point and never lets one with drafts reach it: a padded step it would cut is not
    scheduled (``pads_step``), and a prefix-cache hit that would leave such a step is shortened
    (``_padded_and_cut``). With ``k = 40`` and a budget of 32 (compaction points every 32 tokens),
    the padded first step of a one-token prompt reaches the point at 32."""
    kv = _caching_manager({"policy": "keydiff", "budget": 32}, spec_tokens=40)
    m = _single(kv)
    one = _hashed_request("one-token", [7])
    m.state_of(one)
    assert m.pads_step(one, 0, 41) and not m.pads_step(one, 0, 1)
    assert m.step_tokens(one, 0, 41) == 32 and m._padded_and_cut(one, 0)
    long = _hashed_request("long", list(range(3, 403)))
    m.state_of(long)
    assert not m.pads_step(long, 0, 41) and not m._padded_and_cut(long, 64)  # 336 tokens left to compute
    # a step with drafts (past the 400 known tokens) that would end at the point at 416 ends short of it
    assert m.step_tokens(long, 399, 17) == 16 and m.step_tokens(long, 415, 1) == 1
    ENGINE.clear()


def test_layers_with_and_without_the_plugins_spec_are_not_one_kind():
    """vLLM decides whether a model's layers share one KV cache spec by merging them and catching
    an AssertionError; a full-attention layer some other backend built (a drafter's, say) beside the
    plugin's is another kind of layer, not a crash of the engine core."""
    try:  # vLLM 0.33
        from vllm.v1.core.kv_cache_planning import is_kv_cache_spec_uniform
    except ImportError:  # vLLM 0.32
        from vllm.v1.core.kv_cache_utils import is_kv_cache_spec_uniform

    base = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=64, dtype=torch.float32)
    ours = KVEvictSpec.from_spec(base, parse_config({"policy": "keydiff", "budget": BUDGET}), CHUNK)
    assert is_kv_cache_spec_uniform({"a": ours, "b": ours})
    assert not is_kv_cache_spec_uniform({"a": ours, "b": base})
