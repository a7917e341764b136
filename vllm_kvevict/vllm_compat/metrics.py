# SPDX-License-Identifier: Apache-2.0
"""Where vLLM serves ``/metrics`` from: the registry a custom collector must be in.

Written against vLLM 0.32.0 (``v1/metrics/prometheus.py`` ``get_prometheus_registry``,
``entrypoints/serve/instrumentator/metrics.py``, which imports it by name and mounts
``make_asgi_app(registry=get_prometheus_registry())``); the same in 0.33.0. With one API server
(the default) that registry is prometheus_client's global ``REGISTRY``; with several
(``--api-server-count``, data parallelism; ``PROMETHEUS_MULTIPROC_DIR`` set) it is a new registry
made at mount time, so the function is wrapped to add the collector to whichever registry it
returns; and the route that serves it (prometheus-fastapi-instrumentator 7's ``expose``) then
ignores that registry and makes a new one at every scrape, holding prometheus_client's
``MultiProcessCollector``: so every registry such a collector is made for gets the plugin's too.
"""

from __future__ import annotations

import sys
import weakref

from vllm_kvevict.vllm_compat.patching import wrap_method

_registries: weakref.WeakSet = weakref.WeakSet()  # those holding the collector (a scrape's: short-lived)


def _register(registry, collector) -> None:
    if registry not in _registries:
        registry.register(collector)
        _registries.add(registry)


def install_collector(collector) -> None:
    """Serve ``collector``'s families on vLLM's ``/metrics`` (idempotent)."""
    import vllm.v1.metrics.prometheus as prometheus
    from prometheus_client import REGISTRY

    _register(REGISTRY, collector)

    def make(orig):
        def get_prometheus_registry(*args, **kwargs):
            registry = orig(*args, **kwargs)
            _register(registry, collector)
            return registry

        return get_prometheus_registry

    for module in (prometheus, sys.modules.get("vllm.entrypoints.serve.instrumentator.metrics")):
        if module is not None:
            wrap_method(module, "get_prometheus_registry", make, "kvevict: serve the plugin's metrics")

    from prometheus_client.multiprocess import MultiProcessCollector

    def make_multiprocess(orig):
        def __init__(self, registry, *args, **kwargs):
            orig(self, registry, *args, **kwargs)
            if registry is not None:
                _register(registry, collector)

        return __init__

    wrap_method(
        MultiProcessCollector, "__init__", make_multiprocess, "kvevict: the plugin's metrics beside every process's"
    )
