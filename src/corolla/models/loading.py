"""Building part of a model from transformers' own classes, and filling just that part with weights.

`empty_model` builds the family's `...ForCausalLM` with every parameter on the meta device (no memory;
buffers such as rotary frequencies are real), so a server of blocks 70:80 holds the module objects of
the other layers but none of their weights. `load_weights` reads the checkpoint tensors under the given
prefixes and loads them through transformers' own weight loading (`convert_and_load_state_dict_in_model`
with the model's conversion mapping), which also converts checkpoint layouts that differ from the
modules' (per-expert MoE weights into fused experts, renamed keys) exactly as `from_pretrained` does.
"""

from __future__ import annotations

import inspect
import logging
import math
import threading
from collections.abc import Callable
from typing import Any

import torch
from accelerate import init_empty_weights
from torch import nn
from torch.overrides import TorchFunctionMode
from transformers.initialization import no_init_weights

from corolla.errors import UnsupportedModel
from corolla.models import attention as _registers  # noqa: F401 (registers corolla's attention function with transformers)
from corolla.models.checkpoint import Checkpoint
from corolla.models.handoff import wire_modules
from corolla.models.layer_calls import CACHE_ARGUMENTS
from corolla.models.lm_class import lm_class
from corolla.models.model_config import ModelConfig, block_count

logger = logging.getLogger(__name__)
# init_empty_weights (and transformers' no_init_weights) patch torch.nn.Module and torch.nn.init
# process-wide while they run: a model built or loaded in another thread meanwhile (two clients connecting
# at once, a server loading a span while it moves) would get meta or uninitialized parameters. Building and
# loading take turns.
_MODEL_LOCK = threading.Lock()
HUGE_BYTES = 2**30  # tensors at least this large are made on the meta device at once (_HugeOnMeta)
_FACTORIES = (torch.empty, torch.zeros, torch.ones)


class _HugeOnMeta(TorchFunctionMode):
    """init_empty_weights moves a parameter to the meta device when its module registers it, after the
    module made it on the CPU: a big MoE's fused experts (DeepSeek-V3: 30 GB a layer in float32, Kimi K2:
    34 GB in bfloat16) were allocated first, which the kernel refuses on a machine with less memory. Such
    tensors are made on meta directly; buffers, which must be real, are never this large."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _FACTORIES and kwargs.get("device") is None and _size_in_bytes(args, kwargs) >= HUGE_BYTES:
            kwargs = {**kwargs, "device": "meta"}
        return func(*args, **kwargs)


def _size_in_bytes(args: tuple, kwargs: dict) -> int:
    shape = args[0] if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)) else args
    if not shape or not all(isinstance(n, int) for n in shape):
        return 0
    return math.prod(shape) * (kwargs.get("dtype") or torch.get_default_dtype()).itemsize


def empty_model(config: ModelConfig, attention: str, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The family's causal LM (or its multimodal wrapper's generation class, models/lm_class.py) with meta
    parameters in `dtype` (weights loaded into it are cast to it), its attention set to `attention`."""
    source = config.wrapper or config.hf  # a multimodal model without a text causal LM: the wrapper
    hf = source.__class__.from_dict(source.to_dict())  # a copy: the attention choice is per model
    hf._attn_implementation = attention
    model_class = lm_class(hf.get_text_config(), hf if config.wrapper is not None else None)
    try:
        # no initialization of the meta parameters (on meta, torch's init functions run their Python
        # reference code: 4-5x the building time), as transformers' own from_pretrained does; the ties
        # post_init would have made are made after
        with _MODEL_LOCK, init_empty_weights(include_buffers=False), no_init_weights(), _HugeOnMeta():
            model = model_class._from_config(hf, dtype=dtype)
            model.tie_weights(recompute_mapping=False)
    except (KeyError, ValueError) as e:  # a family that picks attention classes by name (Falcon, Bloom)
        raise UnsupportedModel(
            f"{config.model_type}: {model_class.__name__} does not take its attention function from "
            f"transformers' registry, which corolla's cache plugs into ({type(e).__name__}: {e})"
        ) from None
    return model.eval()


