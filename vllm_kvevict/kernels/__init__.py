"""Gather, scoring, selection and compaction over vLLM's paged KV cache: torch references
(:mod:`.reference`, also the CPU path), Triton kernels (:mod:`.triton_ops`), chosen per device by
:mod:`.ops`; the engine's step (:mod:`.compact`) and the cache layouts (:mod:`.flash_cache`,
:mod:`.cpu_cache`)."""
