# SPDX-License-Identifier: Apache-2.0
"""A small model's layers driven step by step through the plugin's per-layer path (the plan,
``LayerEviction.before``/``after``), without vLLM's model: what the attention backend does around
vLLM's attention in every layer of a real step, on a paged cache the test owns. The step's K/V
and queries are random (the layers' math is tested elsewhere); the schedule is a real one:
chunked prompts of ragged lengths, each completing in its own step, then decoding.

Used to watch what the eviction step asks of the device (tests/test_step_syncs.py): that it never
waits for it, and how many operations it queues per layer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from vllm_kvevict.backends.flash_layout import FLASH_LAYOUT
from vllm_kvevict.backends.layer import LayerEviction
from vllm_kvevict.backends.layout import Heads
from vllm_kvevict.backends.plan import StepPlan, plan_step
from vllm_kvevict.config import parse_config
from vllm_kvevict.request import WORKER
from vllm_kvevict.vllm_compat.runner import RunnerStep

BS, H, G, D = 32, 2, 2, 16


@dataclass
class Request:
    rid: str
    prompt: int
    policy: str
    recall: bool | None = None  # None: the server's setting
    done: int = 0  # tokens computed
    blocks: list[int] = field(default_factory=list)

    def extra(self, budget: int) -> dict:
        return {
            "kvevict_policy": self.policy,
            "kvevict_budget": budget,
            **({} if self.recall is None else {"kvevict_recall": self.recall}),
        }


class Driver:
    """``layers`` attention layers over one paged cache each (vLLM's FlashAttention layout,
    ``[blocks, H, block_size, 2 D]``), serving ``requests`` with a server configuration."""

    def __init__(
        self,
        requests: list[Request],
        server: dict,
        layers: int = 2,
        budget: int = 64,
        seed: int = 0,
        heads: Heads | None = None,
    ):
        self.requests, self.budget = requests, budget
        self.server = parse_config(server)
        self.g = torch.Generator().manual_seed(seed)
        longest = max(r.prompt for r in requests) + 64
        per_req = -(-longest // BS)
        nb = 1 + per_req * len(requests)
        self.caches = [torch.zeros(nb, H, BS, 2 * D) for _ in range(layers)]
        for i, r in enumerate(requests):
            r.blocks = list(range(1 + i * per_req, 1 + (i + 1) * per_req))
        self.width = per_req
        heads = heads or Heads(H * G, H, D**-0.5)
        self.layers = [LayerEviction(FLASH_LAYOUT, heads, f"model.layers.{i}.attn", i) for i in range(layers)]
        #: per layer, each step's (positions, queries, keys, values, output), as the layer saw them
        self.seen: list[list[tuple[torch.Tensor, ...]]] = [[] for _ in range(layers)]
        for layer in self.layers:  # W_O, as the model would give it (CriticalKV, CAOTE read it)
            layer._w_o = torch.randn(H * G, D, 64, generator=self.g)
        self._started: set[str] = set()

    def fell_back(self) -> list[str]:
        """The requests whose policy or recall failed (the step did not run for them as asked)."""
        out = []
        for r in self.requests:
            st = WORKER.get(r.rid)
            if st is not None and (st.fell_back_from is not None or st.recall_failed):
                out.append(f"{r.rid}: {st.fell_back_from or 'recall'}")
        return out

    def close(self) -> None:
        for r in self.requests:
            WORKER.end(r.rid)

    def step(
        self, tokens: dict[str, int], watch: Callable[[int], contextlib.AbstractContextManager] | None = None
    ) -> StepPlan:
        """One step computing ``tokens[rid]`` new tokens of each listed request, through every
        layer; ``watch(layer)`` wraps each layer's work (before and after its attention)."""
        rows = [r for r in self.requests if r.rid in tokens]
        seq = [r.done + tokens[r.rid] for r in rows]
        q = [tokens[r.rid] for r in rows]
        qsl = torch.tensor([0, *torch.tensor(q).cumsum(0).tolist()], dtype=torch.int32)
        table = torch.tensor([r.blocks for r in rows], dtype=torch.int32)
        pos = torch.cat([torch.arange(r.done, L) for r, L in zip(rows, seq)])
        slots = torch.cat(
            [
                table[i][torch.arange(r.done, L) // BS].long() * BS + torch.arange(r.done, L) % BS
                for i, (r, L) in enumerate(zip(rows, seq))
            ]
        )
        cm = SimpleNamespace(
            num_reqs=len(rows),
            num_actual_tokens=int(qsl[-1]),
            seq_lens=torch.tensor(seq, dtype=torch.int32),
            query_start_loc_cpu=qsl,
            block_table_tensor=table,
            slot_mapping=slots,
            positions=pos,
        )
        ids = [r.rid for r in rows]
        starts = frozenset(i for i in ids if i not in self._started)
        self._started |= starts
        step = RunnerStep(
            req_ids=ids,
            prompt_lens=[r.prompt for r in rows],
            num_tokens=seq,
            extra_args=[r.extra(self.budget) for r in rows],
            live=frozenset(r.rid for r in self.requests),
            starts=starts,
        )
        plan = plan_step(cm, self.server, BS, step)
        T = int(qsl[-1])
        for i, (layer, cache) in enumerate(zip(self.layers, self.caches)):
            query = torch.randn(T, H * G, D, generator=self.g)
            k, v = torch.randn(T, H, D, generator=self.g), torch.randn(T, H, D, generator=self.g)
            kv = cache.view(-1, H, BS, 2 * D)
            blk, off = slots // BS, slots % BS
            kv[blk, :, off, :D], kv[blk, :, off, D:] = k, v  # vLLM writes the step's KV before attention
            out = torch.randn(T, H * G * D, generator=self.g)
            with watch(i) if watch is not None else contextlib.nullcontext():
                layer.before(query, cache, plan)  # then vLLM's attention, unless recall's replaces it
                attended = layer.attend_instead(query, cache, plan, out)
                layer.after(query, cache, plan, out, attended)
            self.seen[i].append((pos, query, k, v, out))
        for r, L in zip(rows, seq):
            r.done = L
        return plan

    def schedule(self, chunk: int, decodes: int) -> Iterator[dict[str, int]]:
        """Chunked prefill of every request (``chunk`` tokens a step, each prompt's last chunk
        ragged), then ``decodes`` decoding steps of all."""
        while any(r.done < r.prompt for r in self.requests):
            yield {r.rid: min(chunk, r.prompt - r.done) for r in self.requests if r.done < r.prompt}
        for _ in range(decodes):
            yield {r.rid: 1 for r in self.requests}
