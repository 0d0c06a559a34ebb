"""Families whose layers a span cannot run as their own model does are refused in one line, naming the
model type and the reason, when the span is built or loaded: never a crash, never other tokens. (Found by
trying every causal LM of transformers 5.24 on tiny configs.)"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

from corolla.errors import UnsupportedModel
from corolla.models.lm_class import lm_class
from corolla.models.model_config import ModelConfig
from corolla.models.span import Span

TINY = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_hidden_layers=2,
    max_position_embeddings=512,
)


def save_tiny(model_type: str, path, **fields):
    config = AutoConfig.for_model(model_type, **TINY, **fields)
    torch.manual_seed(0)
    lm_class(config)._from_config(config, dtype=torch.float32).save_pretrained(path)
    return path


@pytest.mark.parametrize(
    ("model_type", "refusal"),
    [
        # Dory runs its middle layers in loops, renormalized over the input section's output
        (
            "dory",
            r"dory: its decoder does not run each layer once, in order, on what the layer before returned",
        ),
        # Mllama's text model has cross-attention layers that take the vision tower's states
        (
            "mllama",
            r"mllama_text_model: its layers \(MllamaCrossAttentionDecoderLayer\) take cross_attention_states",
        ),
        ("cpmant", r"cpmant: corolla needs a decoder with `layers`"),  # a bare encoder stack, no embeddings
    ],
)
def test_decoders_a_span_cannot_split_are_refused_when_it_is_built(model_type, refusal):
    with pytest.raises(UnsupportedModel, match=refusal) as refused:
        Span(ModelConfig.from_hf(AutoConfig.for_model(model_type)), 0, 1)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize(
    ("model_type", "fields", "refusal"),
    [
        # Inkling's attention adds a learned relative-position bias the attention function would have to apply
        (
            "inkling_text",
            dict(layer_types=["hybrid_sliding", "hybrid"], num_local_experts=4, moe_intermediate_size=32),
            r"inkling_text: block 0: InklingAttention passes \['position_bias'\] to its attention function",
        ),
        # MiniMax's lightning attention keeps a state through a cache method corolla's cache has not
        (
            "minimax",
            dict(layer_types=["full_attention", "linear_attention"], num_local_experts=4),
            r"minimax: block 1: a layer asked the cache for `get_linear_cache`",
        ),
    ],
)
def test_layers_asking_more_of_the_cache_or_attention_are_refused_when_loaded(
    tmp_path, model_type, fields, refusal
):
    path = save_tiny(model_type, tmp_path, **fields)
    with pytest.raises(UnsupportedModel, match=refusal) as refused:
        Span.load(path, 0, 2)
    assert "\n" not in str(refused.value)
