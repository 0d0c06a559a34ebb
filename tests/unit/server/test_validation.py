"""Checks of requests before work and before memory: validation.py, and the RPC layer's receive side.

Tensors are checked from their declared shape and dtype before a byte is decoded (a stand-in for
`deserialize` that fails proves it was never reached); the handler's streams are fed by fake peers.
"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
import torch
from hivemind.proto import runtime_pb2

from corolla.errors import InvalidRequest, ServerUnavailable, WireError
from corolla.server import validation
from corolla.server.handler import TransformerConnectionHandler
from corolla.server.inference.forward_passes import PassService
from corolla.wire import tensors as wire_tensors

H = 64


@pytest.mark.parametrize(
    ("uid", "blocks"), [("p.0 p.1", (0, 2)), ("p.3", (3, 4)), ("p.0 p.1 p.2 p.3", (0, 4))]
)
def test_parse_uid_reads_ascii_block_ids(uid, blocks):
    assert validation.parse_uid(uid, "p", 0, 4) == blocks


@pytest.mark.parametrize("uid", ["p.\u0660", "p.0 p.\u0661", "p.\uff11", "p.\u09e8", "p.1\n"])
def test_parse_uid_refuses_non_ascii_digits(uid):
    with pytest.raises(InvalidRequest, match="is not one of this server's blocks"):
        validation.parse_uid(uid, "p", 0, 4)


@pytest.fixture
def no_decoding(monkeypatch):
    """Fails any test that decodes a tensor: the checks must refuse from the declared fields alone."""

    def deserialize(proto, name):
        raise AssertionError(f"{name} was decoded before it was checked")

    monkeypatch.setattr(wire_tensors, "deserialize", deserialize)


def declared(*shape: int, dtype: str = "float32") -> runtime_pb2.Tensor:
    """A tensor as a peer may declare it: any shape, with a buffer far smaller than it claims."""
    return runtime_pb2.Tensor(size=list(shape), dtype=dtype, buffer=b"\x00" * 16)


@pytest.mark.parametrize(
    ("proto", "message"),
    [
        (declared(1, 2**20, H), "hidden_states: length 1048576 exceeds max_length=16"),
        (declared(5, 2, H), "batch size 5 is outside 1..4"),
        (declared(1, 0, H), "length must be at least 1 token"),
        (declared(1, 2, 32), "must have shape [batch, length, 64], got [1, 2, 32]"),
        (declared(1, 2, H, dtype="int64"), "must be float32, float16 or bfloat16, got torch.int64"),
        (declared(0, 2**32 - 1, 2**32 - 1), "tensor hidden_states: dimension 4294967295"),
    ],
)
def test_hidden_states_are_refused_from_their_declared_shape(no_decoding, proto, message):
    with pytest.raises(InvalidRequest) as info:
        validation.read_hidden([proto], H, max_batch_size=4, max_length=16)
    assert message in str(info.value)


def test_check_hidden_names_the_limit_and_passes_what_fits():
    assert validation.check_hidden(declared(4, 16, H), H, 4, 16) == (4, 16)
    with pytest.raises(InvalidRequest, match="length 17 exceeds the session's max_length=16"):
        validation.check_hidden(declared(1, 17, H), H, 4, 16, "the session's max_length")
    with pytest.raises(InvalidRequest, match="4 x 40 tokens exceed max_forward_tokens=128"):
        validation.check_pass_hidden(declared(4, 40, H), H, 4, 128)
    hidden = torch.randn(2, 3, H)
    assert torch.equal(validation.read_hidden([wire_tensors.serialize(hidden)], H, 4, max_length=3), hidden)


def test_other_tensors_are_refused_from_their_declared_shape(no_decoding):
    inputs = [declared(1, 2, H)]
    with pytest.raises(
        InvalidRequest, match="shaped like the inputs \\[1, 2, 64\\], got torch.float32 \\[1, 9"
    ):
        validation.read_grad_outputs([*inputs, declared(1, 900_000, H)], torch.zeros(1, 2, H))
    with pytest.raises(InvalidRequest, match="prompts: prefix length 100000 exceeds max_length=16"):
        validation.read_prompts([*inputs, declared(2, 1, 100_000, H)], 2, 1, H, max_length=16)
    with pytest.raises(InvalidRequest, match="prompts must be empty or a float tensor"):
        validation.read_prompts([*inputs, declared(2, 1, 4, H, dtype="int64")], 2, 1, H, max_length=16)
    with pytest.raises(InvalidRequest, match="hypo_ids must be int64 \\[1\\], got torch.int64 \\[1000000\\]"):
        validation.read_hypo_ids([*inputs, declared(0), declared(10**6, dtype="int64")], 1)


def test_optional_tensors_still_read_as_before():
    prompts = torch.randn(2, 1, 3, H)
    protos = [wire_tensors.serialize(torch.randn(2, 3, H)), wire_tensors.serialize(prompts)]
    assert validation.read_prompts(protos, 2, 2, H, max_length=8).shape == (2, 2, 3, H)
    assert validation.read_prompts([protos[0], wire_tensors.empty()], 2, 2, H, max_length=8) is None
    empty_with_bytes = runtime_pb2.Tensor(size=[0], dtype="float32", buffer=b"\x00" * 4)
    with pytest.raises(InvalidRequest, match="buffer has 4 bytes"):
        validation.read_prompts([protos[0], empty_with_bytes], 2, 2, H, max_length=8)
    hypo = wire_tensors.serialize(torch.tensor([1, 0]))
    assert validation.read_hypo_ids([*protos, hypo], 2).tolist() == [1, 0]
    assert validation.read_hypo_ids([*protos, wire_tensors.empty()], 2) is None


# --- the RPC layer's receive side (server/handler.py, server/inference/forward_passes.py), fed by fake peers
# ------------------

STEP_TIMEOUT = 0.3
PEER = SimpleNamespace(remote_id="peer")  # the P2PContext of a call
LIMIT = 3 * wire_tensors.STREAM_CHUNK_BYTES


CONFIG = SimpleNamespace(
    step_timeout=STEP_TIMEOUT, max_batch_size=4, inference_max_length=64, max_forward_tokens=128
)


class FakePasses(PassService):
    """The pass service's stream reading (`collect`, the real one) over a fake engine."""

    def __init__(self, error: Exception | None = None):
        super().__init__(spans=None, config=CONFIG, width=H)
        self.error, self.calls = error, 0

    def stream_limit(self) -> int:
        return LIMIT

    async def forward(self, uid, meta, protos, peer=""):
        self.calls += 1
        if self.error is not None:
            raise self.error
        return wire_tensors.deserialize(protos[0], "hidden_states")


