# SPDX-License-Identifier: Apache-2.0
"""``KVEvictSpec``: a full-attention layer whose per-request KV the window bounds.

Made in the workers (the backend's ``customize_spec`` turns each plain ``FullAttentionSpec`` into
one), pickled to the engine core, where vLLM's registry maps it to
:class:`~vllm_kvevict.kv_manager.KVEvictManager`. It carries the server's configuration and what
the window bound depends on (vLLM's in-flight tokens, step size, hash algorithm and drafts), and
is the single source of the per-request admission cap and the start-up memory check.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from typing import Self

from vllm_kvevict.config import KVEvictConfig
from vllm_kvevict.vllm_compat.kv_cache import FullAttentionSpec
from vllm_kvevict.window import WindowConfig, window_bound_blocks


@dataclass(frozen=True, kw_only=True)
class KVEvictSpec(FullAttentionSpec):
    """A full-attention layer whose per-request KV is bounded by the kvevict window."""

    evict_config: KVEvictConfig  # the server's kvevict configuration (frozen: hashable, pickled to the engine core)
    evict_max_in_flight: int = 0  # tokens scheduled but not yet processed (vLLM's max_in_flight_tokens)
    evict_max_chunk: int = 0  # tokens one step schedules at most (vLLM's max_num_batched_tokens)
    evict_hash_algo: str = "sha256"  # vLLM's prefix_caching_hash_algo (the keys of cached windows)
    evict_spec_tokens: int = 0  # speculative decoding: draft tokens per step (vLLM's num_speculative_tokens)
    evict_layers: int = 1  # layers of the worker that evict (sizes its recall tiers in the engine core)

    @property
    def config(self) -> KVEvictConfig:
        return self.evict_config

    @property
    def window(self) -> WindowConfig:
        """The server's window; a request's own is ``request_config(...).window(block_size)``."""
        return self.config.window(self.block_size)

    @classmethod
    def from_spec(
        cls,
        spec: FullAttentionSpec,
        config: KVEvictConfig,
        max_in_flight: int,
        max_chunk: int = 0,
        hash_algo: str = "sha256",
        spec_tokens: int = 0,
        layers: int = 1,
    ) -> Self:
        base = {f.name: getattr(spec, f.name) for f in fields(FullAttentionSpec) if f.init}
        return cls(
            **base,
            evict_config=config,
            evict_max_in_flight=max_in_flight,
            evict_max_chunk=max_chunk,
            evict_hash_algo=hash_algo,
            evict_spec_tokens=spec_tokens,
            evict_layers=layers,
        )

    def with_layers(self, layers: int) -> Self:
        """This spec, saying that ``layers`` layers of the worker evict."""
        return dataclasses.replace(self, evict_layers=layers)

    def tier_token_bytes(self, state_bytes: int = 0) -> int:
        """Host bytes one evicted token takes in a worker's recall tiers, every evicting layer: its
        key and value as the cache holds them, its position (int64) and score (float32), and
        ``state_bytes`` of per-slot policy state, per KV head."""
        kv = self.page_size_bytes // self.block_size
        return self.evict_layers * (kv + self.num_kv_heads * (8 + 4 + state_bytes))

    @property
    def in_flight(self) -> tuple[int, int]:
        """``(max_in_flight, max_chunk)``: what the window bound adds for steps not yet processed."""
        return self.evict_max_in_flight, self.evict_max_chunk

    def max_admission_blocks_per_request(self, max_model_len: int | None = None) -> int | None:
        """Most blocks one request ever holds: the window bound in ``chunked`` mode, else ``None``.

        The single source for the start-up memory check and the scheduler's admission gate, as for
        vLLM's sliding-window specs: a prompt longer than the whole KV cache is admitted, because its
        blocks are recycled as the window moves.
        """
        window = self.window
        if window.trigger != "chunked" or not window.enabled:  # unbounded before/without eviction
            return None
        bound = window_bound_blocks(window, *self.in_flight)
        return bound if max_model_len is None else min(bound, -(-max_model_len // self.block_size))

    def max_memory_usage_bytes(self, vllm_config) -> int:
        cap = self.max_admission_blocks_per_request(vllm_config.model_config.max_model_len)
        if cap is None:
            return super().max_memory_usage_bytes(vllm_config)
        return cap * self.page_size_bytes

    @classmethod
    def merge(cls, specs: list[Self]) -> Self:
        # vLLM tells uniform layers from others by an AssertionError here: a layer without the
        # plugin's spec (another backend's full attention) is another kind, never an error
        assert all(isinstance(s, KVEvictSpec) for s in specs), "full attention with and without kvevict"
        # vLLM's merge on the base class: it checks the common fields
        merged = FullAttentionSpec.merge.__func__(FullAttentionSpec, specs)  # type: ignore[attr-defined]
        first = specs[0]
        extra = (
            "evict_config",
            "evict_max_in_flight",
            "evict_max_chunk",
            "evict_hash_algo",
            "evict_spec_tokens",
            "evict_layers",
        )
        for s in specs:
            assert all(getattr(s, k) == getattr(first, k) for k in extra), "kvevict layers disagree on the window"
        return cls.from_spec(
            merged,
            first.config,
            first.evict_max_in_flight,
            first.evict_max_chunk,
            first.evict_hash_algo,
            first.evict_spec_tokens,
            first.evict_layers,
        )
