# SPDX-License-Identifier: Apache-2.0
"""A request's eviction settings, resolved once per process, and the per-process request registry.

A request's ``kvevict_*`` keys (OpenAI ``vllm_xargs``, the Python API's ``extra_args``) travel to
every process with its sampling parameters. Each process turns them into one frozen
:class:`RequestSettings` the first time it sees the request (:func:`resolve`: the keys validated,
applied to the server's configuration, the window and the policy object derived) and never reads
the raw dict again:

* the API server resolves while it checks the request (HTTP 400 naming a bad key);
* the engine core when the scheduler first looks the request up (prefix-cache lookup or
  allocation), kept until the request finishes (a preempted request keeps its settings);
* each worker when a step first schedules the request, kept while the model runner holds it.

Everything the engine core or a worker keeps of a request lives in its :class:`RequestState`, in
that side's one registry (:data:`ENGINE`, :data:`WORKER`): the shared prefix of its attempt, the
fallback of a failed policy, per layer its query windows and recall tier. A request that ends or
restarts is cleaned up in one place (:meth:`Registry.end`, :meth:`Registry.retain`,
:meth:`RequestState.restart`). Two registries, not one, because with a single GPU (or the CPU
engine) vLLM runs the worker inside the engine core's process, and the two sides see a request
begin and end at different times.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Collection, Hashable
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from typing import TYPE_CHECKING, Any

from vllm_kvevict.config import KVEvictConfig, RecallConfig, request_config, request_overrides
from vllm_kvevict.policies import Policy, PolicyParams, get_policy
from vllm_kvevict.policies.snapkv import SnapKV, SnapKVParams
from vllm_kvevict.window import WindowConfig, admission_blocks, hit_end, tail_end

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class RequestSettings:
    """One request's eviction settings: the server's configuration with the request's overrides."""

    config: KVEvictConfig
    window: WindowConfig  # for the KV cache's block size
    policy: Policy  # shared by every request with the same policy and parameters (policies hold no request state)
    #: the request keys it set, in a fixed order (the one that made its window large is named in a 400)
    keys: tuple[str, ...] = ()

    @property
    def policy_name(self) -> str:
        return self.config.policy

    @property
    def budget(self) -> int:
        return self.config.budget

    @property
    def params(self) -> PolicyParams:
        return self.config.policy_params

    @property
    def recall(self) -> RecallConfig:
        return self.config.recall

    @cached_property
    def decode_policy(self) -> Policy:
        """The policy that compacts the window once the prompt is complete: the request's own, or
        with ``recall.decode = "recall"`` recall's score, SnapKV's equation with the recall's
        parameters (its latest ``window`` queries, max-pooled over ``kernel`` positions), so that
        the answer's compactions keep what its own queries attend to."""
        r = self.config.recall
        if not r.enabled or r.decode != "recall" or self.policy.needs.merges:
            return self.policy
        return self.recall_policy

    @cached_property
    def recall_policy(self) -> Policy:
        """Recall's score as a policy: SnapKV's equation with the recall's parameters (its latest
        ``window`` queries, max-pooled over ``kernel`` positions)."""
        r = self.config.recall
        window = max(1, min(r.window, self.budget - 1))
        return SnapKV(SnapKVParams(window=window, kernel=r.kernel, pooling="max"))

    @property
    def evicts(self) -> bool:
        """Whether this request's window ever evicts (enabled, a policy other than ``none``)."""
        return self.window.enabled

    @property
    def shares_windows(self) -> bool:
        """Whether the windows this request compacts at its compaction points may be cached and
        reused by later requests (docs/architecture.md, "Compressed windows"): a ``chunked`` window
        whose stride is at least ``W`` (so no compaction writes an earlier compaction point's
        window), and whose query window fits in one stride (a request starting on a cached window
        has seen no earlier queries). Per-slot policy state (H2O's accumulator, LSH-E's codes) goes
        with the window as its compaction left it, merging policies (KVMerger with the ``chunked``
        trigger) share the windows they merged, and with recall the tier travels with the window
        (``tier_cache.py``; only windows before the prompt's end: :meth:`caches_window_at`)."""
        w, needs = self.window, self.policy.needs
        return (
            self.config.cache_windows
            and w.enabled
            and w.trigger == "chunked"
            and w.step >= w.window
            and needs.window <= w.step
        )

    def caches_window_at(self, b: int, prompt_len: int) -> bool:
        """Whether the window at compaction point ``b`` is a function of the first ``b`` tokens
        alone: always, but with recall only before the prompt's end (the step completing the
        prompt re-selects the window by the question; every later window depends on where the
        prompt ended)."""
        return not self.config.recall.enabled or b < prompt_len

    def starts_on_window_at(self, t: int, prompt_len: int) -> bool:
        """Whether the request may start on a cached window (and tail) at ``t``: with recall, at a
        compaction point (the tier cached there carries the queries recall scores by), or where
        the rest of its prompt holds recall's ``window`` queries (it has seen none in the tail)."""
        recall = self.config.recall
        return not recall.enabled or t % self.window.step == 0 or t <= prompt_len - recall.window

    @property
    def shares_tails(self) -> bool:
        """Whether the blocks this request computes after a compaction point (or before its first)
        are cached and a later request may start past the window (or the pure prefix) on them: a
        request that shares windows, whose policy keeps no per-slot state (a tail token's state
        keeps changing with every later query). Those below ``window.tail_end`` are cached as they
        are; those its next compaction rewrites, up to ``window.hit_end``, are copied aside first,
        and with recall those after the last point before the prompt's end (the step completing
        the prompt rewrites the window and its tail: ``window.prompt_tail``)."""
        return self.shares_windows and not self.policy.needs.state

    @property
    def tier_state_bytes(self) -> int:
        """Bytes of per-slot policy state one evicted token carries per KV head in a recall tier."""
        return sum(dtype.itemsize for dtype, _ in self.policy.needs.state.values())

    @property
    def drafts_safe(self) -> bool:
        """Whether the request may decode with speculative drafts: its compactions while decoding,
        if any, read no per-slot state (H2O's accumulator, LSH-E's victims, KVMerger's: every
        query's contribution, and a rejected draft's would have counted). Compactions themselves
        never see a draft (``window.draft_cut``), and query windows drop rejected drafts' queries."""
        w = self.window
        compacts_while_decoding = w.enabled and w.trigger == "chunked" and w.decode
        return not (compacts_while_decoding and (self.policy.needs.observes or self.decode_policy.needs.observes))

    def tail_end(self, b: int) -> int:
        """The end of the tail of this request's window at compaction point ``b``."""
        return tail_end(b, self.window, self.policy.needs.window)

    def hit_end(self, p: int) -> int:
        """The most tokens before compaction point ``p`` a hit may cover (``window.hit_end``)."""
        return hit_end(p, self.window, self.policy.needs.window)

    @cached_property
    def window_salt(self) -> str:
        """What the cache key of a compacted window adds to the token prefix: everything in the
        configuration that changes the window (policy, parameters, budget, trigger, stride,
        recall), and the block size; not when blocks are copied aside (``copy_rewritten``) nor what
        clients may ask (``limits``)."""
        data = f"{self.config.model_dump_json(exclude={'copy_rewritten', 'limits'})}|{self.window.block_size}"
        return hashlib.sha256(data.encode()).hexdigest()

    def admission_blocks(self, max_in_flight: int, max_chunk: int | None = None) -> int | None:
        """The blocks vLLM's admission gate reserves for the request (``window.admission_blocks``)."""
        return admission_blocks(self.window, max_in_flight, max_chunk)


