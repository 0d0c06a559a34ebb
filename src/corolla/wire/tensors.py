"""Tensors on the wire: hivemind's `runtime_pb2.Tensor` format, read defensively.

Serialization uses hivemind's own format (so hivemind and Petals peers can read it). Deserialization is
ours: a peer controls every byte, so the compression type, dtype, rank, shape and buffer length are all
checked before a tensor is built, and a bad one raises `InvalidRequest` naming the tensor. A receiver
checks the declared shape and dtype (`declared_shape`, `declared_dtype`) against its own limits first,
so an oversized tensor is refused before a byte of it is copied. A stream's chunk counts are checked
against its byte limit as its first chunks arrive.

Encodings of hidden states between hops (`ENCODINGS`): lossless by default; opt-in, lossy and announced,
"float16" (hivemind's FLOAT16: half the bytes of float32) and "blockwise8" (bitsandbytes' blockwise
8-bit codes, in hivemind's BLOCKWISE_8BIT layout: the block count, the blocks' scales, the codebook, a
byte per value; a little over a quarter of the bytes). corolla writes blocks of BLOCKWISE_BLOCK values,
not hivemind's 4096: hidden states have outlier channels, and a block's scale is set by its largest
value (measured on SmolLM2: blocks of 4096 changed the greedy text after a 2,000-token prompt far
more often); the reader infers the block size from the block count. A lossy encoding applies only to
tensors of at least LOSSY_MIN_BYTES (prefills, big trees): a decode step's few kilobytes cost the same
time on any link, so they stay exact.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import struct
from collections.abc import Iterable, Iterator

import torch
from hivemind.compression import serialize_torch_tensor
from hivemind.proto import runtime_pb2
from hivemind.utils.streaming import split_for_streaming

from corolla.config import WIRE_ENCODINGS
from corolla.errors import InvalidRequest

NONE = runtime_pb2.CompressionType.NONE
FLOAT16 = runtime_pb2.CompressionType.FLOAT16
BLOCKWISE_8BIT = runtime_pb2.CompressionType.BLOCKWISE_8BIT
ENCODINGS = dict(zip(WIRE_ENCODINGS, (NONE, FLOAT16, BLOCKWISE_8BIT), strict=True))
LOSSY_MIN_BYTES = 32 * 1024  # smaller tensors (decode steps) always travel lossless
BLOCKWISE_BLOCK = 256  # values per scale
BLOCKWISE_CODES = 256  # bitsandbytes' dynamic 8-bit map
BLOCKWISE_SIZES = (64, 128, 256, 512, 1024, 2048, 4096)  # the block sizes bitsandbytes quantizes in
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
    """Encode a tensor (from any device); FLOAT16 and BLOCKWISE_8BIT compression apply to float32 only."""
    tensor = tensor.detach().cpu()
    if compression in (FLOAT16, BLOCKWISE_8BIT) and (tensor.dtype != torch.float32 or tensor.numel() == 0):
        compression = NONE
    if compression == BLOCKWISE_8BIT:
        return _to_blockwise(tensor)
    return serialize_torch_tensor(tensor.contiguous(), compression)


def _to_blockwise(tensor: torch.Tensor) -> runtime_pb2.Tensor:
    from bitsandbytes.functional import quantize_blockwise

    codes, state = quantize_blockwise(tensor.contiguous(), blocksize=BLOCKWISE_BLOCK, nested=False)
    header = struct.pack("<qq", state.absmax.numel(), state.code.numel())
    parts = (header, state.absmax.float().numpy().tobytes(), state.code.float().numpy().tobytes())
    return runtime_pb2.Tensor(
        buffer=b"".join(parts) + codes.numpy().tobytes(),
        size=tensor.shape,
        dtype="float32",
        compression=BLOCKWISE_8BIT,
    )


def encode(tensor: torch.Tensor, encoding: str = "lossless") -> runtime_pb2.Tensor:
    """Hidden states in a hop's agreed encoding (lossy ones only from LOSSY_MIN_BYTES on)."""
    compression = ENCODINGS[encoding]
    if tensor.numel() * tensor.element_size() < LOSSY_MIN_BYTES:
        compression = NONE
    return serialize(tensor, compression)


@functools.cache
def supported_encodings() -> tuple[str, ...]:
    """The encodings this peer reads and writes (blockwise8 needs bitsandbytes)."""
    has_bnb = importlib.util.find_spec("bitsandbytes") is not None
    return tuple(name for name in ENCODINGS if name != "blockwise8" or has_bnb)


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
    if proto.compression in (FLOAT16, BLOCKWISE_8BIT) and dtype not in FLOAT_DTYPES:
        raise InvalidRequest(
            f"tensor {name}: compression {proto.compression} is only valid for float tensors"
        )
    if proto.compression == FLOAT16:
        return _from_raw(proto.buffer, torch.float16, shape, numel, name).to(dtype)
    if proto.compression == BLOCKWISE_8BIT and "blockwise8" in supported_encodings():
        return _from_blockwise(proto, dtype, numel, name)
    raise InvalidRequest(f"tensor {name}: compression type {proto.compression} is not supported")


def _from_blockwise(proto: runtime_pb2.Tensor, dtype: torch.dtype, numel: int, name: str) -> torch.Tensor:
    """hivemind's blockwise 8-bit layout, checked before bitsandbytes reads it: the block and code counts,
    their float32 scales and codebook, then one uint8 code per value; the block size is the one of
    bitsandbytes' sizes that gives that many blocks (hivemind writes 4096, corolla BLOCKWISE_BLOCK)."""
    if numel == 0 or len(proto.buffer) < 16:
        raise InvalidRequest(f"tensor {name}: a blockwise 8-bit tensor needs values and a header")
    blocks, codes = struct.unpack_from("<qq", proto.buffer)
    size = next((b for b in BLOCKWISE_SIZES if -(-numel // b) == blocks), None)
    if size is None or codes != BLOCKWISE_CODES:
        raise InvalidRequest(
            f"tensor {name}: blockwise 8-bit header ({blocks} blocks, {codes} codes) does not match its "
            f"{numel} values"
        )
    expected = 16 + 4 * (blocks + BLOCKWISE_CODES) + numel
    if len(proto.buffer) != expected:
        raise InvalidRequest(
            f"tensor {name}: buffer has {len(proto.buffer)} bytes, blockwise 8-bit of {numel} values "
            f"needs {expected}"
        )
    # read here, not by hivemind's BlockwiseQuantization.extract: it fails on numpy 2 (int() of an array)
    from bitsandbytes.functional import dequantize_blockwise

    buffer = bytearray(proto.buffer)
    absmax = torch.frombuffer(buffer, dtype=torch.float32, offset=16, count=blocks)
    code = torch.frombuffer(buffer, dtype=torch.float32, offset=16 + 4 * blocks, count=BLOCKWISE_CODES)
    codes = torch.frombuffer(buffer, dtype=torch.uint8, offset=16 + 4 * (blocks + BLOCKWISE_CODES))
    values = dequantize_blockwise(
        codes.reshape(tuple(proto.size)), absmax=absmax, code=code, blocksize=size, nested=False
    )
    return values.to(dtype)


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
    tensors = []
    index = 0
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
