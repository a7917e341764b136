"""Registration of the kvevict attention backend in every vLLM process (written against vLLM 0.32.0).

vLLM calls :func:`register` (the ``vllm.general_plugins`` entry point) in the API server, the engine
core and every worker. It must be idempotent. What it does, and why (VLLM_INTEGRATION.md 1.4):

1. ``register_backend(AttentionBackendEnum.CUSTOM, <our class>)``: CUSTOM is the one enum member
   that pickles into spawned processes; the override is re-installed in each of them.
2. ``--attention-backend kvevict`` is an alias of CUSTOM (``--attention-backend custom`` also works).
3. On CPU, ``CpuPlatform.get_attn_backend_cls`` ignores every backend but CPU_ATTN; it is wrapped to
   honour CUSTOM.
4. The platform's ``check_and_update_config`` is wrapped to validate the kvevict configuration as
   soon as the ``VllmConfig`` exists: a bad configuration stops vLLM before any weight is loaded.
"""

from __future__ import annotations

import os
import sys

from vllm_kvevict._logging import logger
from vllm_kvevict.backends import CPU_BACKEND, CUDA_BACKEND
from vllm_kvevict.config import (
    KVEvictConfigError,
    RequestConfigError,
    config_from_vllm,
    raw_config,
    request_config,
    request_overrides,
)

#: vLLM versions whose internals this plugin was written and tested against.
SUPPORTED_VLLM = ("0.32.",)
ALLOW_UNTESTED_ENV = "KVEVICT_ALLOW_UNTESTED_VLLM"
ALIAS = "KVEVICT"

_registered = False


def _check_vllm_version() -> None:
    import vllm

    version = getattr(vllm, "__version__", "unknown")
    if not version.startswith(SUPPORTED_VLLM) and os.environ.get(ALLOW_UNTESTED_ENV) != "1":
        raise RuntimeError(
            f"vllm-kvevict supports vLLM {', '.join(v + 'x' for v in SUPPORTED_VLLM)} but found {version}; "
            f"set {ALLOW_UNTESTED_ENV}=1 to try anyway"
        )


def _is_kvevict_selected(vllm_config) -> bool:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    attn = getattr(vllm_config, "attention_config", None)
    return attn is not None and attn.backend is AttentionBackendEnum.CUSTOM


def _wrap_check_and_update_config(platform_cls) -> None:
    """Validate the kvevict config when vLLM finalises its config (first thing, every process)."""
    if platform_cls.__dict__.get("_kvevict_config_hook"):
        return
    orig = platform_cls.check_and_update_config.__func__

    def check_and_update_config(cls, vllm_config) -> None:
        data, source = raw_config(getattr(vllm_config, "additional_config", None))
        selected = _is_kvevict_selected(vllm_config)
        if data is not None or selected:
            cfg = config_from_vllm(vllm_config)  # raises KVEvictConfigError: one line
            if selected:
                logger.debug("kvevict: configuration from %s: %s", source, cfg.summary())
                _check_kv_cache_dtype(vllm_config, cfg)
                _refuse_unsafe_combinations(vllm_config, cfg)
                _disable_prefix_caching(vllm_config, cfg)
            else:
                logger.warning(
                    "kvevict: a kvevict configuration was given (%s) but the attention backend is not "
                    "kvevict; pass --attention-backend kvevict to evict", source
                )
        orig(cls, vllm_config)

    platform_cls.check_and_update_config = classmethod(check_and_update_config)
    platform_cls._kvevict_config_hook = True


def _check_kv_cache_dtype(vllm_config, cfg) -> None:
    cache = getattr(vllm_config, "cache_config", None)
    dtype = getattr(cache, "cache_dtype", "auto")
    if cfg.eviction_active and dtype not in ("auto", None):
        raise KVEvictConfigError(
            f"invalid kvevict configuration: --kv-cache-dtype {dtype} is not supported with eviction; allowed: auto"
        )


#: Set while vLLM builds its config from engine arguments that asked for prefix caching explicitly.
_explicit_prefix_caching = False
V2_RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"


