"""A model's fingerprint: equal for interchangeable blocks, different for another model."""

from __future__ import annotations

from corolla.models.model_config import ModelConfig
from corolla.models.source import resolve_model


def smollm2() -> ModelConfig:
    return ModelConfig.from_folder(resolve_model("smollm2").path)


def test_replicas_in_other_precisions_and_limits_share_it():
    config = smollm2()
    other = config.replace(
        dtype="float16", max_position_embeddings=512, pad_token_id=7, transformers_version="9"
    )
    assert other.fingerprint() == config.fingerprint()


def test_float32_rounding_of_a_gguf_conversion_does_not_change_it():
    config = smollm2()  # converted from GGUF: rms_norm_eps is float32's 9.999999747378752e-06
    assert config.hf.rms_norm_eps != 1e-5
    assert config.replace(rms_norm_eps=1e-5).fingerprint() == config.fingerprint()


def test_any_field_of_the_blocks_changes_it():
    config = smollm2()
    others = [
        config.replace(hidden_size=1152),
        config.replace(num_key_value_heads=1),
        config.replace(num_hidden_layers=31),
        config.replace(rms_norm_eps=1e-6),
        config.replace(rope_parameters={"rope_type": "default", "rope_theta": 10_000.0}),
        config.replace(attention_bias=True),
        config.replace(model_type="mistral"),
    ]
    prints = {config.fingerprint(), *(other.fingerprint() for other in others)}
    assert len(prints) == 1 + len(others)
