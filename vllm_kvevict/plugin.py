# SPDX-License-Identifier: Apache-2.0
"""Registration of the kvevict attention backend in every vLLM process, and the checks the plugin
makes of configurations and requests.

vLLM calls :func:`register` (the ``vllm.general_plugins`` entry point) in the API server, the engine
core and every worker; it is idempotent. Everything it installs goes through the seam
(:mod:`vllm_kvevict.vllm_compat`):

1. the platform's backend class becomes vLLM's CUSTOM backend, also named ``kvevict``
   (``--attention-backend kvevict``); CPU and CUDA backend selectors honour it;
2. :func:`check_config` runs when vLLM finalises its configuration, in every process: a bad
   configuration, or one eviction cannot run beside, stops vLLM with one line before any weight loads;
3. the engine core's KV cache spec and manager, and its per-request hooks;
4. the API server's request check (:func:`check_request`: the keys, then :func:`check_fits_pool`): HTTP 400.
"""

from __future__ import annotations

import functools
import sys

from vllm_kvevict import envs, metrics, vllm_compat
from vllm_kvevict._logging import info_once, logger
from vllm_kvevict.backends import CPU_BACKEND, FLASH_ATTN_BACKEND
from vllm_kvevict.config import (
    KVEvictConfigError,
    RequestConfigError,
    config_from_vllm,
    raw_config,
    request_overrides,
)
from vllm_kvevict.request import RequestSettings, resolve
from vllm_kvevict.vllm_compat import attention as vllm_attention
from vllm_kvevict.vllm_compat import engine as vllm_engine
from vllm_kvevict.vllm_compat import metrics as vllm_metrics
from vllm_kvevict.vllm_compat import runner as vllm_runner

ALIAS = "KVEVICT"

_registered = False


def check_config(vllm_config) -> None:
    """Validate the kvevict configuration as vLLM finalises its own (first thing, every process)."""
    # The model name on the plugin's metrics, as on vLLM's (the API server's collector reads it).
    metrics.set_model_name(getattr(getattr(vllm_config, "model_config", None), "served_model_name", None))
    data, source = raw_config(getattr(vllm_config, "additional_config", None))
    selected = vllm_attention.custom_selected(vllm_config)
    if data is None and not selected:
        return
    cfg = config_from_vllm(vllm_config)  # raises KVEvictConfigError: one line
    if selected:
        logger.debug("kvevict: configuration from %s: %s", source, cfg.summary())
        _check_kv_cache_dtype(vllm_config, cfg)
        _refuse_unsafe_combinations(vllm_config, cfg)
        cache = getattr(vllm_config, "cache_config", None)
        why = cfg.windows_not_shared(getattr(cache, "block_size", None) or 16)
        if why is not None and getattr(cache, "enable_prefix_caching", False):
            logger.warning("kvevict: %s", why)
    else:
        logger.warning(
            "kvevict: a kvevict configuration was given (%s) but the attention backend is not "
            "kvevict; pass --attention-backend kvevict to evict",
            source,
        )


def _check_kv_cache_dtype(vllm_config, cfg) -> None:
    cache = getattr(vllm_config, "cache_config", None)
    dtype = getattr(cache, "cache_dtype", "auto")
    if dtype not in ("auto", None):  # any request may evict (a per-request override), whatever the server's
        raise KVEvictConfigError(
            f"invalid kvevict configuration: --kv-cache-dtype {dtype} is not supported with eviction; allowed: auto"
        )


def _refuse(what: str, why: str) -> None:
    raise KVEvictConfigError(f"invalid kvevict configuration: {what} is not supported with eviction ({why})")


def _refuse_unsafe_combinations(vllm_config, cfg) -> None:
    """Stop at start-up, with one line, on what eviction cannot run beside (any request of the
    server may evict: by default, or through a per-request override)."""
    if getattr(vllm_config, "speculative_config", None) is not None:
        _check_speculation(vllm_config, cfg)
    if getattr(getattr(vllm_config, "parallel_config", None), "pipeline_parallel_size", 1) > 1:
        _refuse(
            "pipeline parallelism (--pipeline-parallel-size)",
            "a policy that fails on one stage must reach the engine core before it caches that request's "
            "windows; tensor parallelism is supported",
        )
    cache = vllm_config.cache_config
    if getattr(vllm_config, "kv_transfer_config", None) is not None or getattr(cache, "kv_offloading_size", None):
        _refuse(
            "a KV transfer or offloading connector (--kv-transfer-config, --kv-offloading-size)",
            "compaction rewrites blocks the connector would copy",
        )
    _refuse_models_without_evictable_layers(vllm_config)
    # The per-step hook that gives the workers each request's own window is in the V1 model runner.
    refusal = vllm_runner.require_v1_runner(vllm_config, logger)
    if refusal is not None:
        _refuse(*refusal)