def _refuse(what: str, why: str) -> None:
    raise KVEvictConfigError(f"invalid kvevict configuration: {what} is not supported with eviction ({why})")


def _refuse_unsafe_combinations(vllm_config, cfg) -> None:
    """Stop at start-up, with one line, on what eviction cannot run beside (any request of the
    server may evict: by default, or through an override when prefix caching is off)."""
    if not (cfg.eviction_active or not vllm_config.cache_config.enable_prefix_caching):
        return
    if getattr(vllm_config, "speculative_config", None) is not None:
        _refuse("speculative decoding (--speculative-config)", "draft and verified tokens would need their own windows")
    cache = vllm_config.cache_config
    if getattr(vllm_config, "kv_transfer_config", None) is not None or getattr(cache, "kv_offloading_size", None):
        _refuse("a KV transfer or offloading connector (--kv-transfer-config, --kv-offloading-size)",
                "compaction rewrites blocks the connector would copy")
    if _explicit_prefix_caching and cfg.eviction_active:
        _refuse("--enable-prefix-caching", "compaction rewrites KV blocks in place; leave it unset or pass "
                "--no-enable-prefix-caching")
    _force_v1_runner(vllm_config)


def _force_v1_runner(vllm_config) -> None:
    """The per-step hook that gives the workers each request's own window is installed into the V1
    model runner (``backends/step.py``); vLLM 0.32 picks Model Runner V2 by default on GPUs.
    Force V1 (the environment is inherited by the engine and worker processes), or refuse when the
    user asked for V2."""
    if os.environ.get(V2_RUNNER_ENV, "").strip().lower() in ("1", "true"):
        _refuse(f"{V2_RUNNER_ENV}=1", f"the plugin's per-step hook is in vLLM's V1 model runner; unset it or set "
                f"{V2_RUNNER_ENV}=0")
    if os.environ.get(V2_RUNNER_ENV) is None and getattr(vllm_config, "use_v2_model_runner", False):
        os.environ[V2_RUNNER_ENV] = "0"
        logger.info("kvevict: using vLLM's V1 model runner (%s=0): the plugin's per-step hook is installed "
                    "into it, not into Model Runner V2", V2_RUNNER_ENV)


def _wrap_engine_args() -> None:
    """Tell an explicit ``--enable-prefix-caching`` from vLLM's default (vLLM 0.32.0
    ``EngineArgs.create_engine_config``: the field is None unless the user set it)."""
    from vllm.engine.arg_utils import EngineArgs

    if EngineArgs.__dict__.get("_kvevict_args_hook"):
        return
    orig = EngineArgs.create_engine_config

    def create_engine_config(self, *args, **kwargs):
        global _explicit_prefix_caching
        _explicit_prefix_caching = self.enable_prefix_caching is True
        try:
            return orig(self, *args, **kwargs)
        finally:
            _explicit_prefix_caching = False

    EngineArgs.create_engine_config = create_engine_config
    EngineArgs._kvevict_args_hook = True


def _disable_prefix_caching(vllm_config, cfg) -> None:
    """Compaction rewrites blocks in place, so evicting requests must not share or hash blocks."""
    cache = getattr(vllm_config, "cache_config", None)
    if cfg.eviction_active and cache is not None and cache.enable_prefix_caching:
        cache.enable_prefix_caching = False
        logger.warning(
            "kvevict: prefix caching is turned off: compaction rewrites KV blocks in place, so they "
            "cannot be shared between requests or reused from the prefix cache"
        )


def validate_request(vllm_config, extra_args) -> None:
    """Check one request's ``kvevict_*`` keys; raises :class:`RequestConfigError` naming the key."""
    overrides = request_overrides(extra_args)
    if not overrides:
        return
    key = "kvevict_" + overrides[0][0]
    if not _is_kvevict_selected(vllm_config):
        raise RequestConfigError(f"{key}: this server was not started with --attention-backend kvevict", key)
    server = config_from_vllm(vllm_config)
    cfg = request_config(server, overrides)
    max_len = vllm_config.model_config.max_model_len
    if dict(overrides).get("budget", 0) > max_len:
        raise RequestConfigError(
            f"kvevict_budget: {dict(overrides)['budget']} is above this server's max_model_len "
            f"(allowed: an integer in [{cfg.policy_params.min_budget()}, {max_len}])", "kvevict_budget",
        )
    if cfg.eviction_active and not server.eviction_active and vllm_config.cache_config.enable_prefix_caching:
        raise RequestConfigError(
            f"{key}: eviction is off on this server and prefix caching is on, so a request cannot turn it on; "
            "start the server with --no-enable-prefix-caching (or with eviction enabled)", key,
        )


