"""A checkpoint's configuration: transformers' own config object, plus the few numbers corolla needs.

The configuration is read with transformers (`AutoConfig`), so every decoder-only causal LM that
transformers implements is described the way its modeling code expects. `ModelConfig` keeps that object
(`hf`) and lifts out what the swarm needs without knowing the family: block count, hidden size, the
attention cache's shape, token ids, the checkpoint's dtype, and a fingerprint of the blocks'
computation. Multimodal wrappers (a language model plus a vision tower) are served by their text model.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from corolla.errors import InvalidRequest, UnsupportedModel
from corolla.models.compressed_sizes import compressed_bytes_per_token, held_family
from corolla.models.handoff import WireLayout
from corolla.models.kv_sharing import KVSharing
from corolla.models.lm_class import CHECKED_WRAPPERS, causal_lm_class, lm_class

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
ATTENTION_NAME = "corolla"  # the attention function corolla registers with transformers (attention.py)
# attention layers (paged keys and values), layers with a recurrent state (linear attention, Mamba,
# short convolutions: models/recurrent.py), and layers with no token mixing at all (an MLP or MoE alone)
SUPPORTED_LAYER_TYPES = (
    "full_attention",
    "sliding_attention",
    "chunked_attention",  # attention within chunks of positions (Llama 4)
    "indexed_attention",  # DeepSeek sparse attention: an indexer picks each query's keys
    "linear_attention",
    "conv",
    "hybrid",  # attention and a Mamba mixer side by side in one layer (Falcon-H1), or attention with a
    # recurrent projection (ZAYA's convolved queries and keys, delayed values)
    "hybrid_sliding",  # the same within a sliding window (ZAYA)
    "compressed_sparse_attention",  # DeepSeek-V4's, and heavily compressed (models/layer_caches.py)
    "heavily_compressed_attention",
    "mlp",
    "moe",
)
# config keys that replicas of the same blocks may differ in (precision, token ids, the context limit,
# bookkeeping), or that do not change what the blocks compute
NOT_FINGERPRINTED = {
    "dtype",
    "torch_dtype",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "max_position_embeddings",
    "transformers_version",
    "architectures",
    "use_cache",
    "initializer_range",
    "quantization_config",
    "id2label",
    "label2id",
}


@dataclass(frozen=True)
class ModelConfig:
    hf: Any = field(repr=False, compare=False)  # transformers.PretrainedConfig of the language model
    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    torch_dtype: str | None = None
    # the multimodal config whose generation class corolla builds, when the language model has no causal
    # LM of its own (Mistral Large 4); None otherwise (models/lm_class.py)
    wrapper: Any = field(default=None, repr=False, compare=False)
    # attention sublayers with a cache each in one decoder layer (LongCat-Flash: 2; block_count)
    cache_layers_per_block: int = 1

    @property
    def layer_types(self) -> tuple[str, ...]:
        types = getattr(self.hf, "layer_types", None)
        return tuple(types) if types else ("full_attention",) * self.num_hidden_layers

    @functools.cached_property
    def kv_sharing(self) -> KVSharing:
        """Which layers use an earlier layer's keys and values or sparse-attention selection within a pass
        (Gemma 3n and 4, GLM-5, Mistral Large 4), read once (every session a server opens checks it)."""
        return KVSharing.of(self.hf, self.layer_types)

    @functools.cached_property
    def wire(self) -> WireLayout:
        """What one layer hands the next: hidden states, and with them per-layer inputs and parallel
        streams where the family has them (Gemma 3n, Gemma 4 E2B/E4B: models/handoff.py)."""
        return WireLayout.of(self.hf)

    def layer_attribute(self, layer: int, name: str) -> Any:
        """A config value of one layer: Gemma 4's attention shapes differ by layer (`per_layer_config`)."""
        return _layer_attribute(self.hf, layer, name)

    def fingerprint(self) -> str:
        """A short hash of what makes two servers' blocks interchangeable: the configuration's fields that
        set the blocks' shapes and computation. Floats count to 6 significant digits, so a GGUF conversion
        (which stores them as float32) matches the original config.json. It cannot tell two sets of
        weights of the same architecture apart (a fine-tune): checking outputs is what catches those."""
        fields = {
            key: value
            for key, value in self.hf.to_dict().items()
            if key not in NOT_FINGERPRINTED and not key.startswith(("_", "output_", "return_"))
        }
        text = json.dumps(_rounded(fields), sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    @property
    def pooled_indexer(self) -> bool:
        """GLM-5-Next's sparse attention: its indexer ranks pools of keys and finds each query's visible
        keys from positions itself (causal, given a [B, T] padding mask), not from the layer's mask."""
        return bool(getattr(self.hf, "index_kpool", None))

    def kv_bytes_per_token_per_block(self, dtype_bytes: int) -> int:
        """Attention cache size of one token in one block: keys and values of every kv head, or, for
        multi-head latent attention, its compressed latent and rotary key (what transformers caches), or
        DeepSeek-V4's compressed entries; on average over the blocks, where some keep a recurrent state
        instead (Qwen3.5: 1 in 4 caches), reuse another layer's (Gemma 3n and 4), or differ in shape (Gemma
        4's global layers), or hold several attention sublayers (LongCat-Flash)."""
        if held_family(self.hf):
            return math.ceil(compressed_bytes_per_token(self.hf, dtype_bytes) / self.num_hidden_layers)
        reusing = self.kv_sharing.sources
        caching = [
            layer
            for layer, kind in enumerate(self.layer_types)
            if kind.endswith("attention") and kind != "linear_attention" and layer not in reusing
        ]
        latent = getattr(self.hf, "kv_lora_rank", None)
        if isinstance(latent, int) and isinstance(getattr(self.hf, "qk_rope_head_dim", None), int):
            indexer = getattr(self.hf, "index_head_dim", 0) if "indexed_attention" in self.layer_types else 0
            if indexer and self.pooled_indexer:  # each key with its pooling gate and a valid flag
                indexer = 2 * indexer + 1
            per_layer = (latent + self.hf.qk_rope_head_dim + indexer) * dtype_bytes
            # Kimi Linear, GLM-5-Next: 1 in 4; LongCat-Flash: 2 sublayers a block
            return per_layer * len(caching) * self.cache_layers_per_block // self.num_hidden_layers
        total = 0
        for layer in caching:
            heads = self.layer_attribute(layer, "num_key_value_heads") or self.num_attention_heads
            dim = self.layer_attribute(layer, "head_dim") or self.hidden_size // self.num_attention_heads
            total += 2 * heads * dim * dtype_bytes
        return total * self.cache_layers_per_block // self.num_hidden_layers

    @classmethod
    def from_folder(cls, path: str | Path) -> ModelConfig:
        config_path = Path(path) / "config.json"
        if not config_path.is_file():
            raise UnsupportedModel(
                f"{path} has no config.json: a model folder must be in Hugging Face layout"
            )
        from transformers import PretrainedConfig

        # transformers' reader: it decodes what its writer encodes (Infinity as {"__float__": ...})
        raw, _ = PretrainedConfig.get_config_dict(str(Path(path)))
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        return cls.from_hf(_hf_config(raw))

    @classmethod
    def from_hf(cls, hf: Any) -> ModelConfig:
        text = hf.get_text_config()  # a multimodal wrapper's language model; the config itself otherwise
        wrapper = hf if text is not hf and causal_lm_class(text) is None else None
        _check_supported(text, wrapper)
        return dataclasses.replace(cls._read(text), wrapper=wrapper)

    @classmethod
    def _read(cls, hf: Any) -> ModelConfig:
        blocks, per_block = block_count(hf)
        heads = int(hf.num_attention_heads)
        eos = getattr(hf, "eos_token_id", None)
        dtype = getattr(hf, "dtype", None)
        return cls(
            hf=hf,
            model_type=str(hf.model_type),
            vocab_size=int(hf.vocab_size),
            hidden_size=int(hf.hidden_size),
            num_hidden_layers=blocks,
            cache_layers_per_block=per_block,
            num_attention_heads=heads,
            # of the first layer (Gemma 4's differ by layer: layer_attribute)
            num_key_value_heads=int(_layer_attribute(hf, 0, "num_key_value_heads") or heads),
            head_dim=int(_layer_attribute(hf, 0, "head_dim") or hf.hidden_size // heads),
            max_position_embeddings=int(getattr(hf, "max_position_embeddings", None) or 2048),
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            bos_token_id=getattr(hf, "bos_token_id", None),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),)),
            pad_token_id=getattr(hf, "pad_token_id", None),
            torch_dtype=str(dtype).removeprefix("torch.") if dtype is not None else None,
        )

    def replace(self, **changes: Any) -> ModelConfig:
        """The same model with changed config.json fields of its language model (tests and benchmarks)."""
        if self.wrapper is None:
            return ModelConfig.from_dict({**self.hf.to_dict(), **changes})
        raw = self.wrapper.to_dict()
        return ModelConfig.from_dict({**raw, "text_config": {**raw["text_config"], **changes}})


