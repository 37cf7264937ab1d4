"""Small random models with grouped-query attention, shared by the engine's and the trainer's
tests: a Llama with a tied head (as SmolLM2) and a Qwen2 with nonzero q/k/v biases."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config


def random_model(config) -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


# 4 query heads on 2 KV heads; weights large enough that greedy tokens are not near-ties
GQA_SIZES = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.3,
)


def llama_gqa(vocab: int) -> torch.nn.Module:
    """Grouped-query attention, the head tied to the embedding (as SmolLM2)."""
    return random_model(LlamaConfig(vocab_size=vocab, tie_word_embeddings=True, **GQA_SIZES))


def qwen2(vocab: int) -> torch.nn.Module:
    """Qwen2: biases on q/k/v, grouped-query attention, a rope theta of its own."""
    model = random_model(Qwen2Config(vocab_size=vocab, rope_theta=1000.0, **GQA_SIZES))
    with torch.no_grad():  # nonzero biases, so a step that dropped them would differ
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0.0, 0.3)
    return model
