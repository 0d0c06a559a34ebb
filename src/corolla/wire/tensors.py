"""Tensors on the wire: hivemind's `runtime_pb2.Tensor` format, read defensively.

Serialization uses hivemind's own format (so hivemind and Petals peers can read it). Deserialization is
ours: a peer controls every byte, so the compression type, dtype, rank, shape and buffer length are all
checked before a tensor is built, and a bad one raises `InvalidRequest` naming the tensor. A receiver
checks the declared shape and dtype (`declared_shape`, `declared_dtype`) against its own limits first,
so an oversized tensor is refused before a byte of it is copied. A stream's chunk counts are checked
against its byte limit as its first chunks arrive.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator

import torch
from hivemind.compression import serialize_torch_tensor
from hivemind.proto import runtime_pb2
from hivemind.utils.streaming import split_for_streaming

from corolla.errors import InvalidRequest

NONE = runtime_pb2.CompressionType.NONE
FLOAT16 = runtime_pb2.CompressionType.FLOAT16
MAX_RANK = 5
MAX_NUMEL = 2**31 - 1
STREAM_CHUNK_BYTES = 2**20  # big chunks: p2pd streams cost per message, and the unary cap is 4 MiB

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
}
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def serialize(tensor: torch.Tensor, compression: int = NONE) -> runtime_pb2.Tensor:
    """Encode a CPU tensor; FLOAT16 compression is applied to float32 tensors only."""
    tensor = tensor.detach()
    if compression == FLOAT16 and tensor.dtype != torch.float32:
        compression = NONE
    return serialize_torch_tensor(tensor.contiguous(), compression)


def empty() -> runtime_pb2.Tensor:
    """The placeholder for an absent optional tensor (Petals' "dummy")."""
    return serialize(torch.empty(0))


def declared_shape(proto: runtime_pb2.Tensor, name: str) -> tuple[int, ...]:
    """A tensor's shape as its sender declared it, checked without reading its buffer.

    Every dimension is bounded, zero-sized tensors included: [0, 2**32-1, 2**32-1] holds no element, but
    its strides overflow when torch builds it. So the product of the non-zero dimensions is bounded too.
    """
    shape = tuple(int(s) for s in proto.size)
    if len(shape) > MAX_RANK:
        raise InvalidRequest(f"tensor {name}: rank {len(shape)} exceeds the maximum of {MAX_RANK}")
    extent = 1
    for dim in shape:
        if not 0 <= dim <= MAX_NUMEL:
            raise InvalidRequest(f"tensor {name}: dimension {dim} in {list(shape)} is outside 0..{MAX_NUMEL}")
        extent *= max(dim, 1)
        if extent > MAX_NUMEL:
            raise InvalidRequest(
                f"tensor {name}: shape {list(shape)} has more elements than the maximum of {MAX_NUMEL} "
                f"(zero dimensions aside)"
            )
    return shape


def declared_dtype(proto: runtime_pb2.Tensor, name: str) -> torch.dtype:
    """A tensor's dtype as its sender declared it, one of the dtypes corolla reads."""
    dtype = _DTYPES.get(proto.dtype)
    if dtype is None:
        raise InvalidRequest(f"tensor {name}: dtype {proto.dtype!r} is not one of {sorted(_DTYPES)}")
    return dtype


def deserialize(proto: runtime_pb2.Tensor, name: str) -> torch.Tensor:
    """Decode a tensor sent by a peer, checking every field against the buffer it came with."""
    shape = declared_shape(proto, name)
    numel = math.prod(shape)
    dtype = declared_dtype(proto, name)
    if proto.compression == NONE:
        return _from_raw(proto.buffer, dtype, shape, numel, name)
    if proto.compression == FLOAT16:
        if dtype not in FLOAT_DTYPES:
            raise InvalidRequest(f"tensor {name}: FLOAT16 compression is only valid for float tensors")
        return _from_raw(proto.buffer, torch.float16, shape, numel, name).to(dtype)
    raise InvalidRequest(f"tensor {name}: compression type {proto.compression} is not supported")


def _from_raw(
    buffer: bytes, dtype: torch.dtype, shape: tuple[int, ...], numel: int, name: str
) -> torch.Tensor:
    itemsize = torch.empty((), dtype=dtype).element_size()
    if dtype == torch.bfloat16 and len(buffer) == 4 * numel and numel > 0:
        # hivemind's legacy bfloat16 mode sends float32 values
        return _from_raw(buffer, torch.float32, shape, numel, name).to(torch.bfloat16)
    if len(buffer) != numel * itemsize:
        raise InvalidRequest(
            f"tensor {name}: buffer has {len(buffer)} bytes, but shape {list(shape)} of {dtype} needs "
            f"{numel * itemsize}"
        )
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(buffer), dtype=dtype).reshape(shape)