def resolve(server: KVEvictConfig, extra_args: Any, block_size: int) -> RequestSettings:
    """The settings of a request with these ``extra_args`` on a server with this configuration.

    Raises :class:`~vllm_kvevict.config.RequestConfigError` (one line naming the key) on a bad key."""
    overrides = request_overrides(extra_args)
    return _resolve(server, overrides, block_size)


@lru_cache(maxsize=1024)
def _resolve(server: KVEvictConfig, overrides: tuple[tuple[str, Any], ...] | None, block_size: int) -> RequestSettings:
    cfg = request_config(server, overrides)
    given = dict(overrides or ())
    keys = tuple(f"kvevict_{k}" for k in ("enabled", "policy", "params", "budget", "trigger", "recall") if k in given)
    return RequestSettings(config=cfg, window=cfg.window(block_size), policy=policy_object(cfg), keys=keys)


@lru_cache(maxsize=256)
def _policy_object(name: str, params: PolicyParams) -> Policy:
    return get_policy(name, params)


def policy_object(cfg: KVEvictConfig) -> Policy:
    """The policy object of a configuration (one per policy and parameters in a process)."""
    return _policy_object(cfg.policy, cfg.policy_params)


@dataclass
class LayerState:
    """What a worker keeps of one request in one attention layer."""

    queries: torch.Tensor | None = None  # the request's latest queries [H_q, w, d] (query-window policies)
    queries_end: int = 0  # the position after the last of them (speculative decoding: drafts rejected since go)
    recall_queries: torch.Tensor | None = None  # recall: the prompt's latest queries [H_q, window, d]
    tier: Any = None  # recall: the tokens its compactions evicted (backends/recall.Tier, made by the backend)
    #: recall: the end of the step whose attention read a window re-selected before it (``prefill:
    #: window``), and how many of its tokens came from the tier (a device count)
    reselected: tuple[int, Any] | None = None
    #: per-slot policy state of the cached window the attempt started on, its own copy, until its
    #: next compaction moves past the window ({name: [window slots, H]}; backends/slots.py)
    window_state: dict[str, torch.Tensor] | None = None


