# SPDX-License-Identifier: Apache-2.0
"""``kvevict-bench`` (also ``python -m vllm_kvevict.bench``): quality, throughput and memory.

    kvevict-bench quality --preset smoke            # retrieval accuracy per policy and budget
    kvevict-bench throughput --preset smoke         # stock vLLM vs kvevict at equal KV memory
    kvevict-bench memory --preset smoke             # KV blocks over time for one long request
    kvevict-bench overhead --preset smoke           # time in eviction per step, per policy
    kvevict-bench prefix --preset smoke             # prefix caching: shared prefixes, multi-turn chat

Each subcommand prints a table and writes ``<out>/<name>.json`` and ``<out>/<name>.png``. A preset
(``smoke``: a few minutes on a 2-core CPU; ``full``: the numbers in docs/benchmarks.md; for
``quality`` also ``policies``: every policy, the table of docs/policies.md) fills every option the
command line leaves unset. Without ``--base-url`` (quality) the benchmarks start vLLM
themselves on ``--model`` (default: the bundled SmolLM2-135M-Instruct).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

ALL_TASKS = "niah_single,niah_multikey,niah_multivalue,niah_multiquery,kv_retrieval,variable_tracking,common_words"
ALL_POLICIES = (
    "keydiff,streamingllm,snapkv,tova,h2o,knorm,random,criticalkv,kvmerger,lshe,caote,caote:base=tova,"
    "caote:base=snapkv,fastcaote,fastcaote:base=tova,fastcaote:base=snapkv"
)

# CriticalKV evicts once, at the prompt's end, by default (nothing to recall then): chunked here, as
# every other policy. KVMerger merges what it drops into what it keeps: nothing to recall either.
_RECALL_POLICIES = (
    "keydiff",
    "snapkv",
    "tova",
    "h2o",
    "streamingllm",
    "knorm",
    "random",
    "criticalkv:trigger=chunked",
    "lshe",
    "caote",
    "fastcaote",
)
RECALL_CONFIGS = ",".join(
    [*_RECALL_POLICIES, "kvmerger", *(f"{p}{';' if ':' in p else ':'}recall=true" for p in _RECALL_POLICIES)]
)

PRESETS = {
    "quality": {
        "smoke": {
            "configs": "keydiff,streamingllm",
            "budget_ratios": "0.25",
            "budgets": "",
            "tasks": "niah_single",
            "length": "1000",
            "depths": 2,
            "seeds": "1",
        },
        "full": {
            "configs": "keydiff,snapkv,streamingllm",
            "budget_ratios": "0.25,0.5",
            "budgets": "",
            "tasks": ALL_TASKS,
            "length": "1000,2000",
            "depths": 2,
            "seeds": "1",
        },
        # every policy with and without recall on varied-haystack needles (docs/policies.md, "Recall")
        "recall": {
            "configs": RECALL_CONFIGS,
            "budget_ratios": "0.1,0.25,0.5",
            "budgets": "",
            "tasks": "niah_single_varied,niah_multikey",
            "length": "3200",
            "depths": 3,
            "seeds": "1",
        },
        # issue 26's grid: every policy that drops tokens, with and without recall, at 5, 10 and 25 % of
        # ~3,000- and ~7,500-token prompts, 20 prompts per task and length (run it in parts: --rows)
        "recall-grid": {
            "configs": RECALL_CONFIGS.replace(",kvmerger", ""),
            "budget_ratios": "0.05,0.1,0.25",
            "budgets": "",
            "tasks": "niah_single_varied,niah_multikey",
            "length": "3000,7500",
            "depths": 5,
            "seeds": "1,2,3,4",
        },
        # every policy on the two needle tasks: the table of docs/policies.md
        "policies": {
            "configs": ALL_POLICIES,
            "budget_ratios": "0.1,0.25",
            "budgets": "",
            "tasks": "niah_single,niah_multikey",
            "length": "2000",
            "depths": 4,
            "seeds": "1",
        },
    },
    "throughput": {
        "smoke": {
            "num_requests": 4,
            "prompt_len": 512,
            "output_len": 32,
            "kv_prompts": 1,
            "budget_ratios": "0.25",
            "policy": "keydiff",
            "max_num_batched_tokens": 256,
        },
        # decode-heavy and KV-limited: stock vLLM has room for one whole sequence
        "full": {
            "num_requests": 8,
            "prompt_len": 512,
            "output_len": 1024,
            "kv_prompts": 1,
            "budget_ratios": "0.25,0.5",
            "policy": "keydiff",
            "max_num_batched_tokens": 256,
        },
        # prefill-heavy: long prompts, short answers, room for four sequences
        "prefill": {
            "num_requests": 16,
            "prompt_len": 2000,
            "output_len": 128,
            "kv_prompts": 4,
            "budget_ratios": "0.25",
            "policy": "keydiff",
            "max_num_batched_tokens": 512,
        },
        # the same with and without the recall tier
        "recall": {
            "num_requests": 16,
            "prompt_len": 2000,
            "output_len": 128,
            "kv_prompts": 4,
            "budget_ratios": "0.25",
            "policy": "keydiff",
            "max_num_batched_tokens": 512,
            "recall": True,
        },
    },
    "overhead": {
        "smoke": {
            "policies": "keydiff,snapkv,keydiff:recall=true",
            "prompt_len": 1024,
            "output_len": 8,
            "budget": 256,
            "chunk": 256,
        },
        "full": {
            "policies": "keydiff,streamingllm,snapkv,tova,h2o,knorm,random,criticalkv,kvmerger,lshe,caote,fastcaote",
            "prompt_len": 2048,
            "output_len": 64,
            "budget": 512,
            "chunk": 256,
        },
        "recall": {
            "policies": "keydiff,keydiff:recall=true,tova,tova:recall=true,snapkv,snapkv:recall=true",
            "prompt_len": 2048,
            "output_len": 64,
            "budget": 512,
            "chunk": 256,
        },
    },
    "prefix": {
        "smoke": {
            "policy": "keydiff",
            "budget": 256,
            "chunk": 1024,
            "kv_blocks": 160,
            "max_model_len": 2048,
            "prefix_len": 800,
            "suffix_len": 32,
            "num_prompts": 4,
            "shared_output_len": 8,
            "concurrency": 2,
            "conversations": 2,
            # the history passes the first compaction point (512) in turn 2, before its prompt's end: turn 3
            # starts on its window (with recall too)
            "turns": 4,
            "user_len": 200,
            "turn_output_len": 16,
            "needle_conversations": 2,
            "needle_user_len": 200,
        },
        # a 3000-token document or system prompt; chats whose history grows to several budgets
        "full": {
            "policy": "keydiff",
            "budget": 512,
            "chunk": 2048,
            "kv_blocks": 480,
            "max_model_len": 8192,
            "prefix_len": 3000,
            "suffix_len": 100,
            "num_prompts": 24,
            "shared_output_len": 32,
            "concurrency": 4,
            "conversations": 4,
            "turns": 6,
            "user_len": 400,
            "turn_output_len": 48,
            # history of five 500-token turns: about 2,700 tokens when the question comes, 5x the budget
            "needle_conversations": 20,
            "needle_user_len": 500,
        },
    },
    "speculative": {
        "smoke": {
            "num_prompts": 4,
            "output_len": 48,
            "budget": 96,
            "policy": "keydiff",
            "num_spec_tokens": 4,
            "concurrency": 2,
        },
        # answers several times the budget: the window compacts while the drafts run
        "full": {
            "num_prompts": 16,
            "output_len": 512,
            "budget": 256,
            "policy": "keydiff",
            "num_spec_tokens": 4,
            "concurrency": 4,
        },
    },
    "memory": {
        "smoke": {"prompt_len": 1024, "output_len": 64, "budget": 256, "policy": "keydiff", "chunk": 256},
        "full": {"prompt_len": 4000, "output_len": 256, "budget": 512, "policy": "keydiff", "chunk": 256},
    },
}


def _model_path(args) -> str:
    if args.model:
        return args.model
    from vllm_kvevict.testing.models import smollm2_path

    return str(smollm2_path())


def _fill(args, command: str) -> None:
    for k, v in PRESETS[command][args.preset].items():
        if getattr(args, k) is None:
            setattr(args, k, v)


def _floats(s: str) -> list[float]:
    return [float(x) for x in str(s).split(",") if x]


def _finish(args, name: str, module, report: dict) -> int:
    """Every subcommand's end: the table on stdout, ``<out>/<name>.json`` and ``.png``."""
    report["preset"] = args.preset
    print(module.format_table(report))
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps(report, indent=1))
    module.plot(report, str(out_dir / f"{name}.png"))
    print(f"wrote {out_dir / (name + '.json')} and {out_dir / (name + '.png')}", file=sys.stderr)
    return 0