NO_EVICTION = "serve it without --attention-backend kvevict"


def _refuse_models_without_evictable_layers(vllm_config) -> None:
    """A model none of whose layers the plugin evicts would serve as if eviction were off, and
    say nothing: refused here, from vLLM's own decisions about the model's layers, before any
    weight loads (the workers check the layers they really built too: :func:`check_layers`).
    vLLM gives every layer without a window of its own the model's sliding window
    (``cache_config.sliding_window``) exactly when the model has no full-attention layer."""
    model = getattr(vllm_config, "model_config", None)
    if model is None:
        return
    if getattr(model, "use_mla", False):
        _refuse(
            "multi-head latent attention (MLA, as in DeepSeek-V2/V3)",
            "its latent KV cache has no per-head keys and values to score; set VLLM_MLA_DISABLE=1 to run it as "
            f"multi-head attention, which evicts, or {NO_EVICTION}",
        )
    if getattr(model, "runner_type", "generate") == "pooling":
        _refuse(
            "a pooling model (--runner pooling: embeddings, classification, scores)",
            "its output is a representation of the whole prompt, which eviction would change, and it generates "
            f"nothing to bound memory for; {NO_EVICTION}",
        )
    window = getattr(vllm_config.cache_config, "sliding_window", None)
    if window is not None:
        _refuse(
            f"a model whose every attention layer is sliding-window attention (window {window})",
            f"vLLM already keeps those layers within their window and the plugin evicts full-attention layers "
            f"only; {NO_EVICTION}",
        )


def check_layers(vllm_config, specs: dict) -> dict:
    """A worker's KV cache specs (layer name -> vLLM's spec), once its model is built: refused when
    no layer evicts (a kvevict layer is a :class:`~vllm_kvevict.spec.KVEvictSpec`: full
    attention; sliding-window, MLA, Mamba and other layers are left to vLLM), else one INFO line
    saying which layers evict and which do not. Returns the specs the worker reports, each
    evicting layer's saying how many evict (the engine core sizes recall tiers by it)."""
    from vllm_kvevict.spec import KVEvictSpec

    if not vllm_attention.custom_selected(vllm_config):
        return specs
    kinds: dict[str, int] = {}
    for spec in specs.values():
        name = "full attention" if isinstance(spec, KVEvictSpec) else type(spec).__name__
        window = getattr(spec, "sliding_window", None)
        key = name + (f" (window {window})" if window else "")
        kinds[key] = kinds.get(key, 0) + 1
    evicting = kinds.pop("full attention", 0)
    others = ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))
    if not evicting:
        raise KVEvictConfigError(
            f"invalid kvevict configuration: this model has no layer eviction applies to ({others or 'no layers'}: "
            f"the plugin evicts full-attention layers only); {NO_EVICTION}"
        )
    info_once(
        f"kvevict: {evicting} of {evicting + sum(kinds.values())} attention layers evict (full attention)"
        + (f"; left to vLLM: {others}" if others else ""),
        key="layers",
    )
    return {n: s.with_layers(evicting) if isinstance(s, KVEvictSpec) else s for n, s in specs.items()}


SPECULATION_POLICIES = "a policy without per-slot state (docs/compatibility.md)"
#: why a policy that compacts while decoding by per-slot state is refused with drafts, and what to do
DRAFTS_UNSAFE = "it counts every query in per-slot state, rejected drafts' too"
DRAFTS_REMEDY = f"choose {SPECULATION_POLICIES}, or trigger once"
#: speculative methods whose drafts come from the tokens alone (no drafter model, no KV of their own)
DRAFTS_WITHOUT_KV = ("ngram", "ngram_gpu", "suffix")


