# SPDX-License-Identifier: Apache-2.0
"""A Hugging Face transformers reference that evicts exactly the tokens the engine evicted.

The engine (with ``KVEVICT_DUMP_DIR`` set) records every compaction: after computing ``L`` tokens
of a request, layer ``l`` kept positions ``kept[h]`` for each KV head ``h``. :func:`replay` runs
the same model in transformers over the same tokens, cutting the input at each recorded ``L`` and
pruning each layer's ``DynamicCache`` to exactly those positions per head. Between compactions the
chunking does not matter (attention is causal and nothing is evicted), so each segment ends at a
compaction point: every query attends to what was kept plus its own chunk, as in the engine.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

Events = dict[int, dict[int, list[list[int]]]]  # {L: {layer: kept[h][j]}}


@dataclass
class Attempt:
    """One computation of a request: the first, or a recompute after preemption.

    A recompute re-prefills the prompt and the ``num_tokens - prompt_len`` tokens generated before
    it was preempted; tokens generated from then on come from this attempt.
    """

    num_tokens: int
    events: Events = field(default_factory=lambda: defaultdict(dict))


def load_attempts(dump_dir: str | Path) -> dict[str, list[Attempt]]:
    """``{req_id: [Attempt, ...]}`` from every worker's dump file, in order.

    Under tensor parallelism each rank records the KV heads it holds (``heads``: the model's
    indices); their kept sets are put together into one list per model KV head (a head replicated
    on several ranks must have been kept the same on each)."""
    per_rank: dict[int, dict[str, list[Attempt]]] = defaultdict(lambda: defaultdict(list))
    heads: dict[int, list[int]] = {}
    for path in sorted(Path(dump_dir).glob("kept-*.jsonl")):
        #: (L, window blocks) -> the attempt whose compaction at L made that window, latest first
        made: dict[tuple[int, tuple[int, ...]], Attempt] = {}
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            rank = rec.get("rank", 0)
            if rec.get("start"):
                att = Attempt(num_tokens=rec["num_tokens"])
                if rec.get("window_blocks"):
                    att.events.update(_window_history(made, rec))
                per_rank[rank][rec["req_id"]].append(att)
            else:
                att = per_rank[rank][rec["req_id"]][-1]
                att.events[rec["L"]][rec["layer"]] = rec["kept"]
                heads.setdefault(rank, rec.get("heads") or list(range(len(rec["kept"]))))
                if rec.get("blocks"):
                    made[(rec["L"], tuple(rec["blocks"]))] = att
    if len(per_rank) <= 1:
        return next(iter(per_rank.values()), defaultdict(list))
    return _merge_ranks(per_rank, heads)


def _window_history(made: dict, rec: dict) -> Events:
    """An attempt that starts on a cached compacted window at ``b`` (``window_point``; its
    ``shared`` tokens may go on into the window's tail) runs on what the compactions of the
    request that made the window kept: that request's events up to ``b`` (found by the window's
    physical blocks, which its compaction at ``b`` recorded)."""
    b = rec.get("window_point", rec["shared"])
    donor = made.get((b, tuple(rec["window_blocks"])))
    if donor is None:
        raise ValueError(f"{rec['req_id']} starts on a cached window at {b} that no recorded compaction made")
    return {L: dict(layers) for L, layers in donor.events.items() if L <= b}


def _merge_ranks(
    per_rank: dict[int, dict[str, list[Attempt]]], heads: dict[int, list[int]]
) -> dict[str, list[Attempt]]:
    ranks = sorted(per_rank)
    total = max(h for r in heads for h in heads[r]) + 1 if heads else 0
    merged: dict[str, list[Attempt]] = defaultdict(list)
    for req in per_rank[ranks[0]]:
        runs = [per_rank[r].get(req, []) for r in ranks]
        if len({len(a) for a in runs}) != 1:
            raise ValueError(f"{req}: ranks recorded different numbers of attempts: {[len(a) for a in runs]}")
        for atts in zip(*runs):
            if len({a.num_tokens for a in atts}) != 1 or len({tuple(sorted(a.events)) for a in atts}) != 1:
                raise ValueError(f"{req}: ranks disagree on an attempt's start or compaction points")
            out = Attempt(num_tokens=atts[0].num_tokens)
            for L, layers in atts[0].events.items():
                for layer in layers:
                    kept: list = [None] * total
                    for r, att in zip(ranks, atts):
                        for j, h in enumerate(heads.get(r, [])):
                            got = att.events[L][layer][j]
                            if kept[h] is not None and kept[h] != got:
                                raise ValueError(f"{req}: replicas of KV head {h} kept different tokens")
                            kept[h] = got
                    out.events[L][layer] = kept
            merged[req].append(out)
    return merged


def attempts_for(attempts: dict[str, list[Attempt]], request_id: str) -> list[Attempt]:
    """The attempts of the engine request whose id starts with the OpenAI response id."""
    matches = [k for k in attempts if k == request_id or k.startswith(request_id + "-")]
    if len(matches) > 1:
        raise KeyError(f"ambiguous request id {request_id}: {matches}")
    return attempts[matches[0]] if matches else []


def replay_attempts(
    model,
    prompt: list[int],
    generated: list[int],
    attempts: list[Attempt],
    make_check=None,
) -> torch.Tensor:
    """``[len(generated), vocab]`` log-probabilities, each from the attempt that generated the token.

    ``make_check``: a callable returning a fresh :class:`PolicyCheck` per attempt (or None).
    """
    ids = prompt + generated[:-1]
    P = len(prompt)
    rows = []
    for k, att in enumerate(attempts):
        first = att.num_tokens - P  # generated tokens already known when this attempt started
        last = attempts[k + 1].num_tokens - P if k + 1 < len(attempts) else len(generated)
        if last > first:
            if make_check is None:
                logp = replay(model, ids, att.events)
            else:
                with make_check() as check:
                    logp = replay(model, ids, att.events, check)
            rows.append(logp[P - 1 + first : P - 1 + last])
    return torch.cat(rows)


def cache_indices(cache_pos: torch.Tensor, kept: torch.Tensor, layer: int, L: int) -> torch.Tensor:
    """``[H, R]`` indices into the reference cache of the kept positions ``kept [H, R]``."""
    idx = torch.stack([torch.nonzero(cache_pos[h][None, :] == kept[h][:, None])[:, 1] for h in range(kept.shape[0])])
    if idx.shape != kept.shape:
        raise AssertionError(f"layer {layer}: kept positions not all in the reference cache at L={L}")
    return idx


class PolicyCheck:
    """Recomputes, from the reference's own tensors, what a policy keeps at each compaction.

    The engine decides *when* (the dumped events); at each event the reference builds the
    policy's :class:`~vllm_kvevict.policies.KVView` from transformers' cache, its own post-RoPE
    queries, its own per-entry state (H2O accumulators, LSH codes and victims, updated over every
    query it ran) and the model's ``o_proj``, runs the policy, and compares the kept positions with
    the engine's. Float scores may differ in the last bits, so a differing set is accepted only
    when the engine's choice is a top-``keep`` under the reference's scores within ``tol``.
    Merged vectors (KVMerger) come from the reference's own merge.
    """

    def __init__(self, model, policy, budget: int, tol: float = 1e-4, decode_policy=None, prompt_len: int = 0):
        self.model, self.policy, self.budget, self.tol = model, policy, budget, tol
        # recall.decode: once the prompt is complete the engine compacts with another policy
        self.prompt_policy, self.decode_policy, self.prompt_len = policy, decode_policy or policy, prompt_len
        cfg = model.config
        self.G = cfg.num_attention_heads // cfg.num_key_value_heads
        n_layers = cfg.num_hidden_layers
        self.state: list[dict[str, torch.Tensor]] = [{} for _ in range(n_layers)]
        self.qwin: list[torch.Tensor | None] = [None] * n_layers
        self.queries: dict[int, torch.Tensor] = {}
        self.compared = 0
        self.differing = 0  # events whose kept set differed within tolerance
        self._hooks: list = []

    def __enter__(self):
        import sys

        def hook(module, args, kwargs, _out):
            h = kwargs.get("hidden_states", args[0] if args else None)
            cos, sin = kwargs["position_embeddings"]
            rope = sys.modules[type(module).__module__].apply_rotary_pos_emb  # the model's own RoPE
            q = module.q_proj(h).view(*h.shape[:-1], -1, module.head_dim).transpose(1, 2)
            self.queries[module.layer_idx] = rope(q, q, cos, sin)[0][0]  # [H_q, m, d]

        for layer in self.model.model.layers:
            self._hooks.append(layer.self_attn.register_forward_hook(hook, with_kwargs=True))
        return self

    def __exit__(self, *exc):
        for h in self._hooks:
            h.remove()

    def _policy_at(self, L: int):
        """The policy the engine ran with in a step ending at ``L`` (decoding: past the prompt)."""
        self.policy = self.decode_policy if self.prompt_len and L > self.prompt_len else self.prompt_policy
        return self.policy

    def _view(self, i: int, layer, pos: torch.Tensor, L: int, q_pos: torch.Tensor):
        from vllm_kvevict.policies.base import KVView, step_queries

        attn = self.model.model.layers[i].self_attn
        W = attn.o_proj.weight.float()
        Q, q_sel = step_queries(self.policy.needs, self.queries[i].float(), q_pos)
        return KVView(
            K=layer.keys[0].float(),
            V=layer.values[0].float(),
            pos=pos,
            layer=i,
            G=self.G,
            L=L,
            Q=Q,
            q_pos=q_sel,
            scale=attn.scaling,
            sinks=attn.sinks.detach().float() if isinstance(getattr(attn, "sinks", None), torch.Tensor) else None,
            budget=self.budget,
            W_O=W.reshape(W.shape[0], -1, attn.head_dim).permute(1, 2, 0),
            state=self.state[i],
        )

    def after_segment(self, i: int, layer, pos: torch.Tensor, L: int, q_pos: torch.Tensor) -> None:
        """Every segment: the policy's per-entry state and query window, as the engine's steps did."""
        p = self._policy_at(L)
        H, n = pos.shape
        for name, (dtype, init) in {**self.prompt_policy.needs.state, **p.needs.state}.items():
            old = self.state[i].get(name)
            new = torch.full((H, n - (0 if old is None else old.shape[1])), init, dtype=dtype)
            self.state[i][name] = new if old is None else torch.cat([old, new], dim=1)
        w = max(p.needs.query_window, self.decode_policy.needs.query_window)  # the engine's buffer
        if w:
            q, prev = self.queries[i].float(), self.qwin[i]
            self.qwin[i] = (q if prev is None else torch.cat([prev, q], dim=1))[:, -w:]
        if p.needs.observes:
            p.observe(self._view(i, layer, pos, L, q_pos))

    def at_event(self, i: int, layer, pos: torch.Tensor, L: int, q_pos: torch.Tensor, kept_engine: torch.Tensor):
        """Check the engine's kept positions ``[H, keep]``; return (cache indices, merged K/V or None)."""
        self._policy_at(L)
        view = self._view(i, layer, pos, L, q_pos)
        if w := self.policy.needs.query_window:
            qwin = self.qwin[i]
            assert qwin is not None  # kept by every segment before (after_segment)
            view.Q = qwin[:, -w:]
            view.q_pos = torch.arange(L - view.Q.shape[1], L)
        keep = kept_engine.shape[1]
        kept_ref, merged = self.policy.evict(view, keep)
        ref_pos = torch.gather(pos, 1, kept_ref)
        idx = cache_indices(pos, kept_engine, i, L)
        self.compared += 1
        if not torch.equal(ref_pos, kept_engine):
            self._accept_near_tie(view, idx, keep, i, L, ref_pos, kept_engine, merged is not None)
            self.differing += 1
        if merged is not None:
            merged = (merged[0][None], merged[1][None])
        return idx, merged

    def _accept_near_tie(self, view, idx, keep, i, L, ref_pos, kept_engine, merges) -> None:
        detail = f"layer {i} at L={L}: engine kept {kept_engine.tolist()}, reference {ref_pos.tolist()}"
        if merges:
            raise AssertionError("kept sets differ: " + detail)
        s = self.policy.score(view).double()
        for h in range(s.shape[0]):
            mask = torch.zeros(s.shape[1], dtype=torch.bool)
            mask[idx[h]] = True
            lo, hi = s[h][mask].min(), s[h][~mask].max() if (~mask).any() else float("-inf")
            if lo < hi - self.tol * (1 + abs(float(hi))):
                raise AssertionError(f"kept sets differ beyond tolerance ({float(lo)} < {float(hi)}): " + detail)


