# SPDX-License-Identifier: Apache-2.0
"""Recall's selection with nothing evicted: for needle prompts, run the model in transformers on the
whole prompt, score every token by the attention of the prompt's last 32 queries (recall's score:
softmax over all keys, summed over the queries, averaged over each KV head's query group, max-pooled
over ``kernel`` positions) and variants of it, keep as many tokens per KV head as the window holds at
the prompt's end, and print in how many (layer, KV head) pairs the needle's value is kept whole
(with several needles, as in ``niah_multikey``: the asked one's count, then each distractor's).
An upper bound on what recall's queries can find when eviction has not changed them.

With ``--generate``, each selection also answers: the prompt's last 32 tokens and the answer attend
only to the kept tokens of each (layer, KV head) (and to those 32), the rest of the prompt computed
in full; two controls answer beside them: nothing evicted, and recall's selection with the asked
needle's sentence kept in every pair (``needle forced``): whether the selection, not the budget,
loses the answer.

    python scripts/needle_oracle.py --length 3200 --ratio 0.1 --depths 0,0.25,0.5 --seeds 1,2
    python scripts/needle_oracle.py --task niah_multikey --length 7500 --depths 0.5 --seeds 2 --generate

docs/policies.md ("Where recall loses the needle", "Recall grid") has what it showed.
"""

from __future__ import annotations

import argparse
import copy
import re

import torch
from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from vllm_kvevict.bench.tasks import TASKS
from vllm_kvevict.testing.models import smollm2_path

W = 32  # recall.window
FORCED = "needle forced"
# per layer: [H, keep] kept positions, and the prompt's length; None: attention as usual
RESTRICT: dict = {"kept": None, "n": 0, "tail": W}


