"""Checks of a request against this server: its blocks, its model's shapes and its limits.

`wire/` has already checked types; these checks need the server's span and configuration. Each raises
`InvalidRequest` with the field, the value and the bound, so a client knows what to fix.
"""

from __future__ import annotations

import re

import torch
from hivemind.proto import runtime_pb2

from corolla.errors import InvalidRequest
from corolla.wire import tensors as wire_tensors

MAX_UID_CHARS = 64 * 1024


def parse_uid(uid: str, dht_prefix: str, start: int, end: int) -> tuple[int, int]:
    """The blocks [a, b) named by a space-separated chain of block ids; they must lie in [start, end)."""
    if not uid or len(uid) > MAX_UID_CHARS:
        raise InvalidRequest(f"uid must name 1 or more blocks (got {len(uid)} characters)")
    indices = []
    pattern = re.compile(re.escape(dht_prefix) + r"\.(\d{1,9})")
    for part in uid.split(" "):
        match = pattern.fullmatch(part)
        if match is None:
            raise InvalidRequest(
                f"uid: block {part[:100]!r} is not one of this server's blocks "
                f"({dht_prefix}.{start} .. {dht_prefix}.{end - 1})"
            )
        indices.append(int(match.group(1)))
    first = indices[0]
    if indices != list(range(first, first + len(indices))):
        raise InvalidRequest(f"uid: blocks {indices[:16]} are not contiguous and increasing")
    if not start <= first or first + len(indices) > end:
        raise InvalidRequest(
            f"uid: blocks {first}:{first + len(indices)} are outside this server's span {start}:{end}"
        )
    return first, first + len(indices)


def read_hidden(protos: list[runtime_pb2.Tensor], hidden_size: int, max_batch_size: int) -> torch.Tensor:
    """The first tensor of a request: hidden states [B, T, hidden] in a float dtype."""
    if not protos:
        raise InvalidRequest("hidden_states: the request carries no tensors")
    hidden = wire_tensors.deserialize(protos[0], "hidden_states")
    if hidden.dim() != 3 or hidden.shape[2] != hidden_size:
        raise InvalidRequest(
            f"hidden_states must have shape [batch, length, {hidden_size}], got {list(hidden.shape)}"
        )
    if hidden.dtype not in wire_tensors.FLOAT_DTYPES:
        raise InvalidRequest(f"hidden_states must be float32, float16 or bfloat16, got {hidden.dtype}")
    batch, length = hidden.shape[:2]
    if not 1 <= batch <= max_batch_size:
        raise InvalidRequest(f"hidden_states: batch size {batch} is outside 1..{max_batch_size}")
    if length < 1:
        raise InvalidRequest("hidden_states: length must be at least 1 token")
    return hidden


def read_grad_outputs(protos: list[runtime_pb2.Tensor], like: torch.Tensor) -> torch.Tensor:
    """Tensor 1 of a backward request: the gradient of the span's outputs, shaped like its inputs."""
    if len(protos) < 2:
        raise InvalidRequest("grad_outputs: a backward request carries inputs, grad_outputs and prompts")
    grad = wire_tensors.deserialize(protos[1], "grad_outputs")
    if grad.shape != like.shape or grad.dtype not in wire_tensors.FLOAT_DTYPES:
        raise InvalidRequest(
            f"grad_outputs must be a float tensor shaped like the inputs {list(like.shape)}, "
            f"got {grad.dtype} {list(grad.shape)}"
        )
    if not bool(torch.isfinite(grad).all()):
        raise InvalidRequest("grad_outputs holds NaN or infinite values")
    return grad


def read_prompts(
    protos: list[runtime_pb2.Tensor],
    num_blocks: int,
    batch: int,
    hidden_size: int,
    max_length: int,
    index: int = 1,
    expand: bool = True,
) -> torch.Tensor | None:
    """Optional deep prompts (tensor `index`): empty, or [num_blocks, B or 1, P, hidden], P <= max_length.

    Expanded to the batch unless `expand` is off (a backward pass then returns gradients of the shape sent).
    """
    if len(protos) <= index:
        return None
    prompts = wire_tensors.deserialize(protos[index], "prompts")
    if prompts.numel() == 0:
        return None
    shape = list(prompts.shape)
    if (
        prompts.dim() != 4
        or shape[0] != num_blocks
        or shape[1] not in (1, batch)
        or shape[3] != hidden_size
        or prompts.dtype not in wire_tensors.FLOAT_DTYPES
    ):
        raise InvalidRequest(
            f"prompts must be empty or a float tensor [{num_blocks}, {batch}, prefix, "
            f"{hidden_size}], got {prompts.dtype} {shape}"
        )
    if shape[2] > max_length:
        raise InvalidRequest(f"prompts: prefix length {shape[2]} exceeds max_length={max_length}")
    return prompts.expand(num_blocks, batch, shape[2], hidden_size) if expand else prompts


def read_hypo_ids(protos: list[runtime_pb2.Tensor], batch: int) -> torch.Tensor | None:
    """Optional beam reordering (tensor 2): empty, or int64 [B] with values in [0, B)."""
    if len(protos) < 3:
        return None
    hypo_ids = wire_tensors.deserialize(protos[2], "hypo_ids")
    if hypo_ids.numel() == 0:
        return None
    if hypo_ids.dtype != torch.int64 or list(hypo_ids.shape) != [batch]:
        raise InvalidRequest(f"hypo_ids must be int64 [{batch}], got {hypo_ids.dtype} {list(hypo_ids.shape)}")
    if int(hypo_ids.min()) < 0 or int(hypo_ids.max()) >= batch:
        raise InvalidRequest(f"hypo_ids values must lie in [0, {batch}), got {hypo_ids.tolist()[:16]}")
    return hypo_ids