def check_fits_pool(vllm_config, cfg, prompt_len: int, max_tokens: int | None, key: str | None) -> None:
    """Refuse (HTTP 400) a request that could hold more KV blocks than the whole pool: one whose
    override turns eviction off, picks a ``once`` policy or a large budget, with a prompt plus
    output longer than the KV cache. Admitted, it could never finish and would preempt everyone
    else in a loop."""
    from vllm_kvevict.window import peak_blocks

    cache = vllm_config.cache_config
    num_blocks = getattr(cache, "num_gpu_blocks", None)
    if not num_blocks or not cache.block_size:
        return  # the engine has not reported its pool (not in a serving process)
    usable = num_blocks - 1  # block 0 is vLLM's null block
    max_len = vllm_config.model_config.max_model_len
    total = min(prompt_len + (max_tokens if max_tokens is not None else max_len), max_len)
    window = cfg.window(cache.block_size)
    peak = peak_blocks(prompt_len, total, window, vllm_config.max_in_flight_tokens)
    if peak > usable:
        why = ("with eviction off" if not window.enabled else
               f"with trigger {window.trigger}" if window.trigger != "chunked" or not window.decode else
               f"with budget {cfg.budget}")
        raise RequestConfigError(
            f"{key or 'max_tokens'}: this request could hold {peak} KV blocks ({prompt_len} prompt + up to "
            f"{total - prompt_len} output tokens {why}) but the KV cache has {usable}; shorten the prompt or "
            f"max_tokens, or keep eviction on with a smaller budget", key or "max_tokens",
        )


def _wrap_request_validation() -> None:
    """HTTP 400 for a bad per-request override or a request that cannot fit the KV pool (vLLM
    0.32.0 ``InputProcessor._validate_params`` and ``process_inputs``). Anything unexpected while
    checking is logged and refused as a 400 too: a request never gets a 500 from the plugin."""
    from vllm.exceptions import VLLMValidationError
    from vllm.v1.engine.input_processor import InputProcessor

    if InputProcessor.__dict__.get("_kvevict_validation_hook"):
        return
    orig_validate, orig_process = InputProcessor._validate_params, InputProcessor.process_inputs

    def _checked(fn, *args):
        try:
            return fn(*args)
        except RequestConfigError as err:
            raise VLLMValidationError(str(err), parameter=err.key) from None
        except Exception as err:  # noqa: BLE001 - a bug here must fail the request, not the server
            logger.warning("kvevict: could not check a request's kvevict keys: %r", err, exc_info=True)
            raise VLLMValidationError(f"kvevict: could not check the request's kvevict keys ({type(err).__name__})",
                                      parameter="vllm_xargs") from None

    def _validate_params(self, params, supported_tasks):
        result = orig_validate(self, params, supported_tasks)
        extra = getattr(params, "extra_args", None)
        if extra and any(str(k).startswith("kvevict_") for k in extra):
            _checked(validate_request, self.vllm_config, extra)
        return result

    def process_inputs(self, request_id, prompt, params, *args, **kwargs):
        request = orig_process(self, request_id, prompt, params, *args, **kwargs)
        sp = getattr(request, "sampling_params", None)
        if sp is not None and _is_kvevict_selected(self.vllm_config):
            _checked(_check_request_fits, self.vllm_config, request, sp)
        return request

    InputProcessor._validate_params = _validate_params
    InputProcessor.process_inputs = process_inputs
    InputProcessor._kvevict_validation_hook = True


