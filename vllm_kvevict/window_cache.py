# SPDX-License-Identifier: Apache-2.0
"""The compressed-window cache of one evicting KV cache group, in vLLM's prefix cache.

A request's window after a compaction point ``b`` (its blocks ``[E(b), b)``) is cached under keys
chained on the hash of its token prefix up to ``b`` and its eviction configuration (the window
salt: policy, budget, stride and what else changes what is kept; LoRA and ``cache_salt`` are in
vLLM's prefix hashes already); the blocks it computes after ``b`` (its tail) under keys chained on
the pure hash of their own prefix, with ``b``. A later request with that prefix and configuration
starts on them (:meth:`WindowCache.find`). What is cached and when (once the step that made it has
run, and never for a request that fell back) is the manager's to decide
(:class:`~vllm_kvevict.kv_manager.KVEvictManager`); this object knows the keys, enters blocks under
them and looks them up. docs/architecture.md, "Compressed windows".
"""

from __future__ import annotations

from collections.abc import Callable

from vllm_kvevict.request import RequestSettings
from vllm_kvevict.vllm_compat import kv_cache as vllm_kv_cache
from vllm_kvevict.window import evicted_tokens, first_boundary, last_boundary


class WindowCache:
    """Keys, entries and lookups of compacted windows and their tails in one KV cache group
    (``group_id``) of vLLM's block pool; ``hash_algo`` is vLLM's prefix-caching hash."""

    def __init__(self, block_pool, block_size: int, group_id: int, hash_algo: str) -> None:
        self.pool = block_pool
        self.block_size = block_size
        self.group_id = group_id
        self.hash_algo = hash_algo

    # -- keys ---------------------------------------------------------------------------------
    def window_keys(self, request, settings: RequestSettings, b: int, n: int):
        """The keys of the ``n`` blocks of the request's window at ``b``, in order (lazily)."""
        prefix = request.block_hashes[b // self.pool.hash_block_size - 1]
        return vllm_kv_cache.window_block_keys(self.hash_algo, prefix, settings.window_salt, n, self.group_id)

    def tier_key(self, request, settings: RequestSettings, b: int):
        """The key of the recall tier of the request's window at ``b`` (its first block's key)."""
        return next(iter(self.window_keys(request, settings, b, 1)))

    def tail_key(self, request, settings: RequestSettings, b: int, i: int):
        """The key of the request's block starting at token ``i``, in the tail of its window at ``b``."""
        block_hash = request.block_hashes[(i + self.block_size) // self.pool.hash_block_size - 1]
        return vllm_kv_cache.tail_block_key(self.hash_algo, block_hash, b, settings.window_salt, self.group_id)

    def save_key(self, request, settings: RequestSettings, b: int, i: int):
        """The key of the request's block at token ``i``, after its compaction point ``b``: a tail
        of the window at ``b``, or a pure block before the first compaction (None while the core
        does not know its tokens)."""
        bs, hbs = self.block_size, self.pool.hash_block_size
        if len(request.block_hashes) * hbs < i + bs:
            return None
        if evicted_tokens(b, request.num_prompt_tokens, settings.window) == 0:
            return vllm_kv_cache.pure_block_key(request.block_hashes[(i + bs) // hbs - 1], self.group_id)
        return self.tail_key(request, settings, b, i)

    # -- entries ------------------------------------------------------------------------------
    def cache_window(self, request, settings: RequestSettings, b: int, blocks: list) -> bool:
        """Cache the window the request (holding ``blocks``) compacted at ``b``, whole: the same
        window cached already stays; part of another computation of it (the rest gone with vLLM's
        LRU) is replaced, never mixed with this one's blocks (two computations may keep different
        tokens: numerics that depend on the batch). Whether these blocks are now the window's."""
        bs = self.block_size
        if len(request.block_hashes) < b // self.pool.hash_block_size:
            return False  # the tokens before b are not all known here yet
        e = evicted_tokens(b, request.num_prompt_tokens, settings.window)
        window = blocks[e // bs : b // bs]
        if len(window) * bs != b - e or any(blk.is_null or blk.block_hash is not None for blk in window):
            return False  # pragma: no cover - a window's blocks are the request's own, never hashed
        keys = list(self.window_keys(request, settings, b, len(window)))
        cached = [c for c in (vllm_kv_cache.cached_block(self.pool, key) for key in keys) if c is not None]
        if len(cached) == len(keys):
            return False  # the same window is cached already (another request with this prefix)
        vllm_kv_cache.uncache_blocks(self.pool, cached)
        for key, blk in zip(keys, window):
            vllm_kv_cache.cache_block(self.pool, key, blk)
        return True

    def cache_tail_blocks(self, request, settings: RequestSettings, b: int, lo: int, hi: int, blocks: list) -> None:
        """Cache the request's blocks in ``[lo, hi)`` (whole blocks) as the tail of its window at
        ``b``; blocks it holds as a hit are cached already."""
        for i in range(lo, hi, self.block_size):
            blk = blocks[i // self.block_size]
            if not blk.is_null and blk.block_hash is None:
                vllm_kv_cache.cache_block(self.pool, self.tail_key(request, settings, b, i), blk)

    def cache_tails(self, request, settings: RequestSettings, done: int, processed: int, blocks: list) -> int:
        """Cache the request's blocks computed after a compaction point ``b``, from token ``done``
        on, below its tail end (``RequestSettings.tail_end``: no later compaction rewrites them)
        and its ``processed`` tokens; returns the token up to which tails are now done."""
        window, bs = settings.window, self.block_size
        known = min(processed, len(request.block_hashes) * self.pool.hash_block_size, len(blocks) * bs)
        prompt = request.num_prompt_tokens
        i = max(done, first_boundary(window))
        while i + bs <= known:
            b = last_boundary(i if window.decode else min(i, prompt), window)
            end = settings.tail_end(b)
            if i + bs > end:  # rewritten by the next compaction: on to its point
                i = max(i + bs, b + window.step)
                continue
            j = min(end, known // bs * bs)
            self.cache_tail_blocks(request, settings, b, i, j, blocks)
            i = j
        return max(done, i)

    def cache_last_tail(self, request, settings: RequestSettings, processed: int, blocks: list) -> None:
        """A freed request's blocks after its last scheduled compaction point ``b`` whose step has
        run, as the tail of the window at ``b``: no compaction will rewrite them. The next turn of
        a chat, whose prompt repeats this one's prompt and answer, starts past the window on them."""
        window, bs = settings.window, self.block_size
        prompt, L = request.num_prompt_tokens, request.num_computed_tokens
        b = last_boundary(L if window.decode else min(L, prompt), window)
        if evicted_tokens(b, prompt, window) == 0 or processed < b:
            return  # it never compacted (its blocks are pure), or the step reaching b has not run
        known = min(processed, len(request.block_hashes) * self.pool.hash_block_size, len(blocks) * bs)
        self.cache_tail_blocks(request, settings, b, b, known // bs * bs, blocks)

    # -- lookup -------------------------------------------------------------------------------
    def find(
        self,
        request,
        settings: RequestSettings,
        num_tokens: int,
        tail_end: Callable[[int, int], int] | None,
        usable: Callable[[int], bool],
    ) -> tuple[list, int] | None:
        """The window at the request's last compaction point ``b`` beyond ``num_tokens`` (its pure
        hit) and below its known tokens whose every block is cached, with the blocks of its tail
        cached up to ``tail_end(b, top)`` (None: no tails), cut back to a ``t`` where ``usable(t)``:
        ``(blocks, t)``, the blocks null for ``[0, E(b))``, then the window's and the tail's."""
        window, bs, hbs = settings.window, self.block_size, self.pool.hash_block_size
        prompt = request.num_prompt_tokens
        top = min(request.num_tokens - 1, len(request.block_hashes) * hbs)
        if not window.decode:
            top = min(top, prompt)  # no compaction point after the prompt
        b = last_boundary(top, window)
        while b > num_tokens and b >= first_boundary(window):
            e = evicted_tokens(b, prompt, window)
            blocks = []
            for key in self.window_keys(request, settings, b, (b - e) // bs):
                blk = vllm_kv_cache.cached_block(self.pool, key)
                if blk is None:
                    break  # this window is not (wholly) cached: try the point before
                blocks.append(blk)
            else:
                t = b
                end = tail_end(b, top) if tail_end is not None else b
                while t + bs <= end:
                    blk = vllm_kv_cache.cached_block(self.pool, self.tail_key(request, settings, b, t))
                    if blk is None:
                        break
                    blocks.append(blk)
                    t += bs
                while not usable(t):  # cut back a block at a time, the window itself last
                    if t == b:
                        break
                    blocks.pop()
                    t -= bs
                else:
                    return [self.pool.null_block] * (e // bs) + blocks, t
            b -= window.step
        return None