@dataclass
class RequestState:
    """Everything one process keeps of one request. Its attempt (from the first step to a free or a
    preemption) is :meth:`restart`-ed when the request starts again."""

    settings: RequestSettings
    #: the prefix-cache hit the current attempt started on (tokens, read-only; 0 without one)
    shared: int = 0
    #: engine core: the compaction point of the cached window the attempt started on (0: none)
    window_hit: int = 0
    #: engine core: vLLM's request while it holds blocks (its block hashes, for the prefix cache)
    request: Any = None
    #: the policy a fault made it leave for the safe policy (backends/fault.py), if any: on a
    #: worker, set where it failed; in the engine core, from the step's output (nothing of it is
    #: cached from then on). Kept for the request's life, across preemption.
    fell_back_from: str | None = None
    #: worker: recall or its tier raised for this request (warned once; backends/recall.py)
    recall_failed: bool = False
    #: worker: per attention layer (the layer's key: its name)
    layers: dict[Hashable, LayerState] = field(default_factory=dict)

    def restart(self, shared: int) -> None:
        """A new attempt (the first, or after preemption) on a prefix-cache hit of ``shared`` tokens:
        what the last attempt computed (query windows, recall tiers) is gone."""
        self.shared = shared
        self.window_hit = 0
        self.layers.clear()

    def layer(self, key: Hashable) -> LayerState:
        st = self.layers.get(key)
        if st is None:
            st = self.layers[key] = LayerState()
        return st


class Registry:
    """request id -> :class:`RequestState`; one per side of vLLM in a process (:data:`ENGINE`, :data:`WORKER`)."""

    def __init__(self) -> None:
        self._states: dict[str, RequestState] = {}

    def open(self, request_id: str, settings: Callable[[], RequestSettings]) -> RequestState:
        """The request's state, made with ``settings()`` the first time the request is seen."""
        st = self._states.get(request_id)
        if st is None:
            st = self._states[request_id] = RequestState(settings())
        return st

    def get(self, request_id: str) -> RequestState | None:
        return self._states.get(request_id)

    def end(self, request_id: str) -> None:
        """The request is gone from this process: everything kept of it goes."""
        self._states.pop(request_id, None)

    def retain(self, live: Collection[str]) -> None:
        """Keep only the requests in ``live`` (a worker: those its model runner holds)."""
        if len(self._states) > len(live) or any(rid not in live for rid in self._states):
            for rid in [r for r in self._states if r not in live]:
                del self._states[rid]

    def clear(self) -> None:
        self._states.clear()

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._states

    def __len__(self) -> int:
        return len(self._states)

    def states(self) -> list[RequestState]:
        return list(self._states.values())

    def items(self) -> list[tuple[str, RequestState]]:
        return list(self._states.items())


#: The engine core's requests: from the scheduler's first look at a request to its end.
ENGINE = Registry()
#: A worker's requests: while its model runner holds them.
WORKER = Registry()
