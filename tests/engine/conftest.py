# SPDX-License-Identifier: Apache-2.0
"""Fixtures for the engine tests that evict: a tiny GQA Llama and its transformers twin."""

from __future__ import annotations

import pytest
import torch

from vllm_kvevict.testing.models import tiny_path


@pytest.fixture(scope="session")
def gqa_model():
    # 4 query heads over 2 KV heads (so KV heads can keep different tokens), head size 64.
    return tiny_path(
        hidden_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=512,
        max_position_embeddings=32768,
    )


@pytest.fixture(scope="session")
def hf_model(gqa_model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(gqa_model, dtype=torch.float32, attn_implementation="eager").eval()


@pytest.fixture(scope="session")
def vocab(hf_model):
    return hf_model.config.vocab_size
