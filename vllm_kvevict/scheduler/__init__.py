"""Scheduler side (engine-core process): the KV cache spec and manager that free evicted blocks."""

from vllm_kvevict.scheduler.manager import KVEvictManager, KVEvictSpec, install_scheduler_hooks, register_spec

__all__ = ["KVEvictManager", "KVEvictSpec", "install_scheduler_hooks", "register_spec"]
