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
    """``{req_id: [Attempt, ...]}`` from every worker's dump file, in order."""
    attempts: dict[str, list[Attempt]] = defaultdict(list)
    for path in sorted(Path(dump_dir).glob("kept-*.jsonl")):
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            if rec.get("start"):
                attempts[rec["req_id"]].append(Attempt(num_tokens=rec["num_tokens"]))
            else:
                attempts[rec["req_id"]][-1].events[rec["L"]][rec["layer"]] = rec["kept"]
    return attempts


def attempts_for(attempts: dict[str, list[Attempt]], request_id: str) -> list[Attempt]:
    """The attempts of the engine request whose id starts with the OpenAI response id."""
    matches = [k for k in attempts if k == request_id or k.startswith(request_id + "-")]
    if len(matches) > 1:
        raise KeyError(f"ambiguous request id {request_id}: {matches}")
    return attempts[matches[0]] if matches else []


def replay_attempts(model, prompt: list[int], generated: list[int], attempts: list[Attempt]) -> torch.Tensor:
    """``[len(generated), vocab]`` log-probabilities, each from the attempt that generated the token."""
    ids = prompt + generated[:-1]
    P = len(prompt)
    rows = []
    for k, att in enumerate(attempts):
        first = att.num_tokens - P  # generated tokens already known when this attempt started
        last = attempts[k + 1].num_tokens - P if k + 1 < len(attempts) else len(generated)
        if last > first:
            logp = replay(model, ids, att.events)
            rows.append(logp[P - 1 + first: P - 1 + last])
    return torch.cat(rows)


@torch.no_grad()
def replay(model, token_ids: list[int], events: Events) -> torch.Tensor:
    """Log-probabilities ``[len(token_ids), vocab]`` (row i predicts token i + 1) under eviction."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    n_layers = model.config.num_hidden_layers
    cache_pos: list[torch.Tensor | None] = [None] * n_layers  # [H, n] position of each cache entry
    cuts = sorted(L for L in events if L <= len(token_ids))
    bounds = sorted(set(cuts) | {len(token_ids)})
    out, start, n_cache = [], 0, 0
    for end in bounds:
        if end > start:
            ids = torch.tensor([token_ids[start:end]])
            pos = torch.arange(start, end)
            res = model(
                input_ids=ids, position_ids=pos[None], past_key_values=cache, use_cache=True,
                cache_position=torch.arange(n_cache, n_cache + end - start),
            )
            out.append(torch.log_softmax(res.logits[0].float(), dim=-1))
            n_cache += end - start
            for i in range(n_layers):
                H = cache.layers[i].keys.shape[1]
                new = pos[None, :].expand(H, -1)
                cache_pos[i] = new if cache_pos[i] is None else torch.cat([cache_pos[i], new], dim=1)
            start = end
        if end in events:
            for i, kept in events[end].items():
                kept_t = torch.tensor(kept)  # [H, R] positions
                idx = torch.stack([
                    torch.nonzero(cache_pos[i][h][None, :] == kept_t[h][:, None])[:, 1] for h in range(kept_t.shape[0])
                ])
                if idx.shape != kept_t.shape:
                    raise AssertionError(f"layer {i}: kept positions not all in the reference cache at L={end}")
                layer = cache.layers[i]
                gidx = idx[None, :, :, None].expand(1, -1, -1, layer.keys.shape[-1])
                layer.keys = torch.gather(layer.keys, 2, gidx)
                layer.values = torch.gather(layer.values, 2, gidx)
                cache_pos[i] = torch.gather(cache_pos[i], 1, idx)
            n_cache = cache.layers[0].keys.shape[2]
            if any(cache.layers[i].keys.shape[2] != n_cache for i in range(n_layers)):
                raise AssertionError("layers kept different counts")
    return torch.cat(out)