def block_count(hf: Any) -> tuple[int, int]:
    """(decoder layers, attention sublayers with a cache in each): num_hidden_layers layers of one, unless
    the config derives num_hidden_layers from a count of layers that each hold several (LongCat-Flash:
    `num_layers` layers of 2 sublayers, whose caches transformers numbers 2i and 2i + 1)."""
    sublayers = int(hf.num_hidden_layers)
    layers = getattr(hf, "num_layers", None)
    derived = isinstance(getattr(type(hf), "num_hidden_layers", None), property)
    if derived and isinstance(layers, int) and 0 < layers < sublayers and sublayers % layers == 0:
        return layers, sublayers // layers
    return sublayers, 1


def _layer_attribute(hf: Any, layer: int, name: str) -> Any:
    per_layer = getattr(hf, "per_layer_config", None)  # transformers' view of heterogeneous configs
    if per_layer is not None:
        return getattr(per_layer[layer], name, None)
    return getattr(hf, name, None)


def _hf_config(raw: dict[str, Any]) -> Any:
    from transformers import CONFIG_MAPPING

    model_type = raw.get("model_type")
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        raise UnsupportedModel(
            f"model_type {model_type!r} is not one transformers knows; corolla serves the decoder-only "
            f"causal LMs that transformers implements ({supported_summary()})"
        )
    try:
        return CONFIG_MAPPING[model_type].from_dict(raw)
    except Exception as e:  # transformers' validators raise their own error types
        raise UnsupportedModel(f"config.json of a {model_type} model is invalid: {e}") from None


