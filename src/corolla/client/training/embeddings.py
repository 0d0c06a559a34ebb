"""Embeddings of whole sequences: one forward pass through the swarm, the final norm, then pooling.

A sequence's vector is its final hidden states (after the model's final norm: what the LM head reads),
averaged over its tokens ("mean") or taken at its last token ("last"), then L2-normalized. Sequences run
in right-padded batches: attention is causal and a forward pass starts every row at position 0, so a
row's real tokens never see the padding after them and their states are the sequence's own; the
padding's states are dropped before pooling. Runs on the model's loop (it uses the swarm client there);
the norm and pooling run in a worker thread, off that loop.
"""

from __future__ import annotations

import asyncio
from typing import Literal

import torch
import torch.nn.functional as F

from corolla.client.training.remote_chain import ChainPasses
from corolla.errors import InvalidRequest
from corolla.models.head import ModelHead

Pooling = Literal["mean", "last"]
POOLINGS: tuple[Pooling, ...] = ("mean", "last")
# rows per forward request: servers refuse more than their max_batch_size (64 by default; a small swarm
# may set fewer), which the client does not know, and a refused pass would count against the server
MAX_PASS_ROWS = 8


async def embed_sequences(
    passes: ChainPasses, head: ModelHead, pad_token_id: int, sequences: list[list[int]], pooling: Pooling
) -> torch.Tensor:
    """Unit vectors [N, hidden] (float32), one per sequence of token ids, in the order given: each batch
    embedded by `head`, run through the swarm's blocks by `passes`, normed by `head`, pooled."""
    if pooling not in POOLINGS:
        raise InvalidRequest(f"pooling must be one of {POOLINGS}, got {pooling!r}")
    lengths = [len(ids) for ids in sequences]
    if not sequences or min(lengths) == 0:
        raise InvalidRequest("every sequence to embed needs at least one token")
    vectors: list[torch.Tensor] = [torch.empty(0)] * len(sequences)
    for group in batches(lengths, passes.swarm.config.max_request_tokens):
        rows = [lengths[i] for i in group]
        ids = torch.full((len(group), max(rows)), pad_token_id, dtype=torch.long)
        for row, i in enumerate(group):
            ids[row, : rows[row]] = torch.tensor(sequences[i], dtype=torch.long)
        with torch.no_grad():
            hidden = head.embed(ids)  # [rows, T, H]
        outputs, _ = await passes.forward(hidden, None)  # [rows, T, H], before the final norm
        pooled = await asyncio.to_thread(pool, head.norm, outputs, rows, pooling)
        for row, i in enumerate(group):
            vectors[i] = pooled[row]
    return torch.stack(vectors)


def batches(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Indices of the sequences grouped into padded batches: sorted by length (so that little padding
    is run), at most MAX_PASS_ROWS rows and, past one row, rows x longest <= max_tokens."""
    groups: list[list[int]] = []
    current: list[int] = []
    for i in sorted(range(len(lengths)), key=lengths.__getitem__):
        rows = len(current) + 1
        if current and (rows > MAX_PASS_ROWS or rows * lengths[i] > max_tokens):
            groups.append(current)
            current = []
        current.append(i)
    if current:
        groups.append(current)
    return groups


def pool(norm: torch.nn.Module, outputs: torch.Tensor, lengths: list[int], pooling: Pooling) -> torch.Tensor:
    """The last block's outputs [rows, T, H] of right-padded rows -> unit vectors [rows, H] (float32)."""
    with torch.no_grad():
        counts = torch.tensor(lengths)  # [rows]
        if pooling == "last":
            states = norm(outputs[torch.arange(len(lengths)), counts - 1]).float()  # [rows, H]
        else:
            real = torch.arange(outputs.shape[1])[None, :] < counts[:, None]  # [rows, T]
            normed = norm(outputs).float()  # [rows, T, H]
            # where, not a product with the mask: padding's states may be anything, inf included
            states = torch.where(real[..., None], normed, 0.0).sum(dim=1) / counts[:, None]  # [rows, H]
        return F.normalize(states, dim=-1)