def _check_request_fits(vllm_config, request, sp) -> None:
    overrides = request_overrides(getattr(sp, "extra_args", None))
    cfg = request_config(config_from_vllm(vllm_config), overrides)
    tokens = request.prompt_token_ids
    prompt_len = len(tokens) if tokens is not None else int(getattr(request, "prompt_embeds").shape[0])
    over = dict(overrides or ())
    # The key that made the window unbounded or large: the one a 400 names.
    key = next((f"kvevict_{k}" for k in ("enabled", "policy", "params", "budget") if k in over), None)
    check_fits_pool(vllm_config, cfg, prompt_len, sp.max_tokens, key)


def _wrap_cpu_selector() -> None:
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    if CpuPlatform.__dict__.get("_kvevict_selector_hook"):
        return
    orig = CpuPlatform.get_attn_backend_cls.__func__

    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
        if selected_backend is AttentionBackendEnum.CUSTOM and not attn_selector_config.use_mla:
            return selected_backend.get_path()
        return orig(cls, selected_backend, attn_selector_config, num_heads)

    CpuPlatform.get_attn_backend_cls = classmethod(get_attn_backend_cls)
    CpuPlatform._kvevict_selector_hook = True


def _wrap_cuda_selector() -> None:
    """On CUDA, CUSTOM resolves to the FlashAttention or the Triton subclass (``backends/cuda.py``
    ``choose_base``), re-registered before vLLM validates it, so every later lookup of CUSTOM in
    this process finds the same class. vLLM 0.32.0's ``CudaPlatform.get_attn_backend_cls``."""
    from vllm.platforms.cuda import CudaPlatform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    if CudaPlatform.__dict__.get("_kvevict_selector_hook"):
        return
    orig = CudaPlatform.get_attn_backend_cls.__func__

    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
        if selected_backend is AttentionBackendEnum.CUSTOM and not attn_selector_config.use_mla:
            from vllm_kvevict.backends.cuda import choose_base

            path, reasons = choose_base(cls.get_device_capability(), attn_selector_config)
            if reasons:
                logger.info("kvevict: FLASH_ATTN refused this configuration (%s); using the TRITON_ATTN base",
                            "; ".join(reasons))
            register_backend(AttentionBackendEnum.CUSTOM, path)
        return orig(cls, selected_backend, attn_selector_config, num_heads)

    CudaPlatform.get_attn_backend_cls = classmethod(get_attn_backend_cls)
    CudaPlatform._kvevict_selector_hook = True


def _install_excepthook() -> None:
    """Print a KVEvictConfigError as its one line (the CLI would otherwise show a long traceback)."""
    if getattr(sys.excepthook, "_kvevict", False):
        return
    previous = sys.excepthook

    def hook(exc_type, exc, tb):
        if issubclass(exc_type, KVEvictConfigError) and not os.environ.get("KVEVICT_TRACEBACK"):
            print(f"ERROR: {exc}", file=sys.stderr, flush=True)
            return
        previous(exc_type, exc, tb)

    hook._kvevict = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def register() -> None:
    """The ``vllm.general_plugins`` entry point; safe to call any number of times."""
    global _registered
    if _registered:
        return
    _check_vllm_version()
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    path = CPU_BACKEND if current_platform.is_cpu() else CUDA_BACKEND
    register_backend(AttentionBackendEnum.CUSTOM, path)
    # The CLI upper-cases the value and looks it up by name: make KVEVICT name the CUSTOM member.
    AttentionBackendEnum._member_map_.setdefault(ALIAS, AttentionBackendEnum.CUSTOM)
    if current_platform.is_cpu():
        _wrap_cpu_selector()
    elif current_platform.is_cuda():
        _wrap_cuda_selector()
    _wrap_check_and_update_config(type(current_platform))
    _wrap_engine_args()
    from vllm_kvevict.scheduler import install_scheduler_hooks, register_spec

    register_spec()
    install_scheduler_hooks()
    _wrap_request_validation()
    _install_excepthook()
    _registered = True
    logger.debug("kvevict: registered %s as attention backend CUSTOM (alias %s)", path, ALIAS)
