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
import math
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm
from transformers.cache_utils import KVSharingDict

from corolla.errors import InvalidRequest, UnsupportedModel
from corolla.models.attention import AttentionContext, CacheShape, NoCache, active_context
from corolla.models.checkpoint import Checkpoint
from corolla.models.compressed_sizes import compressed_bytes_per_token
from corolla.models.context_cache import ContextCache
from corolla.models.handoff import HandingLayer, with_handed
from corolla.models.layer_caches import held_layers, held_pass
from corolla.models.layer_calls import (
    BY_TYPE,
    block_rotaries,
    cache_kwarg,
    index_shared_attention,
    rotary_feeds,
)
from corolla.models.layer_probe import measure_layers
from corolla.models.loading import (
    check_layer_inputs,
    decoder_of,
    empty_model,
    load_weights,
    missing_on_meta,
    rotary_of,
)
from corolla.models.model_config import ATTENTION_NAME, ModelConfig
from corolla.models.quantize import quantize_blocks, warn_if_int8_loses_grid
from corolla.models.row_passes import by_rows, indexed_pass, positioned_blocks, positioned_pass, run_block
from corolla.models.tied import load_tied


class Span(nn.Module):
    def __init__(self, config: ModelConfig, start: int, end: int, dtype: torch.dtype = torch.float32):
        super().__init__()
        _check_blocks(config, start, end)
        self.config = config
        self.start = start
        self.end = end
        # a list: not a submodule, not in state_dict
        self._model = [empty_model(config, ATTENTION_NAME, dtype)]
        _, decoder = decoder_of(self._model[0])
        check_layer_inputs(config.model_type, decoder.layers, config.wire.carries)
        self.blocks = index_shared_attention(nn.ModuleList(decoder.layers[start:end]), start)
        self.rotary = rotary_of(decoder)  # None: no position embeddings (Jamba, Mamba)
        self.layer_types = config.layer_types
        # a block's attention sublayers with a cache each (LongCat-Flash: 2), numbered block * per_block +
        # sublayer as transformers numbers them; what each cache layer stores per token (span-local index ->
        # shape): the config's, until loading measures what the layers store
        self.per_block = config.cache_layers_per_block
        self.cache_shapes = _configured_shapes(config, start, end)
        # blocks that attend with an earlier block's keys and values (span-local: Gemma 3n and 4)
        self.kv_sources = config.kv_sharing.local_sources(start, end)
        self.dtype = dtype  # of the computation and the cache (quantized weights keep their own)
        self.device = torch.device("cpu")  # of the weights, the cache and the computation (models/devices.py)
        self.quantized: str | None = None  # "int8" | "int4" once quantized (models/quantize.py)
        # torchao's quantized fused experts cannot be indexed under inference_mode (models/quantize.py)
        self.needs_no_grad = False
        # span-local indices of the cache layers that store keys and values (the blocks', per_block 1) and of
        # the blocks that keep a recurrent state (models/recurrent.py), as measured at load
        self.kv_blocks: tuple[int, ...] = tuple(self.cache_shapes)
        self.state_blocks: tuple[int, ...] = ()
        self.state_bytes_per_row = 0  # what one sequence's recurrent states take over the span
        # state blocks whose multi-token form starts from a zero state (transformers' Mamba-1, Jamba): from
        # a state they continue one token at a time
        self.stepwise_blocks: tuple[int, ...] = ()
        self.number_of_states = int(getattr(config.hf, "number_of_conv_states", None) or 1)
        # blocks of DeepSeek sparse attention: an indexer picks the keys each query sees (run row by row)
        self.indexed_blocks = tuple(
            i for i, kind in enumerate(config.layer_types[start:end]) if kind == "indexed_attention"
        )
        self.positioned_blocks = positioned_blocks(self.blocks)  # Llama 4's NoPE layers (row_passes.py)
        # blocks whose cache is transformers' own layer object per sequence (models/layer_caches.py)
        self.held = held_layers(config.hf, self.blocks)
        # what the family's forward hands each layer (None, BY_TYPE or an index into rotaries: layer_calls.py)
        self.rotaries, self._feeds = rotary_feeds(decoder, config.hidden_size, dtype, config.model_type)
        self._cache_kwarg = cache_kwarg(self.blocks[0])
        # Gemma 3n and 4 hand keys and values between their layers within a pass, GLM-5 and Mistral Large 4
        # their sparse-attention selection
        parameters = inspect.signature(self.blocks[0].forward).parameters
        self._shares_kv = "shared_kv_states" in parameters
        self._threads_selection = "prev_topk_indices" in parameters
        self.selection_sources = config.kv_sharing.local_selections(start, end)

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
        tied = {} if quantize is None else None  # tied modules share their weights (unless quantized)
        for index in indices:
            load_weights(span._model[0], checkpoint, checkpoint.block_names(index), dtype, owned=True)
            load_tied(span._model[0], checkpoint, index, dtype, tied)
            block = span.blocks[index - start]
            missing = missing_on_meta(block)
            if missing:
                lacking = missing[:5]
                raise UnsupportedModel(f"{folder}: the checkpoint lacks tensors of block {index}: {lacking}")
            block.to(device)
            if quantize == "int8" and index == start:
                warn_if_int8_loses_grid(block, f"{start}:{end}")
            if quantize is not None and quantize_blocks(block, quantize):
                span.needs_no_grad = True
        if span.rotary is not None and missing_on_meta(span.rotary):
            # a learned rotary embedding (Mistral Large 4's LeRoPE) keeps its weights outside the blocks
            rotary = [name for name in checkpoint.head_names() if "rope" in name or "rotary" in name]
            load_weights(span._model[0], checkpoint, rotary, dtype)
        span._model.clear()  # the rest of the model (meta tensors) is no longer needed
        span.rotaries.to(device)  # the span's own rotary embedding among them
        span.device = device
        span.dtype = dtype
        span.quantized = quantize
        layout = measure_layers(span)
        span.kv_blocks = layout.kv_blocks
        span.cache_shapes = dict(zip(layout.kv_blocks, layout.cache_shapes, strict=True))
        span.state_blocks = layout.state_blocks
        span.stepwise_blocks = layout.stepwise_blocks
        span.state_bytes_per_row = layout.state_bytes_per_row
        span.requires_grad_(False)
        return span.eval()

    def computing(self) -> contextlib.AbstractContextManager:
        """The grad mode of passes that need no gradients: inference_mode (the fastest), or no_grad for a
        span whose quantized experts torchao cannot index under inference_mode."""
        return torch.no_grad() if self.needs_no_grad else torch.inference_mode()

    @property
    def cache_bytes_per_token(self) -> int:
        """What one token's cache takes over the whole span, as the layers store it."""
        paged = sum(self.cache_shapes[b].bytes_per_token(self.dtype.itemsize) for b in self.kv_blocks)
        if self.held is None:
            return paged
        layers = range(self.start, self.end)  # DeepSeek-V4's compressed entries
        return paged + math.ceil(compressed_bytes_per_token(self.config.hf, self.dtype.itemsize, layers))

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

        hidden: [B, T, width] for tokens at positions [position, position + T), or at `positions` [T]
        when given (packed batches of several sequences); width is the model's wire width, the hidden
        size for most families (models/handoff.py).
        prompts: deep-prompt additions [b - a, B or 1, T, hidden] (`align_prompts`) to each block's input.
        The context's cache layer i belongs to block a + i // per_block.
        """
        first, last = blocks or (self.start, self.end)
        if positions is None:
            positions = torch.arange(position, position + hidden.shape[1], device=hidden.device)
        position_ids = positions[None]
        rotary = self._rotary(hidden, position_ids, first, last)
        wire = self.config.wire  # hidden states (or streams), per-layer inputs, token ids: models/handoff.py
        ids = wire.ids(hidden)
        hidden, per_layer_inputs = wire.unpack(hidden, handed=True)
        cache = ContextCache(self.number_of_states)
        context = context or NoCache()
        # every layer's: Gemma 3n's keys and values shared within the pass, DeepSeek-V4's token ids
        shared = {"shared_kv_states": KVSharingDict()} if self._shares_kv else {}
        shared |= {"input_ids": ids} if ids is not None else {}
        # what each row's sparse-attention layer hands the next (GLM-5, Mistral Large 4: row_passes.py)
        carried = {} if self._threads_selection else None
        with active_context(context, first * self.per_block):
            for layer in range(last - first):
                if prompts is not None:  # (none to a handed state)
                    hidden = hidden + with_handed(prompts[layer], wire, first=False).to(hidden.dtype)
                inputs = {
                    "attention_mask": None,
                    "position_ids": position_ids,
                    self._cache_kwarg: cache,
                    "use_cache": True,
                    "position_embeddings": rotary[layer],
                    **shared,
                }
                if per_layer_inputs is not None:
                    inputs["per_layer_input"] = per_layer_inputs[:, :, first + layer]
                local = first + layer - self.start
                hidden = self._run(local, hidden, inputs, context, first * self.per_block, carried)
        return wire.pack(hidden, per_layer_inputs, ids)

    def _run(
        self, local: int, hidden: torch.Tensor, inputs: dict, context, first: int, carried: dict | None
    ) -> torch.Tensor:
        """Block `local` of a pass whose first cache layer is `first` (its first block's): whole, or row by
        row where its own code mixes a packed pass's rows (row_passes.py)."""
        block = self.blocks[local]
        if self.config.wire.handed:  # ZAYA's router state, Zamba's embeddings (models/handoff.py)
            block = HandingLayer(block, self.config.wire, self.dtype, self.start + local)
        if self.held is not None:
            return held_pass(block, hidden, context, first, inputs, self._cache_kwarg, self.held)
        groups = getattr(context, "row_groups", None)  # a packed pass's rows (engine/rows.py)
        if local in self.indexed_blocks:
            return indexed_pass(block, hidden, context, first, inputs, carried, self.config.pooled_indexer)
        since = self.positioned_blocks.get(local)
        if since is not None and int(inputs["position_ids"].max()) >= since:
            return positioned_pass(block, hidden, context, first, inputs, inputs[self._cache_kwarg])
        if groups is not None and local in self.state_blocks:
            hybrid = local * self.per_block in self.kv_blocks  # attention beside the state (Falcon-H1)
            attention = (lambda g: (context.group_context(g), first)) if hybrid else None
            return by_rows(block, hidden, groups, inputs, local in self.stepwise_blocks, attention)
        return run_block(block, hidden, inputs)

    def _rotary(self, hidden: torch.Tensor, position_ids: torch.Tensor, first: int, last: int) -> list:
        """What the family's model hands each of blocks [first, last) as position embeddings."""
        feeds = self._feeds or (BY_TYPE,) * last
        return block_rotaries(
            self.rotary, self.rotaries, feeds, self.layer_types, hidden, position_ids, first, last
        )


def _check_blocks(config: ModelConfig, start: int, end: int) -> None:
    """Blocks [start, end) must be a range of the model's that cuts no group of layers sharing their work
    within a pass (models/kv_sharing.py)."""
    if not 0 <= start < end <= config.num_hidden_layers:
        raise InvalidRequest(
            f"blocks {start}:{end} are not a non-empty range inside the model's "
            f"{config.num_hidden_layers} blocks"
        )
    config.kv_sharing.check_span(start, end, config.model_type)


def _configured_shapes(config: ModelConfig, start: int, end: int) -> dict[int, CacheShape]:
    """Each cache layer of blocks [start, end) as the config describes its attention."""
    per_block = config.cache_layers_per_block
    return {
        local: _configured_shape(config, start + local // per_block)
        for local in range((end - start) * per_block)
    }


def _configured_shape(config: ModelConfig, layer: int) -> CacheShape:
    heads = config.layer_attribute(layer, "num_key_value_heads") or config.num_key_value_heads
    dim = config.layer_attribute(layer, "head_dim") or config.head_dim
    return CacheShape(heads, dim, heads, dim)


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
