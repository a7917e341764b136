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
from pathlib import Path

import torch


def load_events(dump_dir: str | Path) -> dict[str, dict[int, dict[int, list[list[int]]]]]:
    """``{req_id: {L: {layer: kept[h][j]}}}`` from every worker's dump file."""
    events: dict[str, dict[int, dict[int, list[list[int]]]]] = defaultdict(lambda: defaultdict(dict))
    for path in sorted(Path(dump_dir).glob("kept-*.jsonl")):
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            events[rec["req_id"]][rec["L"]][rec["layer"]] = rec["kept"]
    return events


def events_for(events, request_id: str) -> dict[int, dict[int, list[list[int]]]]:
    """The events of the engine request whose id starts with the OpenAI response id."""
    matches = [k for k in events if k == request_id or k.startswith(request_id + "-")]
    if len(matches) > 1:
        raise KeyError(f"ambiguous request id {request_id}: {matches}")
    return events[matches[0]] if matches else {}


@torch.no_grad()
def replay(model, token_ids: list[int], events: dict[int, dict[int, list[list[int]]]]) -> torch.Tensor:
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