def decoder_of(model: nn.Module) -> tuple[str, nn.Module]:
    """The module holding the decoder layers, with its name inside the causal LM ("model." usually)."""
    text = model.config.get_text_config()  # a multimodal model's vision tower has layers too
    for name, module in model.named_modules():
        layers = getattr(module, "layers", None)
        ours = getattr(module, "config", text) is text
        if isinstance(layers, nn.ModuleList) and ours and len(layers) == block_count(text)[0]:
            if not hasattr(module, "get_input_embeddings"):  # a bare encoder stack (CPM-Ant's)
                break
            return (f"{name}." if name else ""), module
    raise UnsupportedModel(
        f"{model.config.model_type}: corolla needs a decoder with `layers`, which {type(model).__name__} "
        "does not have"
    )


# what some families' decoder layers take besides the previous layer's hidden states and the pass's cache,
# which a span that receives only hidden states cannot give them: the token ids (Qwen4-exp's per-layer
# n-gram embeddings), the embeddings' output (Zamba v1; Zamba2's travels with the hidden states), the
# previous layer's router state (ZAYA's travels with them: models/handoff.py)
OUTSIDE_INPUTS = (
    "input_ids",
    "ple_input_ids",
    "original_hidden_states",
    "prev_router_hidden_states",
)


# what a span hands every layer (models/span.py), some of it where the layer takes it
SPAN_INPUTS = (
    "attention_mask",
    "position_ids",
    "position_embeddings",
    *CACHE_ARGUMENTS,
    "use_cache",
    "per_layer_input",
    "shared_kv_states",
    "prev_topk_indices",
)


def check_layer_inputs(model_type: str, layers: nn.ModuleList, carried: tuple[str, ...] = ()) -> None:
    """Refuse decoder layers that take inputs from outside the previous layer's hidden states, but for the
    `carried` ones, which travel with them (models/handoff.py)."""
    for layer_class in dict.fromkeys(type(layer) for layer in layers):  # in the order of the layers
        parameters = inspect.signature(layer_class.forward).parameters
        outside = [name for name in OUTSIDE_INPUTS if name in parameters and name not in carried]
        # arguments without a default that a span does not pass (Mllama's cross-attention states)
        outside += [
            name
            for name, parameter in list(parameters.items())[2:]  # after self and the hidden states
            if parameter.default is parameter.empty
            and parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY)
            and name not in SPAN_INPUTS + carried
        ]
        missing = [name for name in carried if name not in parameters]
        if missing:
            raise UnsupportedModel(f"{model_type}: its layers ({layer_class.__name__}) take no {missing[0]}")
        if outside:
            raise UnsupportedModel(
                f"{model_type}: its layers ({layer_class.__name__}) take {', '.join(outside)} besides the "
                "previous layer's hidden states, which a span lacks"
            )


def rotary_of(decoder: nn.Module) -> nn.Module | None:
    """The decoder's rotary embedding: `rotary_emb`, or its one child of a `...RotaryEmbedding` class under
    another name (LFM2-MoE's `pos_emb`); None for families without position embeddings (Jamba, Mamba)."""
    rotary = getattr(decoder, "rotary_emb", None)
    if rotary is not None:
        return rotary
    named = [m for m in decoder.children() if type(m).__name__.endswith("RotaryEmbedding")]
    return named[0] if len(named) == 1 else None


def final_norm(decoder: nn.Module) -> nn.Module:
    """The decoder's norm after its last layer: its one child besides the embeddings, the layers, the
    rotary embedding, dropouts and what makes the wire's extras (models/handoff.py: `norm`, `final_layernorm`,
    `final_layer_norm`, ... by family)."""
    skip = (
        decoder.get_input_embeddings(),
        decoder.layers,
        rotary_of(decoder),
        *wire_modules(decoder).values(),
    )
    children = [m for m in decoder.children() if m not in skip and not isinstance(m, nn.Dropout)]
    children = [m for m in children if not _rotary_list(m)]
    if len(children) != 1:
        names = [name for name, m in decoder.named_children() if m in children]
        raise UnsupportedModel(f"{type(decoder).__name__}: cannot tell its final norm among {names}")
    return children[0]


