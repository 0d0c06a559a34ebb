"""A contiguous span of a model's transformer blocks: transformers' own decoder layers, loaded alone.

`Span.load(folder, start, end)` builds the family's model with meta parameters, keeps its decoder layers
[start, end) and its rotary embedding, and fills those layers with just their tensors from the
checkpoint, so a server hosting 10 of 30 layers never allocates the other 20. `Span.forward` runs any
sub-range of the span over hidden states at absolute positions. Keys and values go to an attention
context (models/attention.py) through transformers' cache and attention-function extension points; the
per-layer context a family needs (rotary embeddings per layer type, sliding windows, soft-capping, MoE
routing) is the layers' own business.
"""

from __future__ import annotations

import contextlib
import inspect
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from corolla.errors import InvalidRequest, UnsupportedModel
from corolla.models.attention import AttentionContext, CacheShape, ContextCache, NoCache, active_context
from corolla.models.checkpoint import Checkpoint
from corolla.models.config import ATTENTION_NAME, ModelConfig
from corolla.models.loading import decoder_of, empty_model, load_weights, missing_on_meta
from corolla.models.quantize import quantize_blocks


class Span(nn.Module):
    def __init__(self, config: ModelConfig, start: int, end: int, dtype: torch.dtype = torch.float32):
        super().__init__()
        if not 0 <= start < end <= config.num_hidden_layers:
            raise InvalidRequest(
                f"blocks {start}:{end} are not a non-empty range inside the model's "
                f"{config.num_hidden_layers} blocks"
            )
        self.config = config
        self.start = start
        self.end = end
        self._model = [
            empty_model(config, ATTENTION_NAME, dtype)
        ]  # a list: not a submodule, not in state_dict
        _, decoder = decoder_of(self._model[0])
        self.blocks = nn.ModuleList(decoder.layers[start:end])
        self.rotary = decoder.rotary_emb
        self.layer_types = config.layer_types
        # the cache's shape per token: the config's, until loading measures what the layers store
        heads = config.num_key_value_heads
        self.cache_shape = CacheShape(heads, config.head_dim, heads, config.head_dim)
        self.dtype = dtype  # of the computation and the cache (quantized weights keep their own)
        self.device = torch.device("cpu")  # of the weights, the cache and the computation (models/devices.py)
        self.quantized: str | None = None  # "int8" | "int4" once quantized (models/quantize.py)
        # torchao's quantized fused experts cannot be indexed under inference_mode (models/quantize.py)
        self.needs_no_grad = False
        self._typed_rotary = "layer_type" in inspect.signature(self.rotary.forward).parameters
        self._cache_kwarg = _cache_kwarg(self.blocks[0])

    @classmethod
    def load(
        cls,
        folder: str | Path,
        start: int,
        end: int,
        dtype: torch.dtype = torch.float32,
        quantize: str | None = None,
        device: torch.device | str = "cpu",
    ) -> Span:
        """Blocks [start, end) in `dtype` on `device`; each block moves to the device (and, with `quantize`,
        int8 | int4, is quantized there) as soon as it is read, so the span never holds more than one block
        in host memory or in full precision."""
        device = torch.device(device)
        span = cls(ModelConfig.from_folder(folder), start, end, dtype)
        checkpoint = Checkpoint(folder)
        # a progress bar on a terminal (tqdm leaves logs and pipes alone): big spans take minutes to read
        indices = tqdm(
            range(start, end), desc=f"Loading blocks {start}:{end}", unit="block", disable=None, leave=False
        )
        for index in indices:
            load_weights(span._model[0], checkpoint, checkpoint.block_names(index), dtype)
            block = span.blocks[index - start]
            missing = missing_on_meta(block)
            if missing:
                lacking = missing[:5]
                raise UnsupportedModel(f"{folder}: the checkpoint lacks tensors of block {index}: {lacking}")
            block.to(device)
            if quantize is not None and quantize_blocks(block, quantize):
                span.needs_no_grad = True
        span._model.clear()  # the rest of the model (meta tensors) is no longer needed
        span.rotary.to(device)
        span.device = device
        span.dtype = dtype
        span.quantized = quantize
        _measure_cache_shape(span)
        span.requires_grad_(False)
        return span.eval()

    def computing(self) -> contextlib.AbstractContextManager:
        """The grad mode of passes that need no gradients: inference_mode (the fastest), or no_grad for a
        span whose quantized experts torchao cannot index under inference_mode."""
        return torch.no_grad() if self.needs_no_grad else torch.inference_mode()

    @property
    def cache_bytes_per_token(self) -> int:
        """What one token's cache takes over the whole span, as the layers store it."""
        return self.cache_shape.bytes_per_token(self.dtype.itemsize) * (self.end - self.start)

    @property
    def precision(self) -> str:
        """What the weights are stored in: float32 | float16 | bfloat16 | int8 | int4."""
        return self.quantized or str(self.dtype).removeprefix("torch.")

    def forward(
        self,
        hidden: torch.Tensor,
        context: AttentionContext | None = None,
        position: int = 0,
        prompts: torch.Tensor | None = None,
        blocks: tuple[int, int] | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run blocks [a, b) of the model (absolute indices, default: the whole span).

        hidden: [B, T, hidden] for tokens at positions [position, position + T), or at `positions` [T]
        when given (packed batches of several sequences).
        prompts: optional deep-prompt additions aligned with hidden, [b - a, B or 1, T, hidden] (see
        `align_prompts`), added to each block's input. The context's cache layer i belongs to block a + i.
        """
        first, last = blocks or (self.start, self.end)
        if positions is None:
            positions = torch.arange(position, position + hidden.shape[1], device=hidden.device)
        position_ids = positions[None]
        rotary = self._rotary(hidden, position_ids, first, last)
        cache = ContextCache()
        with active_context(context or NoCache(), first):
            for layer, block in enumerate(self.blocks[first - self.start : last - self.start]):
                if prompts is not None:
                    hidden = hidden + prompts[layer].to(hidden.dtype)
                hidden = block(
                    hidden,
                    attention_mask=None,
                    position_ids=position_ids,
                    **{self._cache_kwarg: cache},
                    use_cache=True,
                    position_embeddings=rotary[self.layer_types[first + layer]],
                )
        return hidden

    def _rotary(self, hidden: torch.Tensor, position_ids: torch.Tensor, first: int, last: int) -> dict:
        """(cos, sin) per layer type of blocks [first, last), as the family's model computes them."""
        types = set(self.layer_types[first:last])
        if self._typed_rotary:
            return {kind: self.rotary(hidden, position_ids, kind) for kind in types}
        shared = self.rotary(hidden, position_ids)
        return dict.fromkeys(types, shared)


def _cache_kwarg(block: nn.Module) -> str:
    """The name a family's decoder layer takes its cache under (`cache` in most of transformers 5)."""
    parameters = inspect.signature(block.forward).parameters
    return next((n for n in ("cache", "past_key_values", "layer_past") if n in parameters), "cache")


class _ShapeProbe:
    """An attention context that records what a layer stores per token and what it attends with, and
    attends to nothing."""

    stored: tuple[torch.Size, torch.Size] | None = None
    attended: tuple[torch.Size, torch.Size] | None = None

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.stored = self.stored or (k.shape[1:], v.shape[1:])
        return k, v

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scores) -> torch.Tensor:
        self.attended = self.attended or (k.shape[1:], v.shape[1:])
        return q.new_zeros(*q.shape[:3], v.shape[-1])


