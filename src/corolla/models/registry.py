"""Model families by Hugging Face `model_type`.

A family says how to read its config.json into a `ModelConfig` and which block class runs one of its
transformer layers. Llama, Mistral and Qwen2 share one block implementation: their differences (qkv
bias, sliding-window attention) are config fields, not code.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from corolla.errors import UnsupportedModel
from corolla.models.config import ModelConfig, parse_llama_like


@dataclass(frozen=True)
class Family:
    name: str
    parse_config: Callable[[dict[str, Any]], ModelConfig]


def _parse_llama(raw: dict[str, Any]) -> ModelConfig:
    return parse_llama_like(raw)


def _parse_mistral(raw: dict[str, Any]) -> ModelConfig:
    window = raw.get("sliding_window")
    layers = int(raw.get("num_hidden_layers", 0))
    return parse_llama_like(raw, sliding_windows=(int(window) if window else None,) * layers)


def _parse_qwen2(raw: dict[str, Any]) -> ModelConfig:
    layers = int(raw.get("num_hidden_layers", 0))
    window = raw.get("sliding_window") if raw.get("use_sliding_window") else None
    layer_types = raw.get("layer_types") or [
        "sliding_attention" if window and i >= int(raw.get("max_window_layers", 28)) else "full_attention"
        for i in range(layers)
    ]
    windows = tuple(int(window) if window and kind == "sliding_attention" else None for kind in layer_types)
    return parse_llama_like(raw, qkv_bias=True, sliding_windows=windows)


FAMILIES: dict[str, Family] = {
    "llama": Family("llama", _parse_llama),
    "mistral": Family("mistral", _parse_mistral),
    "qwen2": Family("qwen2", _parse_qwen2),
}


def get_family(model_type: object) -> Family:
    if not isinstance(model_type, str) or model_type not in FAMILIES:
        raise UnsupportedModel(
            f"model_type {model_type!r} is not supported; supported families: {', '.join(sorted(FAMILIES))}"
        )
    return FAMILIES[model_type]
