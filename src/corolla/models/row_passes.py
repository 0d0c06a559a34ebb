"""Running a block of a packed pass row by row, where its own code mixes a row's tokens in ways a packed
[1, N, H] pass cannot: layers that keep a recurrent state (batched by group of rows, engine/rows.py; a
hybrid's attention narrowed to the group) and DeepSeek sparse attention (its indexer ranks each query
against every key of its row), whose selection and latent a next layer may reuse (GLM-5 and Mistral
Large 4's "shared" indexer layers and `kv_source_layers`)."""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from transformers.cache_utils import KVSharingDict

from corolla.errors import UnsupportedModel
from corolla.models.attention import active_context
from corolla.models.lora import use_adapters


def by_rows(
    block: nn.Module, hidden: torch.Tensor, groups, inputs: dict, stepwise: bool, attention=None
) -> torch.Tensor:
    """A block that keeps a recurrent state, run on a packed pass [1, N, H] one group of rows at a time
    ([rows, length, H] each, with the group's own states and adapter: engine/rows.py); a `stepwise`
    block continues from a state one token at a time. A hybrid block (attention beside its state: Falcon-H1)
    attends through `attention(group)`, the context of (first block, group) the pass gives it."""
    out = torch.empty_like(hidden)
    packed = hidden.shape[1]
    for group in groups:
        tokens = group.tokens.to(hidden.device)
        shape = (len(group.rows), group.length)
        taken = {name: _take(value, tokens, shape, packed) for name, value in inputs.items()}
        rows = _take(hidden, tokens, shape, packed)
        narrowed = contextlib.nullcontext() if attention is None else active_context(*attention(group))
        with use_adapters(group.adapter), narrowed:
            if stepwise and group.length > 1 and group.rows[0].position > 0:
                steps = [_at(rows, t) for t in range(group.length)]
                result = torch.cat([run_block(block, x, _at(taken, t)) for t, x in enumerate(steps)], dim=1)
            else:
                result = run_block(block, rows, taken)
        out[0, tokens] = result.flatten(0, 1)
    return out


def indexed_pass(
    block: nn.Module,
    hidden: torch.Tensor,
    context,
    first: int,
    inputs: dict,
    carried: dict | None,
    pooled: bool = False,
) -> torch.Tensor:
    """A block of DeepSeek sparse attention: its indexer scores each query against the keys of its own
    sequence, under the layer's attention mask, so a packed pass runs it one row at a time, each row with
    a context of its own (PagedAttention.single_rows) and its visibility as the mask. What a row's layer
    hands the next (the selection a "shared" layer reuses, the keys and values a reusing layer reads:
    Mistral Large 4, GLM-5) is `carried` per row from layer to layer (None: the family hands nothing
    on; key: the row's index in the pass, or None for a pass over whole sequences).

    A `pooled` indexer (GLM-5-Next) takes a [B, T] padding mask and finds what each query sees from
    positions itself: a token tree is run path by path, each root-to-leaf path as the plain sequence the
    model would see."""
    single_rows = getattr(context, "single_rows", None)
    if single_rows is None:
        tree = getattr(context, "tree", None)
        if pooled and tree is not None and not tree.is_chain:
            raise UnsupportedModel("a pooled sparse-attention indexer runs token trees in the engine only")
        mask = _padding(hidden) if pooled else context.visibility(hidden.shape[1]).to(hidden.device)
        return _carrying(block, hidden, {**inputs, "attention_mask": mask}, carried, None)
    out = torch.empty_like(hidden)
    for row, (tokens, row_context) in enumerate(single_rows(by_path=pooled)):
        tokens = tokens.to(hidden.device)
        rows, taken = one_row(hidden, inputs, tokens)
        taken["attention_mask"] = (
            _padding(rows) if pooled else row_context.visibility(len(tokens)).to(hidden.device)
        )
        with active_context(row_context, first), use_adapters(row_context.rows[0].adapter):
            result = _carrying(block, rows, taken, carried, row)
        out[0, tokens] = result[0]
    return out


def positioned_blocks(blocks: nn.ModuleList) -> dict[int, int]:
    """Blocks whose output depends on their cache's length, each with the first position where it does.
    Llama 4's NoPE layers scale their queries by 1 + attn_scale * log1p(floor((p + 1) / floor_scale)),
    positions p counted from `cache.get_seq_length()`: exactly 1 below floor_scale - 1."""
    found = {}
    for index, block in enumerate(blocks):
        attention = getattr(block, "self_attn", None)
        if getattr(attention, "attn_temperature_tuning", False) and not getattr(attention, "use_rope", True):
            found[index] = attention.floor_scale - 1
    return found