def restricted_attention(module, query, key, value, attention_mask, **kw):
    """SDPA where, with ``RESTRICT["kept"]`` set, each KV head attends only to its kept positions of
    the prompt and to the prompt's last ``RESTRICT["tail"]`` tokens and everything after (causal)."""
    kept = RESTRICT["kept"]
    if kept is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kw)
    H, kv, q = key.shape[1], key.shape[2], query.shape[2]
    allowed = torch.zeros(H, kv, dtype=torch.bool)
    allowed[:, RESTRICT["n"] - RESTRICT["tail"] :] = True
    allowed[torch.arange(H)[:, None], kept[module.layer_idx]] = True
    causal = torch.arange(kv)[None, :] <= torch.arange(kv - q, kv)[:, None]  # [q, kv]
    ok = allowed.repeat_interleave(query.shape[1] // H, 0)[:, None, :] & causal[None]
    mask = torch.zeros(ok.shape, dtype=query.dtype).masked_fill(~ok, float("-inf"))[None]
    kw.pop("is_causal", None)
    return sdpa_attention_forward(module, query, key, value, mask, **kw)


AttentionInterface.register("kvevict_oracle", restricted_attention)


def needles(tok, task):
    """The chat-templated prompt's encoding; per needle value (the asked one first) its token
    indices; the asked needle's whole sentence's token indices."""
    text = tok.apply_chat_template(
        [{"role": "user", "content": task.prompt}], add_generation_prompt=True, tokenize=False
    )
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    offs = enc["offset_mapping"]
    span = lambda c0, c1: [i for i, (a, b) in enumerate(offs) if a < c1 and b > c0]  # noqa: E731
    asked = task.answers[0]
    vals = [asked] + [v for v in re.findall(r"is: (\d+)\.", text) if v != asked]
    vpos = [span(text.index(f"is: {v}") + 4, text.index(f"is: {v}") + 4 + len(v)) for v in vals]
    end = text.index(f"is: {asked}") + 5 + len(asked)
    sentence = span(text.rindex("One of the special magic numbers", 0, end), end)
    return enc, vpos, sentence


def answer(m, tok, cache, ids, n, kept, max_tokens: int, tail: int) -> str:
    """Greedy answer with the prompt's last ``tail`` tokens and the answer restricted to ``kept``."""
    cache = copy.deepcopy(cache)
    RESTRICT.update(kept=kept, n=n, tail=tail)
    try:
        out = m(torch.tensor([ids[n - tail :]]), past_key_values=cache, use_cache=True)
        toks = []
        for _ in range(max_tokens):
            nxt = int(out.logits[0, -1].argmax())
            if nxt == tok.eos_token_id:
                break
            toks.append(nxt)
            out = m(torch.tensor([[nxt]]), past_key_values=cache, use_cache=True)
    finally:
        RESTRICT.update(kept=None)
    return tok.decode(toks)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: the bundled SmolLM2")
    ap.add_argument("--task", default="niah_single_varied")
    ap.add_argument("--length", type=int, default=3200)
    ap.add_argument("--ratio", type=float, default=0.1)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--depths", default="0,0.25,0.5")
    ap.add_argument("--seeds", default="1,2")
    ap.add_argument("--generate", action="store_true", help="answer under each selection (and the controls)")
    ap.add_argument(
        "--tail",
        type=int,
        default=W,
        help="with --generate: the prompt's last tokens that attend to the kept set only (the server's last "
        "chunk attends to the window recall chose before its attention; default: recall's 32 queries)",
    )
    args = ap.parse_args()
    path = args.model or str(smollm2_path())
    tok = AutoTokenizer.from_pretrained(path)
    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="kvevict_oracle").eval()
    for d in map(float, args.depths.split(",")):
        for s in map(int, args.seeds.split(",")):
            task = TASKS[args.task](tok, args.length, d, s)
            enc, vpos, sentence = needles(tok, task)
            ids = enc["input_ids"]
            n = len(ids)
            # the window at the prompt's end: the budget rounded up to a block (the stride), plus the
            # tokens since the last compaction point
            stride = -(-round(args.ratio * n) // args.block_size) * args.block_size
            keep = stride + n % stride
            kept: dict[str, list[int]] = {}
            sets: dict[str, dict[int, torch.Tensor]] = {}
            with torch.no_grad():
                hidden = m(torch.tensor([ids]), output_hidden_states=True).hidden_states
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
                        (FORCED, P.sum(1), "mean", 31),
                    ):
                        sc = a.view(k.shape[0], G, n)
                        sc = sc.mean(1) if group == "mean" else sc.amax(1)
                        sc = torch.nn.functional.max_pool1d(sc[:, None], kernel, 1, kernel // 2)[:, 0]
                        sc[:, n - W :] = float("inf")
                        if name == FORCED:
                            sc[:, sentence] = float("inf")
                        top = sc.topk(keep, dim=-1).indices
                        sets.setdefault(name, {})[li] = top
                        heads = [set(t.tolist()) for t in top]
                        counts = [sum(all(p in hs for p in v) for hs in heads) for v in vpos]
                        kept[name] = [a + b for a, b in zip(kept.get(name, [0] * len(vpos)), counts)]
            heads = len(m.model.layers) * m.config.num_key_value_heads
            print(f"{args.task} depth {d} seed {s} ({n} tokens, {keep} kept per head): value kept whole in", flush=True)
            for name, c in kept.items():
                others = f" (distractors: {', '.join(map(str, c[1:]))})" if len(c) > 1 else ""
                print(f"  {name:<34} {c[0]}/{heads}{others}", flush=True)
            if args.generate:
                with torch.no_grad():
                    cache = DynamicCache()
                    m(torch.tensor([ids[: n - args.tail]]), past_key_values=cache, use_cache=True)
                    everything = torch.arange(n)[None].expand(m.config.num_key_value_heads, n)
                    full = dict.fromkeys(range(len(m.model.layers)), everything)
                    for name, kept_sets in [("nothing evicted", full), *sets.items()]:
                        text = answer(m, tok, cache, ids, n, kept_sets, task.max_tokens, args.tail)
                        print(f"  answers {name:<34} score {task.score(text):.0f}  {text[-60:]!r}", flush=True)


if __name__ == "__main__":
    main()