def cmd_quality(args) -> int:
    from transformers import AutoTokenizer

    from vllm_kvevict.bench import quality

    _fill(args, "quality")
    configs = [c.replace(";", ",") for c in args.configs.split(",")]
    ns = argparse.Namespace(
        base_url=args.base_url,
        model=args.served_model_name,
        tokenizer=args.tokenizer,
        model_path=args.model,
        server_args=args.server_args,
    )
    if not args.base_url and not args.model:
        ns.model_path = _model_path(args)
    with quality.serve_or_connect(ns) as (base_url, model, tok):
        report = quality.run_quality(
            base_url,
            model,
            AutoTokenizer.from_pretrained(tok),
            configs,
            _floats(args.budget_ratios),
            [int(x) for x in str(args.length).split(",")],
            args.depths,
            [int(s) for s in str(args.seeds).split(",")],
            args.tasks.split(","),
            concurrency=args.concurrency,
            progress=True,
            budgets=[int(b) for b in str(args.budgets).split(",") if b],
            rows_path=args.rows,
        )
    return _finish(args, "quality", quality, report)


def cmd_throughput(args) -> int:
    from vllm_kvevict.bench import throughput

    _fill(args, "throughput")
    report = throughput.run_throughput(
        _model_path(args),
        args.num_requests,
        args.prompt_len,
        args.output_len,
        args.kv_prompts,
        _floats(args.budget_ratios),
        args.policy,
        args.max_num_batched_tokens,
        args.out,
        progress=True,
        recall=bool(args.recall),
    )
    return _finish(args, "throughput", throughput, report)


