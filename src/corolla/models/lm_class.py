"""Which of transformers' classes corolla builds for a checkpoint: the text model's causal LM, or, for a
multimodal model whose text model has none of its own (Mistral Large 4), the wrapper's generation class
(its vision tower stays on the meta device, never loaded or run)."""

from __future__ import annotations

import importlib
from typing import Any

# multimodal models whose text model has no causal LM of its own, served through their wrapper: each
# checked against the wrapper's own logits (tests/unit/models/test_spans_match_transformers.py,
# tests/unit/client/test_families.py); other wrappers' text models may be encoders, diffusion models or
# decoders with cross-attention, so they stay refused until checked
CHECKED_WRAPPERS = ("mistral_large4", "glm5_next", "qwen2_5_vl", "qwen3_vl")


def causal_lm_class(hf: Any) -> type | None:
    """transformers' causal LM for a (text) config: the auto mapping's, else the `...ForCausalLM` that
    the family's modeling module defines for exactly this config class (Mistral 4's text model, which
    transformers registers only behind its multimodal wrapper); None if it has none."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    if type(hf) in MODEL_FOR_CAUSAL_LM_MAPPING:
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(hf)]
    try:
        module = importlib.import_module(type(hf).__module__.replace(".configuration_", ".modeling_"))
    except ImportError:
        return None
    found = [
        cls
        for name, cls in vars(module).items()
        if name.endswith("ForCausalLM") and getattr(cls, "config_class", None) is type(hf)
    ]
    return found[0] if len(found) == 1 else None


def wrapper_lm_class(wrapper: Any) -> type | None:
    """A checked multimodal config's image-text-to-text class (its language model with the LM head), for a
    wrapper whose text model has no causal LM of its own; None otherwise."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING

    if wrapper is None or wrapper.get_text_config() is wrapper or wrapper.model_type not in CHECKED_WRAPPERS:
        return None
    return MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING.get(type(wrapper), None)


def lm_class(hf: Any, wrapper: Any = None) -> type | None:
    """The class to build: the text config's causal LM, else its wrapper's generation class."""
    return causal_lm_class(hf) or wrapper_lm_class(wrapper)
