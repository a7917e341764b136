# SPDX-License-Identifier: Apache-2.0
"""The API server and engine set-up: configuration finalisation, request checks.

Written against vLLM 0.32.0 (``platforms/interface.py`` ``check_and_update_config``,
``v1/engine/input_processor.py``
``InputProcessor.process_inputs``, ``exceptions.py``
``VLLMValidationError``); the same in 0.33.0 (``input_processor.py`` is byte-identical). In 0.33
the CPU platform's default block size is set later, in the worker: ``cache_config.block_size`` is
not final while ``check_and_update_config`` runs, so the plugin never reads it there.
"""

from __future__ import annotations

from collections.abc import Callable

from vllm_kvevict.vllm_compat.patching import wrap_method


def install_config_hook(platform_cls: type, check: Callable[[object], None]) -> None:
    """``check(vllm_config)`` first thing in the platform's ``check_and_update_config``, called from
    ``VllmConfig.__post_init__`` in every process: a bad configuration stops vLLM before any weight
    is loaded, and ``check`` may still change the configuration (e.g. prefix caching)."""

    def make(orig):
        def check_and_update_config(cls, vllm_config) -> None:
            check(vllm_config)
            orig(cls, vllm_config)

        return check_and_update_config

    wrap_method(platform_cls, "check_and_update_config", make, "kvevict: check the kvevict configuration")


def install_request_check(check: Callable[[object, object], Callable[[object], None] | None], logger) -> None:
    """The API server's check of a request, answered as vLLM answers its own: HTTP 400.

    ``then = check(vllm_config, params)`` before ``InputProcessor.process_inputs`` processes the
    request (its keys: refused before the prompt is tokenized), and ``then(engine_request)`` after
    it (the prompt tokenized), when ``then`` is not None. A check refuses by raising anything with a
    ``key`` attribute (the parameter named in the 400); anything else unexpected is logged and
    refused too, so a bug in a check costs one request, never a 500.
    """
    from vllm.exceptions import VLLMValidationError
    from vllm.v1.engine.input_processor import InputProcessor

    def checked(fn, *args):
        try:
            return fn(*args)
        except Exception as err:  # noqa: BLE001 - a bug here must fail the request, not the server
            key = getattr(err, "key", None)
            if key is not None:
                raise VLLMValidationError(str(err), parameter=key) from None
            logger.warning("kvevict: could not check a request's kvevict keys: %r", err, exc_info=True)
            raise VLLMValidationError(
                f"kvevict: could not check the request's kvevict keys ({type(err).__name__})", parameter="vllm_xargs"
            ) from None

    def make_process(orig):
        def process_inputs(self, request_id, prompt, params, *args, **kwargs):
            then = checked(check, self.vllm_config, params)
            request = orig(self, request_id, prompt, params, *args, **kwargs)
            if then is not None:
                checked(then, request)
            return request

        return process_inputs

    wrap_method(
        InputProcessor,
        "process_inputs",
        make_process,
        "kvevict: HTTP 400 for bad kvevict keys, or a request that cannot fit",
    )
