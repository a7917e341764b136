# SPDX-License-Identifier: Apache-2.0
"""Transformers-only check behind docs/policies.md: one-shot SnapKV (window 32, avg-pool 7, group
mean) at 25 % of a ~2K-token niah_single prompt (depth 0.5, seed 1) on SmolLM2, no vLLM involved.
Prints, per layer, how many KV heads keep the needle's first digit token, then the greedy answer
generated from the pruned cache.

    .venv/bin/python scripts/snapkv_oneshot_check.py
"""

from typing import Any

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from vllm_kvevict.bench.tasks import niah_single
from vllm_kvevict.testing.models import smollm2_path

W, RATIO = 32, 0.25


@torch.no_grad()
def main() -> None:
    path = smollm2_path()
    tok = AutoTokenizer.from_pretrained(path)
    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    t = niah_single(tok, 2000, 0.5, 1)
    text = tok.apply_chat_template([{"role": "user", "content": t.prompt}], add_generation_prompt=True, tokenize=False)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    n = len(ids)
    val = tok(" " + t.answer, add_special_tokens=False)["input_ids"]
    needle = next(i for i in range(n) if ids[i : i + len(val)] == val)
    budget = round(RATIO * n)
    G = m.config.num_attention_heads // m.config.num_key_value_heads
    cache: Any = DynamicCache(config=m.config)  # its layers read below
    out = m(torch.tensor([ids]), past_key_values=cache, use_cache=True, output_attentions=True)
    kept_needle = []
    for layer, A in zip(cache.layers, out.attentions):
        s = A[0, :, -W:, :].mean(1)  # [H_q, n]: mean over the window's queries
        pre = n - W
        pooled = F.avg_pool1d(s[:, None, :pre], 7, 1, 3)[:, 0]
        pooled = pooled.view(-1, G, pre).mean(1)  # [H_kv, pre]
        top = pooled.topk(budget - W, dim=-1).indices.sort(-1).values
        kept_needle.append(int((top == needle).any(-1).sum()))
        idx = torch.cat([top, torch.arange(pre, n).expand(top.shape[0], -1)], dim=1)
        g = idx[None, :, :, None].expand(1, -1, -1, layer.keys.shape[-1])
        layer.keys, layer.values = torch.gather(layer.keys, 2, g), torch.gather(layer.values, 2, g)
    print(f"prompt {n} tokens, budget {budget}, needle {t.answer} at token {needle}")
    print("KV heads keeping the needle's first digit, per layer:", kept_needle, "total", sum(kept_needle))
    nxt, gen, L = int(out.logits[0, -1].argmax()), [], n
    for _ in range(24):
        gen.append(nxt)
        o = m(
            torch.tensor([[nxt]]),
            position_ids=torch.tensor([[L]]),
            past_key_values=cache,
            use_cache=True,
            cache_position=torch.tensor([cache.layers[0].keys.shape[2]]),
        )
        L, nxt = L + 1, int(o.logits[0, -1].argmax())
    print("answer with one-shot SnapKV:", repr(tok.decode(gen)))


if __name__ == "__main__":
    main()
