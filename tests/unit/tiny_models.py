"""A tiny random Qwen2 for trainer tests that need a real causal LM but no download."""
from __future__ import annotations

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM


def tiny_qwen2(vocab: int, hidden: int = 64, seed: int = 0) -> Qwen2ForCausalLM:
    """A 2-layer Qwen2 with ``vocab`` tokens and width ``hidden``, weights from torch seed
    ``seed`` (the same seed gives the same model)."""
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, head_dim=hidden // 2, max_position_embeddings=64,
                      tie_word_embeddings=False, use_cache=False)
    return Qwen2ForCausalLM(cfg)