def handler(passes: FakePasses) -> TransformerConnectionHandler:
    inference = SimpleNamespace(config=CONFIG, width=H, prompt_size=H)
    return TransformerConnectionHandler(inference, passes, status=None)


def forward_request(hidden: torch.Tensor | None = None) -> runtime_pb2.ExpertRequest:
    hidden = torch.randn(1, 2, H) if hidden is None else hidden
    return runtime_pb2.ExpertRequest(uid="p.0", tensors=[wire_tensors.serialize(hidden)])


async def messages(*items, then_wait: bool = False):
    for item in items:
        yield item
    if then_wait:  # a peer that keeps its stream open and sends nothing more
        await asyncio.sleep(3600)


async def run_stream(passes: FakePasses, requests) -> list[runtime_pb2.ExpertResponse]:
    return [reply async for reply in handler(passes).rpc_forward_stream(requests, context=PEER)]


async def test_an_unexpected_error_reaches_the_caller_as_a_typed_error(caplog):
    passes = FakePasses(RuntimeError("Stride calculation overflowed"))
    with pytest.raises(ServerUnavailable) as info:
        await handler(passes).rpc_forward(forward_request(), PEER)
    assert repr(info.value) == "ServerUnavailable: rpc_forward: internal error on this server (RuntimeError)"
    assert "Stride calculation overflowed" in caplog.text  # the traceback stays in the server's log
    prompts = runtime_pb2.ExpertRequest(tensors=[wire_tensors.empty()])
    with pytest.raises(
        WireError, match=r"^ServerUnavailable: rpc_forward_stream: internal error .*RuntimeError"
    ):
        await run_stream(passes, messages(forward_request(), prompts))


