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
        (bad(size=[2**20, 2**20]), "elements exceed the maximum"),
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