def _check_speculation(vllm_config, cfg) -> None:
    """Speculative decoding beside eviction: each compaction must see verified tokens only
    (``window.draft_cut``, decided by the engine core from the schedule), which asynchronous
    scheduling would decide before the previous step's drafts are verified; and the server's
    policy must not count rejected drafts in per-slot state (``RequestSettings.drafts_safe``)."""
    method = getattr(vllm_config.speculative_config, "method", None)
    if method not in DRAFTS_WITHOUT_KV:
        _refuse(
            f"speculative decoding with the method {method}",
            "its drafter keeps a KV cache of its own beside the evicted one; n-gram and suffix drafts are supported",
        )
    if getattr(vllm_config.scheduler_config, "async_scheduling", False):
        _refuse(
            "speculative decoding with asynchronous scheduling",
            "a step would be scheduled before the previous step's drafts are verified; pass --no-async-scheduling",
        )
    if not resolve(cfg, None, vllm_config.cache_config.block_size or 1).drafts_safe:
        _refuse(
            f"speculative decoding with the policy {cfg.policy} compacting while decoding",
            f"{DRAFTS_UNSAFE}; {DRAFTS_REMEDY}",
        )


def check_request(vllm_config, params):
    """Resolve a request's ``kvevict_*`` keys once (:func:`vllm_kvevict.request.resolve`), before
    vLLM processes its inputs: a bad key is refused (HTTP 400 naming it, a
    :class:`RequestConfigError`). Returns what checks the processed request (its prompt tokenized):
    :func:`check_fits_pool` with these settings; None when there is nothing more to check. Every
    refusal is counted (``kvevict:requests_refused_total``, by the key it names)."""
    try:
        return _check_keys(vllm_config, params)
    except Exception as err:  # anything raised here is answered with a 400 (vllm_compat.engine)
        metrics.count_refused(getattr(err, "key", None), "invalid")
        raise


def _check_keys(vllm_config, params):
    extra = getattr(params, "extra_args", None)
    if not vllm_attention.custom_selected(vllm_config):
        overrides = request_overrides(extra)  # a bad key is refused as such, first
        if overrides:
            key = "kvevict_" + overrides[0][0]
            raise RequestConfigError(f"{key}: this server was not started with --attention-backend kvevict", key)
        return None
    # vLLM 0.33 on CPU sets the block size in the worker; until the engine reports it here,
    # check_fits_pool does not run and the window's block size is unused.
    settings = resolve(config_from_vllm(vllm_config), extra, vllm_config.cache_config.block_size or 1)
    if getattr(vllm_config, "speculative_config", None) is not None and not settings.drafts_safe:
        key = next(
            (k for k in ("kvevict_policy", "kvevict_params", "kvevict_trigger") if k in settings.keys), "kvevict_policy"
        )
        raise RequestConfigError(
            f"{key}: the policy {settings.policy_name} compacting while decoding is not supported with this server's "
            f"speculative decoding ({DRAFTS_UNSAFE}); {DRAFTS_REMEDY}",
            key,
        )
    max_len = vllm_config.model_config.max_model_len
    if "kvevict_budget" in settings.keys and settings.budget > max_len:
        raise RequestConfigError(
            f"kvevict_budget: {settings.budget} is above this server's max_model_len "
            f"(allowed: an integer in [{settings.params.min_budget()}, {max_len}])",
            "kvevict_budget",
        )

    return functools.partial(_check_processed, vllm_config, settings)


def _check_processed(vllm_config, settings: RequestSettings, request) -> None:
    """The processed request (its prompt tokenized): streaming input refused with eviction, and
    :func:`check_fits_pool` (a refusal counted as ``too_large``)."""
    try:
        _check_streaming(settings, request)
    except Exception as err:
        metrics.count_refused(getattr(err, "key", None), "invalid")
        raise
    try:
        _check_request_fits(vllm_config, settings, request)
    except Exception as err:
        metrics.count_refused(
            getattr(err, "key", None), "too_large" if isinstance(err, RequestConfigError) else "invalid"
        )
        raise