def cmd_memory(args) -> int:
    from vllm_kvevict.bench import memory

    _fill(args, "memory")
    report = memory.run_memory(
        _model_path(args),
        args.prompt_len,
        args.output_len,
        args.budget,
        args.policy,
        args.chunk,
        args.out,
        progress=True,
    )
    return _finish(args, "memory", memory, report)


def cmd_overhead(args) -> int:
    from vllm_kvevict.bench import overhead

    _fill(args, "overhead")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    report = overhead.run_overhead(
        _model_path(args),
        args.policies.split(","),
        args.prompt_len,
        args.output_len,
        args.budget,
        args.chunk,
        args.out,
        progress=True,
        server_args=shlex.split(args.server_args),
    )
    return _finish(args, "overhead", overhead, report)


def cmd_speculative(args) -> int:
    from vllm_kvevict.bench import speculative

    _fill(args, "speculative")
    report = speculative.run_speculative(
        _model_path(args),
        args.num_prompts,
        args.output_len,
        args.budget,
        args.policy,
        args.num_spec_tokens,
        args.concurrency,
        log_dir=args.out,
    )
    return _finish(args, "speculative", speculative, report)


def cmd_prefix(args) -> int:
    from vllm_kvevict.bench import prefix

    _fill(args, "prefix")
    report = prefix.run_prefix(
        _model_path(args),
        args.policy,
        args.budget,
        args.chunk,
        args.kv_blocks,
        args.max_model_len,
        args.prefix_len,
        args.suffix_len,
        args.num_prompts,
        args.shared_output_len,
        args.concurrency,
        args.conversations,
        args.turns,
        args.user_len,
        args.turn_output_len,
        args.needle_conversations,
        args.needle_user_len,
        args.stride,
        tuple(args.servers.split(",")) if args.servers else prefix.SERVERS,
        args.out,
        progress=True,
        recall_prefill=args.recall_prefill,
    )
    return _finish(args, "prefix", prefix, report)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="kvevict-bench", description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = ap.add_subparsers(dest="command", required=True)

    def common(p, command):
        p.add_argument("--preset", choices=tuple(PRESETS[command]), default="smoke")
        p.add_argument("--model", default=None, help="model directory to serve (default: bundled SmolLM2)")
        p.add_argument("--out", default="bench-results", help="directory for the JSON and PNG")

    q = sub.add_parser("quality", help="retrieval accuracy per policy and budget vs. no eviction")
    common(q, "quality")
    q.add_argument("--base-url", default=None, help="an already running server (else vLLM is started)")
    q.add_argument("--served-model-name", default="model")
    q.add_argument("--tokenizer", default=None, help="tokenizer path (default: --model)")
    q.add_argument("--server-args", default="", help="extra vllm serve arguments when starting it")
    q.add_argument("--configs", default=None, help="policy[:k=v;k=v],... (';' between a spec's parameters)")
    q.add_argument("--budget-ratios", default=None, help="budgets as ratios of each prompt's tokens")
    q.add_argument("--budgets", default=None, help="absolute budgets in tokens (comma-separated)")
    q.add_argument("--tasks", default=None, help=f"comma-separated, of {ALL_TASKS}")
    q.add_argument("--length", "--lengths", dest="length", default=None, help="prompt tokens (comma-separated)")
    q.add_argument("--depths", type=int, default=None)
    q.add_argument("--seeds", default=None)
    q.add_argument("--concurrency", type=int, default=2)
    q.add_argument(
        "--rows",
        default=None,
        help="JSON-lines file: every finished request is appended, and requests already in it are not "
        "sent again (run a long grid in parts)",
    )
    q.set_defaults(func=cmd_quality)

    t = sub.add_parser("throughput", help="stock vLLM vs kvevict at equal KV memory")
    common(t, "throughput")
    for name, typ in (
        ("num-requests", int),
        ("prompt-len", int),
        ("output-len", int),
        ("kv-prompts", int),
        ("budget-ratios", str),
        ("policy", str),
        ("max-num-batched-tokens", int),
    ):
        t.add_argument(f"--{name}", type=typ, default=None)
    t.add_argument("--recall", action="store_true", default=None, help="also each budget with the recall tier on")
    t.set_defaults(func=cmd_throughput)

    m = sub.add_parser("memory", help="KV blocks over time for one long request, stock vs kvevict")
    common(m, "memory")
    for name, typ in (("prompt-len", int), ("output-len", int), ("budget", int), ("policy", str), ("chunk", int)):
        m.add_argument(f"--{name}", type=typ, default=None)
    m.set_defaults(func=cmd_memory)

    o = sub.add_parser("overhead", help="time in the eviction path per prefill chunk and decode step, per policy")
    common(o, "overhead")
    for name, typ in (("policies", str), ("prompt-len", int), ("output-len", int), ("budget", int), ("chunk", int)):
        o.add_argument(f"--{name}", type=typ, default=None)
    o.add_argument(
        "--server-args",
        default="",
        help="extra vllm serve arguments (split as a shell splits them), after the benchmark's own; an "
        "--additional-config's kvevict object is merged over the benchmark's, e.g. --server-args "
        '"--additional-config \'{\\"kvevict\\": {\\"recall\\": {\\"prefill\\": \\"all\\"}}}\'"',
    )
    o.set_defaults(func=cmd_overhead)

    x = sub.add_parser("prefix", help="prefix caching with eviction: shared prefixes and multi-turn chat vs stock")
    common(x, "prefix")
    for name, typ in (
        ("policy", str),
        ("budget", int),
        ("chunk", int),
        ("kv-blocks", int),
        ("max-model-len", int),
        ("prefix-len", int),
        ("suffix-len", int),
        ("num-prompts", int),
        ("shared-output-len", int),
        ("concurrency", int),
        ("conversations", int),
        ("turns", int),
        ("user-len", int),
        ("turn-output-len", int),
        ("needle-conversations", int),
        ("needle-user-len", int),
    ):
        x.add_argument(f"--{name}", type=typ, default=None)
    x.add_argument("--stride", type=int, default=None, help="kvevict's compaction stride (default: the budget)")
    x.add_argument("--servers", default=None, help="which servers besides stock (default: all)")
    x.add_argument(
        "--recall-prefill",
        choices=("all", "window"),
        default="all",
        help="the recall server's recall.prefill (default: all, every chunk over the window and the tier)",
    )
    x.set_defaults(func=cmd_prefix)

    s = sub.add_parser(
        "speculative", help="n-gram speculative decoding with and without eviction, through vllm bench serve"
    )
    common(s, "speculative")
    for name, typ in (
        ("num-prompts", int),
        ("output-len", int),
        ("budget", int),
        ("policy", str),
        ("num-spec-tokens", int),
        ("concurrency", int),
    ):
        s.add_argument(f"--{name}", type=typ, default=None)
    s.set_defaults(func=cmd_speculative)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