def split(proto: runtime_pb2.Tensor) -> Iterator[runtime_pb2.Tensor]:
    """Split a serialized tensor into stream chunks; the first chunk records how many follow."""
    return split_for_streaming(proto, STREAM_CHUNK_BYTES)


def combine(chunks: Iterable[runtime_pb2.Tensor], name: str) -> runtime_pb2.Tensor:
    """Join the chunks of one tensor, checking that none was lost on the way."""
    chunks = list(chunks)
    if not chunks:
        raise InvalidRequest(f"tensor {name}: no chunks received")
    expected = max(chunks[0].chunks, 1)
    if len(chunks) != expected:
        raise InvalidRequest(
            f"tensor {name}: received {len(chunks)} chunks, the first chunk announced {expected}"
        )
    whole = runtime_pb2.Tensor()
    whole.CopyFrom(chunks[0])
    whole.buffer = b"".join(chunk.buffer for chunk in chunks)
    whole.chunks = 0
    return whole


def split_tensors(protos: Iterable[runtime_pb2.Tensor]) -> Iterator[runtime_pb2.Tensor]:
    """Chunks of several tensors, one after another."""
    for proto in protos:
        yield from split(proto)


def combine_tensors(parts: list[runtime_pb2.Tensor], names: tuple[str, ...]) -> list[runtime_pb2.Tensor]:
    """Regroup a flat list of chunks into whole tensors, using each first chunk's count."""
    tensors, index = [], 0
    while index < len(parts):
        count = max(parts[index].chunks, 1)
        name = names[len(tensors)] if len(tensors) < len(names) else f"#{len(tensors)}"
        tensors.append(combine(parts[index : index + count], name))
        index += count
    return tensors


def max_stream_chunks(limit_bytes: int, num_tensors: int) -> int:
    """The most chunks `num_tensors` tensors of `limit_bytes` bytes in all split into (each tensor may end
    in a partial chunk, and an empty one still takes a chunk)."""
    return -(-limit_bytes // STREAM_CHUNK_BYTES) + num_tensors


def count_expected_chunks(
    parts: list[runtime_pb2.Tensor], num_tensors: int, limit_bytes: int | None = None
) -> int | None:
    """How many chunks make `num_tensors` whole tensors, or None while a first chunk is still missing.

    With `limit_bytes` (the stream's byte limit), a first chunk announcing more chunks than that many bytes
    can fill is refused as soon as it arrives, not when the stream ends.
    """
    most = None if limit_bytes is None else max_stream_chunks(limit_bytes, num_tensors)
    index = 0
    for i in range(num_tensors):
        if index >= len(parts):
            return None
        announced = parts[index].chunks
        index += max(announced, 1)
        if most is not None and index > most:
            raise InvalidRequest(
                f"tensor #{i}: its first chunk announces {announced} chunks; a stream of at most "
                f"{limit_bytes} bytes here carries at most {most} chunks of {STREAM_CHUNK_BYTES} bytes"
            )
    return index