def _check_streaming(settings: RequestSettings, request) -> None:
    if getattr(request, "resumable", False) and settings.evicts:
        # vLLM's streaming input (AsyncLLM.generate with an input stream, the realtime API)
        # extends a live request's prompt while it keeps its blocks: the prompt's length, which
        # a `once` window's compaction point and a window's caching depend on, would change
        # under a compacted window.
        raise RequestConfigError(
            "kvevict_enabled: streaming input is not supported with eviction (the prompt would grow "
            "under a compacted window); send each input as a request of its own, or set "
            "kvevict_enabled to false for this one",
            "kvevict_enabled",
        )


def _check_request_fits(vllm_config, settings: RequestSettings, request) -> None:
    sp = getattr(request, "sampling_params", None)
    if sp is None:
        return
    tokens = request.prompt_token_ids
    prompt_len = len(tokens) if tokens is not None else int(request.prompt_embeds.shape[0])
    # The key that made the window unbounded or large: the one a 400 names.
    keys = ("kvevict_enabled", "kvevict_policy", "kvevict_params", "kvevict_budget")
    key = next((k for k in keys if k in settings.keys), None)
    check_fits_pool(vllm_config, settings, prompt_len, sp.max_tokens, key)


def check_fits_pool(
    vllm_config, settings: RequestSettings, prompt_len: int, max_tokens: int | None, key: str | None
) -> None:
    """Refuse (HTTP 400) a request that could hold more KV blocks than the whole pool: one whose
    override turns eviction off, picks a ``once`` policy or a large budget, with a prompt plus
    output longer than the KV cache. Admitted, it could never finish and would preempt everyone
    else in a loop."""
    from vllm_kvevict.window import peak_blocks

    cache = vllm_config.cache_config
    num_blocks = getattr(cache, "num_gpu_blocks", None)
    if not num_blocks or not cache.block_size:
        return  # the engine has not reported its pool (not in a serving process)
    # vLLM reports the sum of every data-parallel engine's pool here; a request runs on one
    usable = num_blocks // max(1, vllm_config.parallel_config.data_parallel_size) - 1  # less the null block
    max_len = vllm_config.model_config.max_model_len
    total = min(prompt_len + (max_tokens if max_tokens is not None else max_len), max_len)
    window = settings.window
    in_flight = vllm_config.max_in_flight_tokens
    evicting, sliding, sliding_window = kv_cache_groups(vllm_config.model_config)
    peak = evicting * peak_blocks(
        prompt_len, total, window, in_flight, vllm_config.scheduler_config.max_num_batched_tokens
    )
    if sliding and sliding_window:  # vLLM's own bound on a sliding-window group's blocks (SlidingWindowSpec)
        bs = cache.block_size
        peak += sliding * min(-(-total // bs), -(-min(sliding_window - 1 + in_flight, max_len) // bs) + 1)
    if peak > usable:
        why = (
            "with eviction off"
            if not window.enabled
            else f"with trigger {window.trigger}"
            if window.trigger != "chunked" or not window.decode
            else f"with budget {settings.budget}"
        )
        raise RequestConfigError(
            f"{key or 'max_tokens'}: this request could hold {peak} KV blocks ({prompt_len} prompt + up to "
            f"{total - prompt_len} output tokens {why}) but the KV cache has {usable}; shorten the prompt or "
            f"max_tokens, or keep eviction on with a smaller budget",
            key or "max_tokens",
        )


def kv_cache_groups(model_config) -> tuple[int, int, int | None]:
    """``(evicting groups, sliding-window groups, window)``: the KV cache groups vLLM makes of a
    model's layers, each holding its own blocks of a request in one pool, from the model's
    ``layer_types`` (full and sliding-window attention; any other kind: one group assumed). vLLM
    0.32/0.33 (``kv_cache_utils._get_kv_cache_groups_uniform_page_size``): every kind is split into
    groups of the smallest kind's layer count, or of the largest's when it is within 1.5 times."""
    text = getattr(model_config, "hf_text_config", None)
    types = list(getattr(text, "layer_types", None) or ())
    window = getattr(text, "sliding_window", None)
    full, sliding = types.count("full_attention"), types.count("sliding_attention")
    if not window or not full or not sliding or full + sliding != len(types):
        return 1, 0, None
    size = max(full, sliding) if max(full, sliding) < 1.5 * min(full, sliding) else min(full, sliding)
    return -(-full // size), -(-sliding // size), int(window)


def _choose_cuda_base(device_capability, attn_selector_config) -> str:
    from vllm_kvevict.backends.flash_attn import choose_base

    path, reasons = choose_base(device_capability, attn_selector_config)
    if reasons:
        logger.info(
            "kvevict: FLASH_ATTN refused this configuration (%s); using the TRITON_ATTN base", "; ".join(reasons)
        )
    return path


def _install_excepthook() -> None:
    """Print a KVEvictConfigError as its one line (the CLI would otherwise show a long traceback)."""
    if getattr(sys.excepthook, "_kvevict", False):
        return
    previous = sys.excepthook

    def hook(exc_type, exc, tb):
        if issubclass(exc_type, KVEvictConfigError) and not envs.KVEVICT_TRACEBACK:
            print(f"ERROR: {exc}", file=sys.stderr, flush=True)
            return
        previous(exc_type, exc, tb)

    hook._kvevict = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def _stay_inactive() -> None:
    """On a vLLM release outside the supported ones, install nothing a server uses unless it
    selects the kvevict backend: vLLM loads every installed plugin in every process and lets what
    a plugin raises stop it, so raising here would stop every ``vllm serve`` of the environment,
    with or without eviction. One WARNING; ``--attention-backend kvevict`` is then refused with
    one line when vLLM checks its configuration. Whatever of vLLM this touches may have moved in
    that release: if it has, nothing is installed (vLLM then refuses the unknown backend name)."""
    logger.warning(
        f"kvevict: vllm-kvevict supports vLLM {vllm_compat.supported_series()} but found "
        f"{vllm_compat.vllm_version()}: the plugin stays inactive (--attention-backend kvevict is refused). "
        "KVEVICT_ALLOW_UNTESTED_VLLM=1 tries it anyway; VLLM_PLUGINS (the names of the plugins to load) "
        "leaves it out"
    )
    try:
        vllm_attention.alias_custom(ALIAS)
        vllm_engine.install_config_hook(vllm_attention.platform_class(), _refuse_unsupported)
        _install_excepthook()
    except Exception as err:  # noqa: BLE001 - an internal that moved: vLLM refuses the name itself
        logger.debug("kvevict: could not install the refusal of the kvevict backend (%r)", err)


def _refuse_unsupported(vllm_config) -> None:
    """Refuse the kvevict backend on an unsupported vLLM (its CUSTOM backend left unregistered)."""
    try:
        refused = vllm_attention.custom_selected(vllm_config) and not vllm_attention.custom_registered()
    except Exception:  # noqa: BLE001 - a configuration this release shapes otherwise: not ours to stop
        return
    if refused:
        raise KVEvictConfigError(
            f"invalid kvevict configuration: {vllm_compat.unsupported_reason()}; serve without "
            "--attention-backend kvevict, or set KVEVICT_ALLOW_UNTESTED_VLLM=1 to try it anyway"
        )


def register() -> None:
    """The ``vllm.general_plugins`` entry point; safe to call any number of times."""
    global _registered
    if _registered:
        return
    if not vllm_compat.supported():
        _stay_inactive()
        _registered = True
        return
    kind = vllm_attention.platform_kind()
    path = CPU_BACKEND if kind == "cpu" else FLASH_ATTN_BACKEND
    vllm_attention.register_custom(path, ALIAS)
    if kind == "cpu":
        vllm_attention.install_cpu_selector()
    elif kind == "cuda":
        vllm_attention.install_cuda_selector(_choose_cuda_base)
    vllm_engine.install_config_hook(vllm_attention.platform_class(), check_config)
    vllm_runner.install_spec_check(check_layers)
    from vllm_kvevict.kv_manager import install_scheduler_hooks, register_spec

    register_spec()
    install_scheduler_hooks()
    vllm_engine.install_request_check(check_request, logger)
    # Every process records into the metrics directory the first one (the API server) made; the
    # API server serves them on vLLM's /metrics.
    vllm_metrics.install_collector(metrics.Collector(metrics.setup_directory()))
    vllm_metrics.install_engine_index(metrics.set_engine)
    _install_excepthook()
    if envs.KVEVICT_TEST_FAULT or envs.KVEVICT_TEST_HOLD is not None:  # the engine tests' hooks
        from vllm_kvevict.testing import hooks

        hooks.install()
    _registered = True
    logger.debug("kvevict: registered %s as attention backend CUSTOM (alias %s)", path, ALIAS)
