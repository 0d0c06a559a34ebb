"""The model hyper-parameters corolla needs, read straight from a checkpoint's config.json.

Servers parse config.json themselves instead of importing transformers: a server must stay light (it
holds a few blocks, not the whole model), and transformers' config classes change between releases.
Family differences (Qwen2's qkv bias, Mistral's sliding window) become plain fields here.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from corolla.errors import InvalidRequest, UnsupportedModel

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# fields that replicas of the same blocks may differ in: precision, token ids, the context limit
NOT_FINGERPRINTED = (
    "torch_dtype",
    "bos_token_id",
    "eos_token_ids",
    "pad_token_id",
    "max_position_embeddings",
)


@dataclass(frozen=True, slots=True)
class RopeConfig:
    theta: float
    kind: str = "default"  # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None


@dataclass(frozen=True, slots=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    sliding_windows: tuple[int | None, ...] = ()  # one per layer; None means full attention
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    torch_dtype: str | None = None

    @property
    def num_key_value_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def fingerprint(self) -> str:
        """A short hash of what makes two servers' blocks interchangeable: the fields that set the blocks'
        shapes and computation. Floats count to 6 significant digits, so a GGUF conversion (which stores
        them as float32) matches the original config.json. It cannot tell two sets of weights of the same
        architecture apart (a fine-tune): checking outputs is what catches those."""
        fields = dataclasses.asdict(self)
        for name in NOT_FINGERPRINTED:
            fields.pop(name)
        text = json.dumps(_rounded(fields), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def kv_bytes_per_token_per_block(self, dtype_bytes: int) -> int:
        """Attention cache size of one token in one block: keys and values of every kv head."""
        return 2 * self.num_key_value_heads * self.head_dim * dtype_bytes

    @classmethod
    def from_folder(cls, path: str | Path) -> ModelConfig:
        config_path = Path(path) / "config.json"
        if not config_path.is_file():
            raise UnsupportedModel(
                f"{path} has no config.json: a model folder must be in Hugging Face layout"
            )
        with open(config_path) as f:
            return cls.from_dict(json.load(f))

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        from corolla.models.registry import get_family  # the registry imports this module

        return get_family(raw.get("model_type")).parse_config(raw)


def _rounded(value: Any) -> Any:
    if isinstance(value, float):
        return float(f"{value:.6g}")
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_rounded(v) for v in value]
    return value


def parse_llama_like(
    raw: dict[str, Any],
    *,
    qkv_bias: bool | None = None,
    sliding_windows: tuple[int | None, ...] | None = None,
) -> ModelConfig:
    """Parse the fields shared by Llama, Mistral and Qwen2 configs; families override what differs."""
    text = raw.get("text_config")
    if isinstance(text, dict):  # multimodal wrappers keep the language model's fields one level down
        raw = {**raw, **text}
    try:
        hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
        layers = int(raw["num_hidden_layers"])
        config = dict(
            model_type=str(raw["model_type"]),
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise UnsupportedModel(f"config.json is missing or has an invalid field: {e}") from None
    attention_bias = bool(raw.get("attention_bias", False))
    eos = raw.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    model = ModelConfig(
        **config,
        rope=_parse_rope(raw, config["max_position_embeddings"]),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=attention_bias if qkv_bias is None else qkv_bias,
        o_bias=attention_bias,
        mlp_bias=bool(raw.get("mlp_bias", False)),
        hidden_act=str(raw.get("hidden_act", "silu")),
        sliding_windows=sliding_windows if sliding_windows is not None else (None,) * layers,
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=eos_ids,
        pad_token_id=raw.get("pad_token_id"),
        torch_dtype=raw.get("dtype") or raw.get("torch_dtype"),
    )
    _check_supported(model)
    return model


def _parse_rope(raw: dict[str, Any], max_positions: int) -> RopeConfig:
    # transformers 5 writes `rope_parameters`; older checkpoints have `rope_theta` + `rope_scaling`.
    params = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    merged = {**scaling, **params}
    kind = str(merged.get("rope_type", merged.get("type", "default")))
    if kind not in ("default", "linear", "llama3"):
        raise UnsupportedModel(f"rope type {kind!r} is not supported (supported: default, linear, llama3)")
    return RopeConfig(
        theta=theta,
        kind=kind,
        factor=float(merged.get("factor", 1.0)),
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=merged.get("original_max_position_embeddings", max_positions),
    )


def _check_supported(config: ModelConfig) -> None:
    if config.num_attention_heads % config.num_key_value_heads:
        raise UnsupportedModel(
            f"num_attention_heads={config.num_attention_heads} is not a multiple of "
            f"num_key_value_heads={config.num_key_value_heads}"
        )
    if config.hidden_act not in ("silu", "gelu", "gelu_pytorch_tanh", "relu"):
        raise UnsupportedModel(f"hidden_act={config.hidden_act!r} is not supported")


def parse_dtype(name: str, model: ModelConfig | None = None) -> torch.dtype:
    """A dtype option: float32 | float16 | bfloat16 | auto (the checkpoint's own dtype)."""
    if name == "auto":
        name = (model.torch_dtype if model else None) or "float32"
    if name not in DTYPES:
        raise InvalidRequest(f"dtype {name!r} is not one of auto, {', '.join(DTYPES)}")
    return DTYPES[name]