def _rotary_list(module: nn.Module) -> bool:
    """A list of rotary embeddings (GraniteSWA's `rotary_embs`, one per base)."""
    inside = list(module.children()) if isinstance(module, (nn.ModuleList, nn.ModuleDict)) else []
    return bool(inside) and all(type(m).__name__.endswith("RotaryEmbedding") for m in inside)


def load_weights(
    model: nn.Module, checkpoint: Checkpoint, names: list[str], dtype: torch.dtype, owned: bool = False
) -> None:
    """Load the named checkpoint tensors (full names) into the meta model, converted as transformers does.

    A name that the model's conversion mapping places in the model is kept (Mistral's own format, whose
    root names the mapping sends into the language model); any other is renamed to the model's own prefix
    first (a bare `LlamaModel` checkpoint keeps its layers under `layers.`, a multimodal one under
    `model.language_model.`). `owned`: the tensors are copied out of the file's mapping (Checkpoint.read)."""
    from transformers.conversion_mapping import get_model_conversion_mapping

    prefix, _ = decoder_of(model)
    mapping = get_model_conversion_mapping(model)
    lands = _landing(model, mapping)
    state_dict = {}
    for name, tensor in checkpoint.read(names, owned=owned).items():
        local = name[len(checkpoint.prefix) :] if name.startswith(checkpoint.prefix) else None
        state_dict[prefix + local if local is not None and not lands(name) else name] = tensor
    load_converted(model, state_dict, mapping, dtype, checkpoint)


def load_converted(
    model: nn.Module,
    state_dict: dict[str, torch.Tensor],
    mapping: list,
    dtype: torch.dtype,
    source: Checkpoint,
) -> None:
    """Load checkpoint tensors into the meta `model` through transformers' loading with `mapping` (its
    renamings and conversions); tensors that do not fit are refused naming the checkpoint."""
    from transformers.core_model_loading import convert_and_load_state_dict_in_model
    from transformers.modeling_utils import LoadStateDictConfig

    load_config = LoadStateDictConfig(weight_mapping=mapping, dtype=dtype)
    with _MODEL_LOCK:
        info, _ = convert_and_load_state_dict_in_model(model, state_dict, load_config)
    problems = _problems(info)
    if problems:
        raise UnsupportedModel(
            f"{source.folder}: the checkpoint does not fit {type(model).__name__}: {problems}"
        )


def build_empty(make: Callable[[], nn.Module]) -> nn.Module:
    """A module built by `make` with meta parameters (real buffers) and no initialization."""
    with _MODEL_LOCK, init_empty_weights(include_buffers=False), no_init_weights():
        return make()


def _landing(model: nn.Module, mapping: list) -> Callable[[str], bool]:
    """Whether a checkpoint name, as is, becomes one of the model's tensors through the mapping."""
    target = target_name(model, mapping)
    return lambda name: target(name) is not None


def target_name(model: nn.Module, mapping: list | None = None) -> Callable[[str], str | None]:
    """The model tensor a checkpoint name becomes, as is, through the model's conversion mapping (None:
    none of the model's)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, rename_source_key

    mapping = get_model_conversion_mapping(model) if mapping is None else mapping
    own = dict(model.state_dict())  # meta tensors: no memory
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    renamings = [m for m in mapping if not isinstance(m, WeightConverter)]

    def target(name: str) -> str | None:
        renamed, _ = rename_source_key(name, renamings, converters, model.base_model_prefix, own)
        return renamed if renamed in own else None

    return target


def _problems(info: Any) -> str:
    parts = []
    for field in ("unexpected_keys", "mismatched_keys", "error_msgs", "conversion_errors"):
        value = getattr(info, field, None)
        if value:
            parts.append(f"{field.replace('_', ' ')}: {sorted(map(str, value))[:5]}")
    return "; ".join(parts)


def missing_on_meta(module: nn.Module) -> list[str]:
    """Parameters and buffers of `module` still on the meta device (weights the checkpoint lacked)."""
    tensors = [*module.named_parameters(), *module.named_buffers()]
    return [name for name, tensor in tensors if tensor.device.type == "meta"]