def _complement(idx: torch.Tensor, n: int) -> torch.Tensor:
    """``[H, n - R]``: per row of ``idx [H, R]``, the indices of ``range(n)`` it does not hold."""
    keep = torch.zeros(idx.shape[0], n, dtype=torch.bool)
    keep.scatter_(1, idx, True)
    order = torch.argsort(keep.to(torch.int8), dim=1, stable=True)
    return order[:, : n - idx.shape[1]]


@torch.no_grad()
def replay(model, token_ids: list[int], events: Events, check: PolicyCheck | None = None) -> torch.Tensor:
    """Log-probabilities ``[len(token_ids), vocab]`` (row i predicts token i + 1) under eviction.

    With ``check``, the policy's decisions are recomputed from the reference's tensors at every
    event and compared with the engine's (see :class:`PolicyCheck`); merged entries come from it.
    """
    from transformers import DynamicCache

    n_layers = model.config.num_hidden_layers
    types = _layer_types(model.config)
    # Models with sliding-window layers (Gemma 2/3, gpt-oss): every layer's cache keeps all it
    # gets and each segment's masks are given per layer type (_masks): the engine evicts the
    # full-attention layers only, vLLM keeps the sliding ones to their window.
    cache: Any = DynamicCache() if types else DynamicCache(config=model.config)  # keys, values rewritten below
    full = [i for i in range(n_layers) if not types or types[i] == "full_attention"]
    cache_pos: list[torch.Tensor | None] = [None] * n_layers  # [H, n] position of each cache entry
    # What earlier events dropped, per layer ([1, H, n, d] keys and values, [H, n] positions): an
    # event may keep a dropped entry again (recall), with the KV it was computed with.
    dropped: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None] = [None] * n_layers
    cuts = sorted(L for L in events if L <= len(token_ids))
    bounds = sorted(set(cuts) | {len(token_ids)})
    out, start, n_cache = [], 0, 0
    for end in bounds:
        if end > start:
            ids = torch.tensor([token_ids[start:end]])
            pos = torch.arange(start, end)
            mixed = {"attention_mask": _masks(model.config, n_cache, start, end)} if types else {}
            res = model(
                input_ids=ids,
                position_ids=pos[None],
                past_key_values=cache,
                use_cache=True,
                cache_position=pos if types else torch.arange(n_cache, n_cache + end - start),
                **mixed,
            )
            out.append(torch.log_softmax(res.logits[0].float(), dim=-1))
            n_cache += end - start
            for i in range(n_layers):
                H = cache.layers[i].keys.shape[1]
                seg, prev = pos[None, :].expand(H, -1), cache_pos[i]
                cache_pos[i] = cp = seg if prev is None else torch.cat([prev, seg], dim=1)
                if check is not None:
                    check.after_segment(i, cache.layers[i], cp, end, pos)
            seg_pos = pos
            start = end
        if end in events:
            for i, kept in events[end].items():
                kept_t = torch.tensor(kept)  # [H, R] positions
                layer, cpos, drop = cache.layers[i], cache_pos[i], dropped[i]
                assert cpos is not None  # every event follows a segment
                merged = None
                # per head: a position one head takes back may be in another head's cache
                recalls = drop is not None and not all(bool(torch.isin(k, c).all()) for k, c in zip(kept_t, cpos))
                if drop is not None and recalls:  # the window takes back entries an earlier event dropped
                    keys = torch.cat([layer.keys, drop[0]], dim=2)
                    values = torch.cat([layer.values, drop[1]], dim=2)
                    pos_all = torch.cat([cpos, drop[2]], dim=1)
                else:
                    keys, values, pos_all = layer.keys, layer.values, cpos
                if check is not None and not recalls:
                    idx, merged = check.at_event(i, layer, cpos, end, seg_pos, kept_t)
                else:
                    idx = cache_indices(pos_all, kept_t, i, end)
                d = layer.keys.shape[-1]
                gidx = idx[None, :, :, None].expand(1, -1, -1, d)
                rest = _complement(idx, pos_all.shape[1])  # [H, n - R]: what this event drops
                ridx = rest[None, :, :, None].expand(1, -1, -1, d)
                new = (torch.gather(keys, 2, ridx), torch.gather(values, 2, ridx), torch.gather(pos_all, 1, rest))
                if drop is not None and not recalls:  # pos_all did not include the earlier ones
                    new = (
                        torch.cat([drop[0], new[0]], dim=2),
                        torch.cat([drop[1], new[1]], dim=2),
                        torch.cat([drop[2], new[2]], dim=1),
                    )
                dropped[i] = new
                if merged is not None:
                    layer.keys, layer.values = merged[0].to(layer.keys.dtype), merged[1].to(layer.values.dtype)
                else:
                    layer.keys = torch.gather(keys, 2, gidx)
                    layer.values = torch.gather(values, 2, gidx)
                if check is not None and not recalls:
                    for name, t in check.state[i].items():
                        check.state[i][name] = torch.gather(t, 1, idx)
                cache_pos[i] = torch.gather(pos_all, 1, idx)
            n_cache = cache.layers[full[0]].keys.shape[2]
            if any(cache.layers[i].keys.shape[2] != n_cache for i in full):
                raise AssertionError("layers kept different counts")
    return torch.cat(out)


def _layer_types(config) -> list[str] | None:
    """The model's ``layer_types`` when some layer is not full attention (None: all are)."""
    types = getattr(config, "layer_types", None)
    return list(types) if types and any(t != "full_attention" for t in types) else None


def _masks(config, n_full: int, start: int, end: int) -> dict[str, torch.Tensor]:
    """Additive masks ``[1, 1, end - start, keys]`` for the segment ``[start, end)``, by layer type:
    a full-attention layer reads its ``n_full`` kept entries and the segment causally; a
    sliding-window layer holds every token so far and reads those within its window
    (``0 <= p_q - p_k < sliding_window``, as vLLM's sliding-window attention)."""
    q = torch.arange(start, end)[:, None]
    seg = torch.arange(start, end)[None, :]
    full = torch.cat([torch.ones(end - start, n_full, dtype=torch.bool), seg <= q], dim=1)
    k = torch.arange(end)[None, :]
    sliding = (k <= q) & (q - k < config.sliding_window)

    def additive(allowed: torch.Tensor) -> torch.Tensor:
        return torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))[None, None]

    return {"full_attention": additive(full), "sliding_attention": additive(sliding)}