def _check_supported(hf: Any, wrapper: Any = None) -> None:
    model_type = hf.model_type
    unknown = set(getattr(hf, "layer_types", None) or ()) - set(SUPPORTED_LAYER_TYPES)
    if unknown:
        raise UnsupportedModel(
            f"{model_type}: layer types {sorted(unknown)} are not supported (corolla serves "
            f"{', '.join(SUPPORTED_LAYER_TYPES)})"
        )
    if getattr(hf, "is_encoder_decoder", False) or lm_class(hf, wrapper) is None:
        checked = (
            f"; of such multimodal models corolla serves {', '.join(CHECKED_WRAPPERS)}" if wrapper else ""
        )
        raise UnsupportedModel(
            f"model_type {model_type!r} is not a decoder-only causal LM (transformers defines no "
            f"...ForCausalLM for it{checked}); corolla serves the decoder-only causal LMs that transformers "
            f"implements ({supported_summary()})"
        )
    for name in ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size"):
        if not isinstance(getattr(hf, name, None), int):
            raise UnsupportedModel(f"config.json of a {model_type} model is missing or has an invalid {name}")
    KVSharing.of(hf, tuple(getattr(hf, "layer_types", None) or ()))  # refuses sharing it cannot serve


def supported_summary() -> str:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    tested = (
        "llama, mistral, mixtral, qwen2, qwen3, qwen3_moe, gemma2, gemma3_text, phi3, olmo2, gpt_oss, "
        "granite, minimax_m2, deepseek_v3, deepseek_v32, glm_moe_dsa, mistral4, mistral_large4, qwen3_5, "
        "qwen3_next, kimi_linear, lfm2, jamba, nemotron_h, falcon_h1, gemma4_text, gemma3n_text, hy_v4, "
        "glm5_next_text"
    )
    return f"{len(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)} model types, tested: {tested}"


def _rounded(value: Any) -> Any:
    if isinstance(value, float):
        return float(f"{value:.6g}")
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_rounded(v) for v in value]
    return value


def parse_dtype(name: str, model: ModelConfig | None = None) -> torch.dtype:
    """A dtype option: float32 | float16 | bfloat16 | auto (the checkpoint's own dtype)."""
    if name == "auto":
        name = (model.torch_dtype if model else None) or "float32"
    if name not in DTYPES:
        raise InvalidRequest(f"dtype {name!r} is not one of auto, {', '.join(DTYPES)}")
    return DTYPES[name]
