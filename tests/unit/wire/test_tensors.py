import pytest
import torch
from hivemind.compression import serialize_torch_tensor
from hivemind.proto import runtime_pb2

from corolla.errors import InvalidRequest
from corolla.wire import tensors


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64])
def test_roundtrip_is_exact(dtype):
    x = (torch.randn(2, 3, 5) * 10).to(dtype)
    assert torch.equal(tensors.deserialize(tensors.serialize(x), "x"), x)


def test_reads_what_hivemind_writes_including_fp16_compression():
    x = torch.randn(4, 7)
    y = tensors.deserialize(serialize_torch_tensor(x, runtime_pb2.CompressionType.FLOAT16), "x")
    assert y.dtype == torch.float32 and torch.allclose(x, y, atol=1e-2)


def test_empty_tensor():
    assert tensors.deserialize(tensors.empty(), "e").numel() == 0


def bad(**changes):
    proto = tensors.serialize(torch.zeros(2, 3))
    for key, value in changes.items():
        if key == "size":
            del proto.size[:]
            proto.size.extend(value)
        else:
            setattr(proto, key, value)
    return proto


@pytest.mark.parametrize(
    ("proto", "message"),
    [
        (bad(buffer=b"\x00" * 5), "buffer has 5 bytes, but shape [2, 3] of torch.float32 needs 24"),
        (bad(size=[2, 4]), "needs 32"),
        (bad(dtype="object"), "dtype 'object' is not one of"),
        (bad(dtype="float64"), "dtype 'float64' is not one of"),
        (bad(compression=runtime_pb2.CompressionType.QUANTILE_8BIT), "compression type 3 is not supported"),
        (bad(size=[1] * 9), "rank 9 exceeds the maximum of 5"),
        (bad(size=[2**20, 2**20]), "has more elements than the maximum"),
        # no element, but strides that overflow: torch raised an untyped RuntimeError
        (
            bad(size=[0, 2**32 - 1, 2**32 - 1]),
            "dimension 4294967295 in [0, 4294967295, 4294967295] is outside",
        ),
        (
            bad(size=[0, 2**20, 2**20]),
            "has more elements than the maximum of 2147483647 (zero dimensions aside)",
        ),
    ],
)
def test_malformed_tensors_are_rejected(proto, message):
    with pytest.raises(InvalidRequest) as info:
        tensors.deserialize(proto, "hidden_states")
    assert "tensor hidden_states" in str(info.value) and message in str(info.value)


def test_chunking_roundtrip_and_lost_chunk_detection():
    big = torch.randn(3, 700_000)  # ~8 MB: several 1 MiB chunks
    small = torch.randn(2, 2)
    parts = list(tensors.split_tensors([tensors.serialize(big), tensors.serialize(small)]))
    assert len(parts) > 3
    assert tensors.count_expected_chunks(parts, 2) == len(parts)
    assert tensors.count_expected_chunks(parts[:2], 2) is None
    whole = tensors.combine_tensors(parts, ("big", "small"))
    assert torch.equal(tensors.deserialize(whole[0], "big"), big)
    assert torch.equal(tensors.deserialize(whole[1], "small"), small)
    first_tensor_chunks = parts[0].chunks
    with pytest.raises(InvalidRequest, match="received 2 chunks"):
        tensors.combine(parts[: min(2, first_tensor_chunks - 1)], "big")


def test_declared_shape_and_dtype_are_read_without_the_buffer():
    proto = bad(size=[1, 2**20, 64], buffer=b"")  # the buffer is not looked at
    assert tensors.declared_shape(proto, "x") == (1, 2**20, 64)
    assert tensors.declared_dtype(proto, "x") == torch.float32
    with pytest.raises(InvalidRequest, match="tensor x: dtype 'int8' is not one of"):
        tensors.declared_dtype(bad(dtype="int8"), "x")


def test_a_first_chunk_announcing_more_chunks_than_the_byte_limit_allows_is_refused_at_once():
    limit = 3 * tensors.STREAM_CHUNK_BYTES
    assert tensors.max_stream_chunks(limit, 2) == 5  # 3 full chunks, and a partial one per tensor
    first = runtime_pb2.Tensor(chunks=2**31 - 1, size=[1, 2, 64], dtype="float32", buffer=b"")
    with pytest.raises(InvalidRequest, match=r"tensor #0: its first chunk announces 2147483647 chunks"):
        tensors.count_expected_chunks([first], 2, limit)
    assert tensors.count_expected_chunks([first], 2) is None  # without a limit (a client's read): waits


def test_streams_up_to_the_byte_limit_pass_the_chunk_count_check():
    limit = 3 * tensors.STREAM_CHUNK_BYTES
    for sizes in ([limit // 4, 0], [limit // 8, limit // 8 - 1], [limit // 4 - 1, 1]):  # float32 elements
        parts = list(tensors.split_tensors([tensors.serialize(torch.zeros(n)) for n in sizes]))
        assert tensors.count_expected_chunks(parts, 2, limit) == len(parts)
    big = list(tensors.split(tensors.serialize(torch.zeros(limit // 4))))  # 3 chunks: the whole limit
    second = runtime_pb2.Tensor(chunks=3, size=[3], dtype="float32")  # 3 + 3 > 5
    with pytest.raises(InvalidRequest, match="tensor #1: its first chunk announces 3 chunks"):
        tensors.count_expected_chunks([*big, second], 2, limit)


def test_lossy_encodings_shrink_big_tensors_within_their_error_and_leave_small_ones_exact():
    hidden = torch.randn(1, 64, 576, generator=torch.Generator().manual_seed(0)) * 4  # 147 KB
    lossless = tensors.encode(hidden)
    half = tensors.encode(hidden, "float16")
    eight = tensors.encode(hidden, "blockwise8")
    assert len(half.buffer) == len(lossless.buffer) // 2
    assert len(eight.buffer) < len(lossless.buffer) / 3.8  # a byte per value, a scale per 4096, a codebook
    assert torch.equal(tensors.deserialize(lossless, "h"), hidden)
    assert (tensors.deserialize(half, "h") - hidden).abs().max() < 1e-2
    scale = hidden.abs().max()
    assert (tensors.deserialize(eight, "h") - hidden).abs().max() < 0.03 * scale  # 8-bit codes per block
    step = hidden[:, :1]  # a decode step: 2.3 KB, always lossless
    assert tensors.encode(step, "blockwise8").compression == tensors.NONE
    assert torch.equal(tensors.deserialize(tensors.encode(step, "blockwise8"), "h"), step)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda p: p.buffer[:-1], "blockwise 8-bit of 36864 values needs"),
        (
            lambda p: (3).to_bytes(8, "little") + p.buffer[8:],
            "blockwise 8-bit header \\(3 blocks, 256 codes\\) does not match",
        ),
    ],
)
def test_a_malformed_blockwise_tensor_is_refused_before_bitsandbytes_reads_it(change, message):
    proto = tensors.encode(torch.randn(1, 64, 576), "blockwise8")
    proto.buffer = change(proto)
    with pytest.raises(InvalidRequest, match=message):
        tensors.deserialize(proto, "h")