def _measure_cache_shape(span: Span) -> None:
    """What the layers store per token ([heads, 1, d] keys and values), and whether they attend with what
    they stored or with something made from it (multi-head latent attention expands a cached latent):
    then the cache hands them their history (CacheShape.gathers)."""
    probe = _ShapeProbe()
    with span.computing():
        span(
            torch.zeros(1, 1, span.config.hidden_size, dtype=span.dtype, device=span.device),
            probe,
            blocks=(span.start, span.start + 1),
        )
    model_type = span.config.model_type
    if probe.stored is None or probe.attended is None:
        raise UnsupportedModel(
            f"{model_type}: its attention does not go through transformers' cache interface"
        )
    keys, values = probe.stored
    if keys[1] != 1 or values[1] != 1:
        raise UnsupportedModel(
            f"{model_type}: its attention stores keys {list(keys)} and values {list(values)} per token; "
            "corolla's cache holds [heads, 1, d] per token"
        )
    gathers = probe.attended != probe.stored
    span.cache_shape = CacheShape(keys[0], keys[2], values[0], values[2], gathers)


def align_prompts(prompts: torch.Tensor | None, position: int, length: int) -> torch.Tensor | None:
    """Deep prompts [blocks, B, P, H] as additions for positions [position, position + length), or None.

    prompts[:, :, p] is added to the token at absolute position p; positions >= P get nothing.
    """
    if prompts is None or prompts.numel() == 0 or position >= prompts.shape[2]:
        return None
    aligned = prompts.new_zeros(prompts.shape[0], prompts.shape[1], length, prompts.shape[3])
    covered = min(prompts.shape[2], position + length) - position
    aligned[:, :, :covered] = prompts[:, :, position : position + covered]
    return aligned
