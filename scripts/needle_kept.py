# SPDX-License-Identifier: Apache-2.0
"""Where a needle is lost: send one needle prompt under several configurations, one at a time, to a
kvevict server started with ``KVEVICT_DUMP_DIR`` (and ``--no-enable-prefix-caching``), and print,
per request, its answer and, at every compaction in the last ``--since`` prompt tokens (1,000), at the
prompt's end (``end``: after recall) and while decoding (``dec``), in how many (layer, KV head)
pairs the needle's value is kept whole / in part / of all pairs; with several needles (a
distractor key's, as in ``niah_multikey``), the asked one's first, then each other's whole count.

    KVEVICT_DUMP_DIR=/tmp/dump vllm serve MODEL --served-model-name model --port 8011 \\
        --attention-backend kvevict --dtype float32 --block-size 32 --enforce-eager \\
        --no-enable-prefix-caching --additional-config '{"kvevict": {"budget": 256}}'
    python scripts/needle_kept.py --dump /tmp/dump --task niah_single_varied --length 3200 \\
        --depth 0 --seed 1 --ratio 0.1 --configs none,keydiff:recall=true,snapkv:recall=true

docs/policies.md ("Where recall loses the needle") has what it showed.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re

from openai import OpenAI
from transformers import AutoTokenizer

from vllm_kvevict.bench.quality import spec_xargs
from vllm_kvevict.bench.tasks import TASKS
from vllm_kvevict.testing.models import smollm2_path


def value_tokens(tok, task):
    """The chat-templated prompt's tokens and, per needle value in it (the asked one first), the
    indices of its tokens."""
    text = tok.apply_chat_template(
        [{"role": "user", "content": task.prompt}], add_generation_prompt=True, tokenize=False
    )
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    vals = [task.answers[0]] + [v for v in re.findall(r"is: (\d+)\.", text) if v != task.answers[0]]
    out = []
    for val in vals:
        c0 = text.index(f"is: {val}") + 4
        c1 = c0 + len(val)
        out.append([i for i, (a, b) in enumerate(enc["offset_mapping"]) if a < c1 and b > c0])
    return enc, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8011")
    ap.add_argument("--dump", required=True, help="the server's KVEVICT_DUMP_DIR")
    ap.add_argument("--tokenizer", default=None, help="default: the bundled SmolLM2")
    ap.add_argument("--task", default="niah_single_varied")
    ap.add_argument("--length", type=int, default=3200)
    ap.add_argument("--depth", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--ratio", type=float, default=0.1, help="budget as a ratio of the prompt's tokens")
    ap.add_argument(
        "--since", type=int, default=1000, help="print the prompt's compactions within this many tokens of its end"
    )
    ap.add_argument("--configs", default="none,keydiff:recall=true", help="none or policy[:k=v;...], comma-separated")
    args = ap.parse_args()
    tok = AutoTokenizer.from_pretrained(args.tokenizer or str(smollm2_path()))
    cli = OpenAI(base_url=args.base_url.rstrip("/") + "/v1", api_key="unused", timeout=3600)
    task = TASKS[args.task](tok, args.length, args.depth, args.seed)
    enc, values = value_tokens(tok, task)
    vpos = values[0]
    n = len(enc["input_ids"])
    budget = max(1, round(args.ratio * n))
    print(f"{args.task} depth {args.depth} seed {args.seed}: {n} tokens, value at tokens {vpos}, budget {budget}")
    for spec in args.configs.split(","):
        sizes = {f: os.path.getsize(f) for f in glob.glob(f"{args.dump}/*.jsonl")}
        xargs = {"kvevict_enabled": False} if spec == "none" else spec_xargs(spec.replace(";", ","), budget)
        r = cli.chat.completions.create(
            model="model",
            messages=[{"role": "user", "content": task.prompt}],
            max_tokens=task.max_tokens,
            temperature=0,
            extra_body={"vllm_xargs": xargs},
        )
        out = r.choices[0].message.content or ""
        recs = []
        for f in glob.glob(f"{args.dump}/*.jsonl"):
            with open(f) as fh:
                fh.seek(sizes.get(f, 0))
                recs += [json.loads(line) for line in fh if line.strip()]
        by_L: dict[int, list] = {}
        for x in recs:
            if "kept" in x:
                by_L.setdefault(x["L"], []).append(x)
        cells = []
        for L in sorted(by_L):
            heads = [set(h) for x in by_L[L] for h in x["kept"]]
            whole = sum(all(p in h for p in vpos) for h in heads)
            part = sum(any(p in h for p in vpos) for h in heads)
            others = "".join(f",{sum(all(p in h for p in v) for h in heads)}" for v in values[1:])
            tag = "end" if L == n else ("dec" if L > n else "pre")
            if tag != "pre" or L >= n - args.since:
                cells.append(f"{tag}L{L}:{whole}/{part}/{len(heads)}{others}")
        print(f"  {spec:<28} score {task.score(out):.0f}  {out[-60:]!r}\n      " + " ".join(cells))


if __name__ == "__main__":
    main()