def positioned_pass(block: nn.Module, hidden: torch.Tensor, context, first: int, inputs: dict, cache):
    """A block whose code counts its queries' positions as the cache's length plus 0, 1, ... (Llama 4's
    NoPE layers): each row of a packed pass, each root-to-leaf path of a token tree, runs alone with the
    cache (`ContextCache`) answering the row's first position."""
    single_rows = getattr(context, "single_rows", None)
    if single_rows is None:
        return _counted_from(block, hidden, inputs, cache)
    out = torch.empty_like(hidden)
    for tokens, row_context in single_rows(by_path=True):
        tokens = tokens.to(hidden.device)
        rows, taken = one_row(hidden, inputs, tokens)
        with active_context(row_context, first), use_adapters(row_context.rows[0].adapter):
            out[0, tokens] = _counted_from(block, rows, taken, cache)[0]
    return out


def one_row(hidden: torch.Tensor, inputs: dict, tokens: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """Some tokens' part of a packed pass [1, N, ...] as one [1, len(tokens), ...] run (a row, a tree path,
    or several rows laid end to end): their hidden states and their inputs."""
    shape = (1, len(tokens))
    packed = hidden.shape[1]
    taken = {name: _take(value, tokens, shape, packed) for name, value in inputs.items()}
    return _take(hidden, tokens, shape, packed), taken


def _counted_from(block: nn.Module, hidden: torch.Tensor, inputs: dict, cache) -> torch.Tensor:
    positions = inputs["position_ids"][0]
    start = int(positions[0])
    if not torch.equal(positions, torch.arange(start, start + len(positions), device=positions.device)):
        raise UnsupportedModel(
            "a layer that counts positions from its cache runs token trees in the engine only"
        )
    cache.length = start
    try:
        return run_block(block, hidden, inputs)
    finally:
        cache.length = 0


def _padding(hidden: torch.Tensor) -> torch.Tensor:
    """A [B, T] padding mask with no padding (corolla's rows are never padded)."""
    return torch.ones(hidden.shape[:2], dtype=torch.bool, device=hidden.device)


def _carrying(block: nn.Module, hidden: torch.Tensor, inputs: dict, carried: dict | None, key):
    """A sparse-attention block given what the previous layer handed these rows (its selection, and the
    keys and values a reusing layer reads); the selection it used kept for the next layer (a "shared"
    layer's is the one it was given)."""
    if carried is None:
        return run_block(block, hidden, inputs)
    row = carried.setdefault(key, {})
    if "shared_kv_states" in inputs:  # the row's own: the pass's would mix rows' histories
        inputs = {**inputs, "shared_kv_states": row.setdefault("kv", KVSharingDict())}
    out = block(hidden, **inputs, prev_topk_indices=row.get("selection"))
    row["selection"] = out[1]
    return out[0]


def run_block(block: nn.Module, hidden: torch.Tensor, inputs: dict) -> torch.Tensor:
    """A decoder layer's output hidden states (GLM-5's and Mistral Large 4's layers also return their
    sparse-attention selection: `_selecting` keeps it)."""
    out = block(hidden, **inputs)
    return out[0] if isinstance(out, tuple) else out


def _at(value, t: int):
    """Token t of a group's [rows, length, ...] inputs (dicts and tuples element-wise)."""
    if isinstance(value, dict):
        return {name: _at(v, t) for name, v in value.items()}
    if isinstance(value, tuple):
        return tuple(_at(v, t) for v in value)
    if isinstance(value, torch.Tensor) and value.dim() >= 2:
        return value[:, t : t + 1]
    return value


def _take(value, tokens: torch.Tensor, shape: tuple[int, int], packed: int):
    """A packed input's part for some tokens, [1, N, ...] -> [rows, length, ...] (tuples and dicts
    element-wise: DeepSeek-V4's position embeddings by rotary type)."""
    if type(value) is dict:  # not a KVSharingDict
        return {name: _take(v, tokens, shape, packed) for name, v in value.items()}
    if isinstance(value, tuple):
        return tuple(_take(v, tokens, shape, packed) for v in value)
    if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[:2] == (1, packed):
        return value[0, tokens].view(*shape, *value.shape[2:])
    return value
