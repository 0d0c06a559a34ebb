"""Checks of a request against this server: its blocks, its model's shapes and its limits.

`wire/` has already checked types; these checks need the server's span and configuration. Each raises
`InvalidRequest` with the field, the value and the bound, so a client knows what to fix.
"""

from __future__ import annotations

import math
import re

import torch
from hivemind.proto import runtime_pb2

from corolla.errors import InvalidRequest
from corolla.models.handoff import WireLayout
from corolla.wire import tensors as wire_tensors
from corolla.wire.fields import MAX_METADATA_BYTES

MAX_UID_CHARS = 64 * 1024


def parse_uid(uid: str, dht_prefix: str, start: int, end: int) -> tuple[int, int]:
    """The blocks [a, b) named by a space-separated chain of block ids; they must lie in [start, end)."""
    if not uid or len(uid) > MAX_UID_CHARS:
        raise InvalidRequest(f"uid must name 1 or more blocks (got {len(uid)} characters)")
    indices = []
    pattern = re.compile(re.escape(dht_prefix) + r"\.([0-9]{1,9})")  # not \d: it takes any Unicode digit
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


def check_hidden(
    proto: runtime_pb2.Tensor,
    hidden_size: int,
    max_batch_size: int,
    max_length: int | None = None,
    limit: str = "max_length",
) -> tuple[int, int]:
    """Hidden states' declared [B, T, hidden] and dtype against the limits, before a byte is decoded.

    The buffer must then match that shape (deserialize checks it before copying), so an oversized one
    costs nothing beyond the message hivemind has already read. `limit` names `max_length` in the error.
    Returns (batch, length).
    """
    shape = list(wire_tensors.declared_shape(proto, "hidden_states"))
    if len(shape) != 3 or shape[2] != hidden_size:
        raise InvalidRequest(f"hidden_states must have shape [batch, length, {hidden_size}], got {shape}")
    dtype = wire_tensors.declared_dtype(proto, "hidden_states")
    if dtype not in wire_tensors.FLOAT_DTYPES:
        raise InvalidRequest(f"hidden_states must be float32, float16 or bfloat16, got {dtype}")
    batch, length = shape[:2]
    if not 1 <= batch <= max_batch_size:
        raise InvalidRequest(f"hidden_states: batch size {batch} is outside 1..{max_batch_size}")
    if length < 1:
        raise InvalidRequest("hidden_states: length must be at least 1 token")
    if max_length is not None and length > max_length:
        raise InvalidRequest(f"hidden_states: length {length} exceeds {limit}={max_length}")
    return batch, length


def check_pass_hidden(
    proto: runtime_pb2.Tensor, hidden_size: int, max_batch_size: int, max_forward_tokens: int
) -> None:
    """A forward or backward pass's inputs against max_forward_tokens, before a byte is decoded."""
    batch, length = check_hidden(proto, hidden_size, max_batch_size)
    if batch * length > max_forward_tokens:
        raise InvalidRequest(
            f"hidden_states: {batch} x {length} tokens exceed max_forward_tokens={max_forward_tokens}"
        )


def read_hidden(
    protos: list[runtime_pb2.Tensor],
    hidden_size: int,
    max_batch_size: int,
    max_length: int | None = None,
    limit: str = "max_length",
    wire: WireLayout | None = None,
) -> torch.Tensor:
    """The first tensor of a request: hidden states [B, T, hidden] in a float dtype, T <= max_length,
    checked (`check_hidden`) before it is decoded; the token ids it carries, where `wire` has them, after."""
    if not protos:
        raise InvalidRequest("hidden_states: the request carries no tensors")
    check_hidden(protos[0], hidden_size, max_batch_size, max_length, limit)
    hidden = wire_tensors.deserialize(protos[0], "hidden_states")
    if wire is not None:
        wire.check_ids(hidden)
    return hidden


def read_grad_outputs(protos: list[runtime_pb2.Tensor], like: torch.Tensor) -> torch.Tensor:
    """Tensor 1 of a backward request: the gradient of the span's outputs, shaped like its inputs."""
    if len(protos) < 2:
        raise InvalidRequest("grad_outputs: a backward request carries inputs, grad_outputs and prompts")
    shape = wire_tensors.declared_shape(protos[1], "grad_outputs")
    dtype = wire_tensors.declared_dtype(protos[1], "grad_outputs")
    if shape != tuple(like.shape) or dtype not in wire_tensors.FLOAT_DTYPES:
        raise InvalidRequest(
            f"grad_outputs must be a float tensor shaped like the inputs {list(like.shape)}, "
            f"got {dtype} {list(shape)}"
        )
    grad = wire_tensors.deserialize(protos[1], "grad_outputs")
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
    shape = list(wire_tensors.declared_shape(protos[index], "prompts"))
    if math.prod(shape) == 0:
        wire_tensors.deserialize(protos[index], "prompts")  # an empty tensor's buffer must be empty too
        return None
    dtype = wire_tensors.declared_dtype(protos[index], "prompts")
    if (
        len(shape) != 4
        or shape[0] != num_blocks
        or shape[1] not in (1, batch)
        or shape[3] != hidden_size
        or dtype not in wire_tensors.FLOAT_DTYPES
    ):
        raise InvalidRequest(
            f"prompts must be empty or a float tensor [{num_blocks}, {batch}, prefix, "
            f"{hidden_size}], got {dtype} {shape}"
        )
    if shape[2] > max_length:
        raise InvalidRequest(f"prompts: prefix length {shape[2]} exceeds max_length={max_length}")
    prompts = wire_tensors.deserialize(protos[index], "prompts")
    return prompts.expand(num_blocks, batch, shape[2], hidden_size) if expand else prompts


def read_hypo_ids(protos: list[runtime_pb2.Tensor], batch: int) -> torch.Tensor | None:
    """Optional beam reordering (tensor 2): empty, or int64 [B] with values in [0, B)."""
    if len(protos) < 3:
        return None
    shape = list(wire_tensors.declared_shape(protos[2], "hypo_ids"))
    dtype = wire_tensors.declared_dtype(protos[2], "hypo_ids")
    if math.prod(shape) != 0 and (dtype != torch.int64 or shape != [batch]):
        raise InvalidRequest(f"hypo_ids must be int64 [{batch}], got {dtype} {shape}")
    hypo_ids = wire_tensors.deserialize(protos[2], "hypo_ids")
    if hypo_ids.numel() == 0:
        return None
    if int(hypo_ids.min()) < 0 or int(hypo_ids.max()) >= batch:
        raise InvalidRequest(f"hypo_ids values must lie in [0, {batch}), got {hypo_ids.tolist()[:16]}")
    return hypo_ids


# What one stream message may weigh beyond its tensors: metadata, the uid, protobuf fields and headers
MESSAGE_OVERHEAD_BYTES = MAX_METADATA_BYTES + MAX_UID_CHARS + 4096


def max_step_bytes(hidden_size: int, batch: int, length: int, num_blocks: int) -> int:
    """The longest inference step message within these limits: hidden states [batch, length, hidden] and
    deep prompts [num_blocks, batch, length, hidden] (float32 at most), hypo_ids [batch] (int64).
    A stream message over it is refused from its length header, before its body is read."""
    floats = batch * length * hidden_size * (1 + num_blocks)
    return 4 * floats + 8 * batch + MESSAGE_OVERHEAD_BYTES


def max_chunk_bytes() -> int:
    """The longest message of a forward or backward stream: one chunk (wire/tensors.py) and its header."""
    return wire_tensors.STREAM_CHUNK_BYTES + MESSAGE_OVERHEAD_BYTES
