"""Serving throughput at equal KV memory: stock vLLM versus kvevict, started one after the other.

    python -m vllm_kvevict.bench.throughput --num-requests 16 --prompt-len 2000 --output-len 128 \\
        --kv-prompts 4 --budget-ratio 0.25 --policy keydiff

Both servers get the same model, the same KV cache (``--num-gpu-blocks-override``: room for
``--kv-prompts`` full sequences) and the same workload: ``--num-requests`` completions with
``--prompt-len`` random prompt tokens and exactly ``--output-len`` output tokens, sent at once.
Reports wall time, output tokens/s, requests/s and the peak of running requests (vLLM's
``/metrics``), and the kvevict/stock ratios. Writes JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from vllm_kvevict.testing.server import VLLMServer

BLOCK = 32


def _gauge(base_url: str, name: str) -> float:
    text = urllib.request.urlopen(base_url + "/metrics", timeout=5).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def run_workload(srv: VLLMServer, prompts: list[list[int]], output_len: int) -> dict:
    from openai import OpenAI

    client = OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0, timeout=3600)
    warm = [t + 1 for t in prompts[0][:64]]  # shares no prefix with the workload
    client.completions.create(model=srv.served_model_name, prompt=warm, max_tokens=4)
    peak, stop = [0.0], threading.Event()

    def watch():
        while not stop.is_set():
            try:
                peak[0] = max(peak[0], _gauge(srv.base_url, "vllm:num_requests_running"))
            except OSError:
                pass
            time.sleep(0.2)

    def one(p):
        r = client.completions.create(model=srv.served_model_name, prompt=p, max_tokens=output_len, temperature=0,
                                      extra_body={"ignore_eos": True})
        return r.usage.completion_tokens

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    t0 = time.monotonic()
    with ThreadPoolExecutor(len(prompts)) as pool:
        out_tokens = sum(pool.map(one, prompts))
    wall = time.monotonic() - t0
    stop.set()
    watcher.join()
    return {"wall_s": wall, "output_tokens": out_tokens, "output_tok_per_s": out_tokens / wall,
            "req_per_s": len(prompts) / wall, "peak_running": peak[0]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m vllm_kvevict.bench.throughput", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model directory (default: the bundled SmolLM2)")
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=2000)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--kv-prompts", type=int, default=4, help="KV cache sized for this many full sequences")
    ap.add_argument("--budget-ratio", type=float, default=0.25)
    ap.add_argument("--policy", default="keydiff")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--out", default="throughput.json")
    ap.add_argument("--log-dir", default=".")
    args = ap.parse_args(argv)
    if args.model is None:
        from vllm_kvevict.testing.models import smollm2_path

        args.model = str(smollm2_path())
    seq_blocks = -(-(args.prompt_len + args.output_len) // BLOCK)
    blocks = args.kv_prompts * seq_blocks + 1  # + vLLM's null block
    budget = max(1, round(args.budget_ratio * args.prompt_len))
    common = ["--dtype", "float32", "--block-size", str(BLOCK), "--enforce-eager", "--kv-cache-memory-bytes", "4G",
              "--num-gpu-blocks-override", str(blocks), "--max-model-len", str(args.prompt_len + args.output_len + 64),
              "--max-num-seqs", str(args.num_requests), "--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    configs = {
        "stock": common,
        "kvevict": ["--attention-backend", "kvevict", *common,
                    "--additional-config", json.dumps({"kvevict": {"policy": args.policy, "budget": budget}})],
    }
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(args.prompt_len)] for _ in range(args.num_requests)]
    results = {}
    for name, srv_args in configs.items():
        log = Path(args.log_dir) / f"throughput-{name}.log"
        with VLLMServer(args.model, srv_args, log_path=log, env={"KVEVICT_CONFIG": ""}) as srv:
            results[name] = run_workload(srv, prompts, args.output_len)
        print(f"{name}: {results[name]}", file=sys.stderr, flush=True)
    s, k = results["stock"], results["kvevict"]
    ratio = {"output_tok_per_s": k["output_tok_per_s"] / s["output_tok_per_s"], "wall_s": k["wall_s"] / s["wall_s"]}
    report = {"args": vars(args), "kv_blocks": blocks, "budget": budget, "results": results, "kvevict_over_stock": ratio}
    print(f"{'':<10}{'wall s':>9}{'out tok/s':>11}{'req/s':>8}{'peak running':>14}")
    for name, r in results.items():
        print(f"{name:<10}{r['wall_s']:>9.1f}{r['output_tok_per_s']:>11.1f}{r['req_per_s']:>8.3f}{r['peak_running']:>14.0f}")
    print(f"kvevict/stock: output tokens/s x{ratio['output_tok_per_s']:.2f}, wall time x{ratio['wall_s']:.2f}")
    Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
