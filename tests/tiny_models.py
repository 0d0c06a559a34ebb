"""Tiny random-weight checkpoints of each supported family, saved the way users' models are saved."""

from __future__ import annotations

from pathlib import Path

import torch

COMMON = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    # a wide init makes logits peaked, so greedy decoding has no near-ties that float rounding could flip
    initializer_range=0.3,
)

FAMILIES = ("llama", "mistral", "qwen2")


def tiny_config(family: str):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    if family == "llama":
        return LlamaConfig(
            **COMMON,
            tie_word_embeddings=True,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=10000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
        )
    if family == "mistral":
        return MistralConfig(**COMMON, tie_word_embeddings=False, sliding_window=7)
    if family == "qwen2":
        return Qwen2Config(**COMMON, tie_word_embeddings=False, use_sliding_window=False)
    raise ValueError(family)


def save_tiny_model(family: str, path: Path, *, seed: int = 0, max_shard_size: str | None = None) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family), dtype=torch.float32)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    return path


def load_reference(path: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    return model.eval()
