# SPDX-License-Identifier: Apache-2.0
"""The compressed-window cache on its own (``window_cache.WindowCache``), on vLLM's real block
pool: a window is found by a request with its prefix and configuration only, whole or not at
all; a window cached in part is replaced whole by the next computation of it; tails extend a hit
up to where the caller lets them, and a hit is cut back to a usable point."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1.core.block_pool import BlockPool  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from vllm_kvevict.config import parse_config  # noqa: E402
from vllm_kvevict.request import resolve  # noqa: E402
from vllm_kvevict.vllm_compat import kv_cache as vllm_kv_cache  # noqa: E402
from vllm_kvevict.window import evicted_tokens  # noqa: E402
from vllm_kvevict.window_cache import WindowCache  # noqa: E402

BS = 32
SERVER = parse_config({"policy": "keydiff", "budget": 96, "stride": 160})  # points 160 (E 64), 320 (E 224)


@pytest.fixture
def cache() -> WindowCache:
    init_none_hash(get_hash_fn_by_name("sha256"))
    return WindowCache(BlockPool(64, True, BS), BS, 0, "sha256")


def _request(rid: str, tokens: list[int]) -> Request:
    hasher = get_request_block_hasher(BS, get_hash_fn_by_name("sha256"))
    return Request(rid, tokens, SamplingParams(max_tokens=4), None, block_hasher=hasher)


def _settings(xargs: dict | None = None):
    return resolve(SERVER, xargs, BS)


DOC = list(range(3, 403))  # 400 tokens
B = 160  # the second compaction point: the window [64, 160)


def _cached_document(cache: WindowCache, settings) -> tuple[list, int]:
    """A request over DOC that cached its window at B: its blocks, and E(B)."""
    blocks = cache.pool.get_new_blocks(len(DOC) // BS)
    cache.cache_window(_request("a", DOC), settings, B, blocks)
    return blocks, evicted_tokens(B, len(DOC), settings.window)


def test_a_window_is_found_by_its_prefix_and_configuration_only(cache):
    settings, b = _settings(), B
    blocks, e = _cached_document(cache, settings)
    mine = _request("b", DOC[:170] + [7] * 60)
    assert cache.find(mine, settings, 0, None, lambda t: True) == (
        [cache.pool.null_block] * (e // BS) + blocks[e // BS : b // BS],
        b,
    )
    assert cache.find(mine, settings, b, None, lambda t: True) is None  # no further than its pure hit
    assert cache.find(mine, _settings({"kvevict_budget": 128}), 0, None, lambda t: True) is None
    assert cache.find(_request("c", DOC[:150] + [7] * 60), settings, 0, None, lambda t: True) is None


def test_a_window_cached_in_part_is_replaced_whole(cache):
    settings, b = _settings(), B
    first, e = _cached_document(cache, settings)
    vllm_kv_cache.uncache_blocks(cache.pool, [first[e // BS + 1]])  # vLLM's LRU took one block
    mine = _request("b", DOC)
    assert cache.find(mine, settings, 0, None, lambda t: True) is None
    second = cache.pool.get_new_blocks(len(DOC) // BS)
    cache.cache_window(mine, settings, b, second)
    blocks, t = cache.find(mine, settings, 0, None, lambda t: True)
    assert t == b and blocks[e // BS :] == second[e // BS : b // BS]
    assert all(blk.block_hash is None for blk in first[e // BS : b // BS])  # none of it left cached


def test_tails_extend_a_hit_as_far_as_the_caller_lets_them(cache):
    settings, b = _settings(), B
    end = settings.tail_end(b)  # the next compaction rewrites from there on
    assert end > b
    blocks = cache.pool.get_new_blocks(len(DOC) // BS)
    first = _request("a", DOC)
    cache.cache_window(first, settings, b, blocks)
    done = cache.cache_tails(first, settings, 0, len(DOC), blocks)
    assert done >= end
    mine = _request("b", DOC)
    _, t = cache.find(mine, settings, 0, lambda b, top: settings.tail_end(b), lambda t: True)
    assert t == end
    _, t = cache.find(mine, settings, 0, lambda b, top: settings.tail_end(b), lambda t: t <= b + BS)
    assert t == b + BS  # cut back to a usable point
    assert cache.find(mine, settings, 0, lambda b, top: settings.tail_end(b), lambda t: False) is None


def test_a_block_before_the_first_compaction_is_saved_as_pure(cache):
    settings = _settings()
    req = _request("a", DOC)
    # the compaction at 160 rewrites [64, 160): pure blocks; the one at 320, [224, 320): tails of 160
    assert cache.save_key(req, settings, 0, 64) == vllm_kv_cache.pure_block_key(req.block_hashes[2], 0)
    assert cache.save_key(req, settings, 160, 224) == cache.tail_key(req, settings, 160, 224)
