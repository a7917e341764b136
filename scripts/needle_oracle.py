# SPDX-License-Identifier: Apache-2.0
"""Recall's selection with nothing evicted: for needle prompts, run the model in transformers on the
whole prompt, score every token by the attention of the prompt's last 32 queries (recall's score:
softmax over all keys, summed over the queries, averaged over each KV head's query group, max-pooled
over ``kernel`` positions) and variants of it, keep as many tokens per KV head as the window holds at
the prompt's end, and print in how many (layer, KV head) pairs the needle's value is kept whole.
An upper bound on what recall's queries can find when eviction has not changed them.

    python scripts/needle_oracle.py --length 3200 --ratio 0.1 --depths 0,0.25,0.5 --seeds 1,2

docs/policies.md ("Where recall loses the needle") has what it showed.
"""

from __future__ import annotations

import argparse

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from vllm_kvevict.bench.tasks import TASKS
from vllm_kvevict.testing.models import smollm2_path

W = 32  # recall.window


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: the bundled SmolLM2")
    ap.add_argument("--task", default="niah_single_varied")
    ap.add_argument("--length", type=int, default=3200)
    ap.add_argument("--ratio", type=float, default=0.1)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--depths", default="0,0.25,0.5")
    ap.add_argument("--seeds", default="1,2")
    args = ap.parse_args()
    path = args.model or str(smollm2_path())
    tok = AutoTokenizer.from_pretrained(path)
    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for d in map(float, args.depths.split(",")):
        for s in map(int, args.seeds.split(",")):
            task = TASKS[args.task](tok, args.length, d, s)
            text = tok.apply_chat_template(
                [{"role": "user", "content": task.prompt}], add_generation_prompt=True, tokenize=False
            )
            enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
            n = len(enc["input_ids"])
            val = task.answers[0]
            c0 = text.index(f"is: {val}") + 4
            vpos = [i for i, (a, b) in enumerate(enc["offset_mapping"]) if a < c0 + len(val) and b > c0]
            # the window at the prompt's end: the budget rounded up to a block (the stride), plus the
            # tokens since the last compaction point
            stride = -(-round(args.ratio * n) // args.block_size) * args.block_size
            keep = stride + n % stride
            kept: dict[str, int] = {}
            with torch.no_grad():
                hidden = m(torch.tensor([enc["input_ids"]]), output_hidden_states=True).hidden_states
                pid = torch.arange(n)[None]
                for li, layer in enumerate(m.model.layers):
                    h = layer.input_layernorm(hidden[li])
                    at = layer.self_attn
                    q = at.q_proj(h).view(1, n, -1, at.head_dim).transpose(1, 2)
                    k = at.k_proj(h).view(1, n, -1, at.head_dim).transpose(1, 2)
                    q, k = apply_rotary_pos_emb(q, k, *m.model.rotary_emb(h, pid))
                    q, k = q[0, :, -W:], k[0]
                    G = q.shape[0] // k.shape[0]
                    logits = q @ k.repeat_interleave(G, 0).transpose(1, 2) * at.scaling
                    causal = torch.arange(n)[None] > torch.arange(n - W, n)[:, None]
                    P = logits.masked_fill(causal, float("-inf")).softmax(-1)
                    for name, a, group, kernel in (
                        ("recall (sum, group mean, 31)", P.sum(1), "mean", 31),
                        ("sum, group max, 31", P.sum(1), "max", 31),
                        ("max over queries, group max, 31", P.amax(1), "max", 31),
                        ("sum, group mean, 15", P.sum(1), "mean", 15),
                        ("sum, group mean, 7", P.sum(1), "mean", 7),
                    ):
                        sc = a.view(k.shape[0], G, n)
                        sc = sc.mean(1) if group == "mean" else sc.amax(1)
                        sc = torch.nn.functional.max_pool1d(sc[:, None], kernel, 1, kernel // 2)[:, 0]
                        sc[:, n - W :] = float("inf")
                        top = sc.topk(keep, dim=-1).indices
                        kept[name] = kept.get(name, 0) + sum(all(p in set(t.tolist()) for p in vpos) for t in top)
            heads = len(m.model.layers) * m.config.num_key_value_heads
            print(f"depth {d} seed {s} ({n} tokens, {keep} kept per head): value kept whole in", flush=True)
            for name, c in kept.items():
                print(f"  {name:<34} {c}/{heads}")


if __name__ == "__main__":
    main()
