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
