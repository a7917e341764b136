# SPDX-License-Identifier: Apache-2.0
"""Recall tiers of cached windows: the engine core's model (vllm_kvevict/tier_cache.py) against the
workers' store (vllm_kvevict/backends/tier_store.py) on the same messages, and a tier's snapshots."""

from __future__ import annotations

import random

import torch

from vllm_kvevict.backends.tier_store import LayerSnapshot, Tier, TierEntry, TierStore
from vllm_kvevict.tier_cache import Drop, End, Forget, Keep, Start, TierCache

H, D = 2, 4
#: host bytes of one evicted token per KV head in these entries: K and V (float32), position, score
TOKEN_BYTES = H * (2 * D * 4 + 8 + 4)


def _entry(first: int, n: int) -> TierEntry:
    pos = torch.arange(first, first + n)[:, None].expand(n, H).contiguous()
    K = torch.randn(n, H, D)
    return TierEntry(K, -K, pos, torch.rand(n, H))


def test_a_snapshot_shares_the_entries_and_a_tier_started_on_it_extends_them():
    tier = Tier()
    tier.add(_entry(0, 3), cap=100)
    snap = tier.snapshot()
    tier.add(_entry(3, 2), cap=100)
    assert len(snap) == 1 and tier.chunks[0] is snap[0]  # nothing copied, nothing merged
    other = Tier.of(snap, cap=100)
    other.add(_entry(10, 1), cap=100)
    assert other.chunks[0] is snap[0] and tier.tokens == 5 and other.tokens == 4
    assert sum(p.tokens for p in tier.parts()) == 5 and tier.chunks[0] is snap[0]  # reading copies nothing
    assert sorted(torch.cat([p.pos for p in other.take()])[:, 0].tolist()) == [0, 1, 2, 10]
    assert snap[0].tokens == 3  # the snapshot is untouched by either tier


def test_a_tier_over_its_cap_is_merged_and_its_snapshots_keep_theirs():
    tier = Tier()
    tier.add(_entry(0, 3), cap=4)
    snap = tier.snapshot()
    tier.add(_entry(3, 3), cap=4)
    assert tier.tokens == 4 and len(tier.chunks) == 1 and tier.chunks[0] is not snap[0]
    assert snap[0].tokens == 3


def test_the_store_follows_the_messages_in_order():
    store = TierStore()
    a, b = _entry(0, 2), _entry(2, 2)
    store.take("r0", 96, "L0", (a,))  # not started by the core (its windows are not cached): not kept
    store.apply([Start("r1", None)])
    store.take("r1", 96, "L0", (a,))
    store.take("r1", 192, "L0", (a, b))
    store.take("r1", 288, "L0", (a, b))
    store.apply([Keep("r1", 96, "k96"), Keep("r1", 192, "k192"), Forget("r1", 288), Start("r2", "k192"), End("r1")])
    assert store.started("r2") == {"L0": LayerSnapshot((a, b))} and store.started("r2") is None
    assert len(store) == 2 and store.nbytes == 2 * 2 * TOKEN_BYTES  # a and b, a counted once
    store.apply([Keep("r0", 96, "k0"), Drop("k192")])  # nothing taken for r0: no tier under k0
    assert len(store) == 1 and store.nbytes == 2 * TOKEN_BYTES
    store.apply([Start("r5", "gone")])  # a tier this worker does not hold: the request is told, once
    assert store.started("r5") is None and store.lost("r5") and not store.lost("r5")
    store.apply([Start("r3", "k96")])
    store.take("r3", 192, "L0", (a, b))
    store.retain({"r4"})  # r3 is gone: what it took goes
    store.apply([Keep("r3", 192, "k3")])
    assert len(store) == 1 and store.started("r3") is None


def test_the_cores_model_counts_what_the_workers_hold():
    """Random requests start on kept tiers or from scratch, keep a snapshot at every point and end;
    after every step's messages the core's model of the cached tiers' bytes is at least what the
    workers' store holds, exactly that while no tier was dropped (a tier extending a dropped one
    is counted whole) nor passed its cap (its entries are then its own), and within the budget
    but for the tier just kept."""
    rng = random.Random(0)
    for trial in range(40):
        cache, store = TierCache(budget=rng.choice([10**9, 30 * TOKEN_BYTES])), TierStore()
        cap = rng.choice([10**6, 7])
        live: dict[str, tuple[Tier, int]] = {}  # request -> its tier, the tokens its compactions dropped
        kept: dict[object, int] = {}  # key -> the tokens of its tier before the cap
        dropped_any = False
        for step in range(60):
            rid = f"r{rng.randrange(4)}"
            if rid not in live:
                key = rng.choice([k for k in kept if k in cache] or [None]) if rng.random() < 0.6 else None
                cache.start(rid, key, kept.get(key, 0))
                messages = cache.messages()
                store.apply(messages)
                started = (store.started(rid) or {}).get("L0")
                live[rid] = (Tier.of(started.entries if started else (), cap), kept.get(key, 0))
            tier, dropped = live[rid]
            tier.add(_entry(step * 10, 2), cap)
            live[rid] = (tier, dropped + 2)
            store.take(rid, step, "L0", tier.snapshot())
            key = (trial, step)
            kept[key] = dropped + 2
            cache.keep(rid, step, key, dropped + 2, cap, TOKEN_BYTES, lambda k: True)
            if rng.random() < 0.3:
                cache.end(rid)
                del live[rid]
            messages = cache.messages()
            dropped_any |= any(isinstance(m, Drop) for m in messages)
            store.apply(messages)
            assert cache.nbytes >= store.nbytes, (trial, step)
            if cap > 10**5 and not dropped_any:
                assert cache.nbytes == store.nbytes, (trial, step)
            assert cache.nbytes <= cache.budget or len(cache) <= 1


def test_a_tier_a_request_found_stays_until_the_step_has_its_messages():
    cache = TierCache(budget=3 * TOKEN_BYTES)
    cache.keep("a", 96, "ka", 2, 10**6, TOKEN_BYTES, lambda k: True)
    assert cache.pin("ka") and not cache.pin("nothing")
    cache.keep("b", 96, "kb", 2, 10**6, TOKEN_BYTES, lambda k: True)  # over the budget: kb goes, not ka
    assert "ka" in cache and "kb" not in cache
    assert cache.messages() == [Keep("a", 96, "ka"), Keep("b", 96, "kb"), Drop("kb")]  # no Start: never started
    cache.keep("c", 96, "kc", 2, 10**6, TOKEN_BYTES, lambda k: k != "ka")  # ka's window is gone: ka goes first
    assert "ka" not in cache and "kc" in cache
