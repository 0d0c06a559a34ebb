"""LoRA adapters in PEFT's format, served by a span and chosen per request.

A server loads the adapters named on its command line (`--adapters PATH`, repeatable: PEFT folders with
adapter_config.json and adapter_model.safetensors), reading only its own blocks' LoRA weights. Every
targeted linear layer of a block becomes a `LoraLinear`: the frozen base output, plus
`scale * (x @ A^T) @ B^T` for the tokens of requests that chose an adapter. Which tokens use which
adapter is set for each pass with `use_adapters`: one adapter for a whole forward/backward request, or
token ranges of a packed batch in which sessions with different adapters run together.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
from collections.abc import Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from corolla.errors import InvalidRequest, UnsupportedModel

# None: no adapter; a name: that adapter for every token; ranges: (first token, end token, name | None)
Active = str | tuple[tuple[int, int, str | None], ...] | None
ACTIVE: ContextVar[Active] = ContextVar("corolla_active_adapters", default=None)

# ...layers.{block}.{path of the linear layer inside the block}.lora_A|B[.adapter name].weight
KEY = re.compile(r"layers\.(\d+)\.([\w.]+?)\.lora_([AB])(?:\.[\w-]+)?\.weight$")


@contextlib.contextmanager
def use_adapters(active: Active) -> Iterator[None]:
    token = ACTIVE.set(active)
    try:
        yield
    finally:
        ACTIVE.reset(token)


class LoraLinear(nn.Module):
    def __init__(self, base: nn.Linear):
        super().__init__()
        self.base = base
        self.adapters: dict[str, tuple[torch.Tensor, torch.Tensor, float]] = {}  # name -> (A, B, scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        active = ACTIVE.get()
        if active is None or not self.adapters:
            return out
        if isinstance(active, str):
            return out + self._delta(active, x) if active in self.adapters else out
        used = [(a, b, name) for a, b, name in active if name in self.adapters]
        if not used:
            return out
        out = out.clone()
        for first, end, name in used:  # ranges along the token axis of a packed [1, N, H] batch
            out[..., first:end, :] += self._delta(name, x[..., first:end, :])
        return out

    def _delta(self, name: str, x: torch.Tensor) -> torch.Tensor:
        a, b, scale = self.adapters[name]
        return scale * nn.functional.linear(nn.functional.linear(x, a.to(x.dtype)), b.to(x.dtype))


@dataclass(frozen=True)
class LoraAdapter:
    name: str
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]  # (block, module) -> (A, B)
    scale: float


def load_adapter(path: str | Path, blocks: Sequence[int], name: str | None = None) -> LoraAdapter:
    """Read a PEFT LoRA folder, keeping the weights of `blocks` only."""
    folder = Path(path)
    name = name or folder.name
    scale = _read_scale(folder, name)
    weights_path = folder / "adapter_model.safetensors"
    if not weights_path.is_file():
        raise UnsupportedModel(f"adapter {name}: {weights_path} is missing (only safetensors are read)")
    wanted = set(blocks)
    pairs = {}
    with safe_open(weights_path, framework="pt") as f:
        for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
            match = KEY.search(key)
            if match is None:
                continue
            block = int(match.group(1))
            module = match.group(2)
            which = match.group(3)
            if block in wanted:
                pairs.setdefault((block, module), {})[which] = f.get_tensor(key)
    weights = {}
    for (block, module), pair in pairs.items():
        if set(pair) != {"A", "B"}:
            raise UnsupportedModel(f"adapter {name}: block {block} {module} lacks lora_A or lora_B")
        weights[(block, module)] = (pair["A"].float(), pair["B"].float())
    return LoraAdapter(name, weights, scale)


def _read_scale(folder: Path, name: str) -> float:
    """The adapter's scale from adapter_config.json, refusing options corolla does not implement."""
    try:
        config = json.loads((folder / "adapter_config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise UnsupportedModel(f"adapter {name}: cannot read {folder / 'adapter_config.json'}: {e}") from e
    if config.get("peft_type", "LORA") != "LORA":
        raise UnsupportedModel(f"adapter {name}: only LoRA adapters are supported, not {config['peft_type']}")
    for option in ("rank_pattern", "alpha_pattern"):
        if config.get(option):
            raise UnsupportedModel(f"adapter {name}: {option} is not supported")
    if config.get("bias", "none") != "none" or config.get("fan_in_fan_out"):
        raise UnsupportedModel(f"adapter {name}: LoRA biases and fan_in_fan_out are not supported")
    rank = int(config["r"])
    alpha = float(config.get("lora_alpha", config["r"]))
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def attach(blocks: nn.ModuleList, first_block: int, adapter: LoraAdapter) -> None:
    """Make the adapter available on blocks [first_block, first_block + len(blocks))."""
    for (block, module), (a, b) in adapter.weights.items():
        parent_name, _, layer_name = module.rpartition(".")
        try:  # the family's own module path: self_attn.q_proj, self_attn.qkv_proj (Phi-3), mlp.down_proj...
            parent = blocks[block - first_block].get_submodule(parent_name)
            layer = getattr(parent, layer_name)
        except AttributeError:
            raise UnsupportedModel(f"adapter {adapter.name}: block {block} has no layer {module}") from None
        if not isinstance(layer, (nn.Linear, LoraLinear)):
            raise UnsupportedModel(f"adapter {adapter.name}: {module} is not a linear layer (LoRA needs one)")
        if not isinstance(layer, LoraLinear):
            layer = LoraLinear(layer)
            setattr(parent, layer_name, layer)
        base = layer.base
        if a.shape[1] != base.in_features or b.shape[0] != base.out_features or a.shape[0] != b.shape[1]:
            raise InvalidRequest(
                f"adapter {adapter.name}: block {block} {module} has shapes A {list(a.shape)}, "
                f"B {list(b.shape)}, which do not fit a {base.in_features} -> {base.out_features} layer"
            )
        dtype = base.weight.dtype if base.weight.is_floating_point() else torch.float32  # int8 weights
        device = base.weight.device
        layer.adapters[adapter.name] = (a.to(device, dtype), b.to(device, dtype), adapter.scale)
