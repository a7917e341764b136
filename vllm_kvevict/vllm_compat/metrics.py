# SPDX-License-Identifier: Apache-2.0
"""Where vLLM serves ``/metrics`` from: the registries a custom collector must be in.

Written against vLLM 0.32.0 (``v1/metrics/prometheus.py`` ``get_prometheus_registry``,
``entrypoints/serve/instrumentator/metrics.py``); the same in 0.33.0. With one API server (the
default) vLLM serves prometheus_client's global ``REGISTRY``. With several (``--api-server-count``,
data parallelism; ``PROMETHEUS_MULTIPROC_DIR`` set) every registry it serves from is a new one
holding prometheus_client's ``MultiProcessCollector``: ``get_prometheus_registry`` makes one at
mount time, and the route that serves it (prometheus-fastapi-instrumentator 7's ``expose``) makes
another at every scrape. So the collector goes into ``REGISTRY`` and into every registry a
``MultiProcessCollector`` is made for.

The engine index (vLLM's ``engine`` label: ``parallel_config.data_parallel_index``, set by
``run_engine_core`` before the engine core is made) is read where the engine core makes its
scheduler (``Scheduler.__init__(vllm_config, ...)``, ``v1/core/sched/scheduler.py``; the same in
0.33.0), before the scheduler makes its KV cache manager, whose recorder carries it; a worker
reads it from the configuration vLLM sets current while it initialises (``set_current_vllm_config``
around ``WorkerWrapperBase.initialize_from_config``, which makes the attention metadata builders).
"""

from __future__ import annotations

import weakref

from vllm_kvevict.vllm_compat.patching import wrap_method

_registries: weakref.WeakSet = weakref.WeakSet()  # those holding the collector (a scrape's: short-lived)


def _register(registry, collector) -> None:
    if registry not in _registries:
        registry.register(collector)
        _registries.add(registry)


def install_collector(collector) -> None:
    """Serve ``collector``'s families on vLLM's ``/metrics`` (idempotent)."""
    from prometheus_client import REGISTRY
    from prometheus_client.multiprocess import MultiProcessCollector

    _register(REGISTRY, collector)

    def make(orig):
        def __init__(self, registry, *args, **kwargs):
            orig(self, registry, *args, **kwargs)
            if registry is not None:
                _register(registry, collector)

        return __init__

    wrap_method(MultiProcessCollector, "__init__", make, "kvevict: serve the plugin's metrics beside every process's")


def install_engine_index(set_index) -> None:
    """``set_index(parallel_config.data_parallel_index)`` in the engine core, before its scheduler
    (and so its KV cache managers) is made (idempotent)."""
    from vllm.v1.core.sched.scheduler import Scheduler

    def make(orig):
        def __init__(self, *args, **kwargs):
            vllm_config = kwargs["vllm_config"] if "vllm_config" in kwargs else args[0] if args else None
            set_index(getattr(getattr(vllm_config, "parallel_config", None), "data_parallel_index", None))
            orig(self, *args, **kwargs)

        return __init__

    wrap_method(Scheduler, "__init__", make, "kvevict: the engine index on the plugin's metrics")


def current_engine_index() -> int | None:
    """The engine index of the configuration vLLM has set as current, or None (none set)."""
    try:
        from vllm.config import get_current_vllm_config_or_none
    except ImportError:
        return None
    index = getattr(getattr(get_current_vllm_config_or_none(), "parallel_config", None), "data_parallel_index", None)
    return index if isinstance(index, int) else None