async def test_a_typed_error_keeps_its_class():
    request = runtime_pb2.ExpertRequest(tensors=[declared(0, 2**32 - 1, 2**32 - 1)])
    with pytest.raises(InvalidRequest, match="tensor hidden_states: dimension 4294967295"):
        await handler(FakePasses()).rpc_forward(request, PEER)


async def test_a_forward_stream_is_answered_and_read_to_its_end():
    hidden = torch.randn(1, 2, H)
    chunks = [forward_request(hidden), runtime_pb2.ExpertRequest(tensors=[wire_tensors.empty()])]
    replies = await run_stream(FakePasses(), messages(*chunks))
    assert torch.equal(wire_tensors.deserialize(replies[0].tensors[0], "outputs"), hidden)


def first_chunk(chunks: int) -> runtime_pb2.Tensor:
    return runtime_pb2.Tensor(chunks=chunks, size=[1, 2, H], dtype="float32")


@pytest.mark.parametrize(
    ("chunks", "message"),
    [
        ([], "no request arrived within step_timeout"),
        ([runtime_pb2.ExpertRequest(tensors=[declared(1, 2, H)])], "no request arrived within step_timeout"),
        (
            [runtime_pb2.ExpertRequest(tensors=[first_chunk(2**31 - 1)])],
            "its first chunk announces 2147483647 chunks; a stream of at most 3145728 bytes",
        ),
        (
            [runtime_pb2.ExpertRequest(tensors=[first_chunk(2)])] + [runtime_pb2.ExpertRequest()] * 100_000,
            "a message after 1 chunks carries no tensors",
        ),
        (
            [runtime_pb2.ExpertRequest(tensors=[first_chunk(1)] + [wire_tensors.empty()] * 99_999)],
            "stream carries 100000 chunks, its first chunks announce 2",
        ),
        (
            [runtime_pb2.ExpertRequest(tensors=[declared(1, 2**20, H)])],
            "tokens exceed max_forward_tokens=128",
        ),
    ],
)
async def test_a_stream_is_refused_at_once_or_within_the_step_timeout(chunks, message):
    passes = FakePasses()
    started = time.monotonic()
    with pytest.raises(WireError) as info:
        await asyncio.wait_for(run_stream(passes, messages(*chunks, then_wait=True)), 5)
    assert message in str(info.value) and str(info.value).startswith(("InvalidRequest", "SessionTimeout"))
    assert time.monotonic() - started < STEP_TIMEOUT + 2 and passes.calls == 0


async def test_a_caller_that_never_ends_its_stream_is_let_go_after_the_reply():
    replies = []
    chunks = (forward_request(), runtime_pb2.ExpertRequest(tensors=[wire_tensors.empty()]))
    stream = handler(FakePasses()).rpc_forward_stream(messages(*chunks, then_wait=True), context=PEER)

    async def read_all():
        async for reply in stream:
            replies.append(reply)

    with pytest.raises(WireError, match="SessionTimeout: no request arrived within step_timeout=0.3s"):
        await asyncio.wait_for(read_all(), 5)
    assert len(replies) == 1


async def test_an_idle_push_stream_is_closed_after_the_step_timeout():
    push = handler(FakePasses()).rpc_push(messages(then_wait=True), PEER)
    with pytest.raises(
        WireError, match=f"SessionTimeout: no request arrived within step_timeout={STEP_TIMEOUT}"
    ):
        await asyncio.wait_for(anext(push), 5)
