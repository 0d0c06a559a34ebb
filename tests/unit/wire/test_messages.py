import re

import msgpack
import pytest

from corolla.errors import InvalidRequest
from corolla.wire.messages import ForwardRequest, InferenceStep, NextServer, StepReply
from corolla.wire.records import ServerStatus


def packed(**fields):
    return msgpack.packb(fields, use_bin_type=True)


def test_first_step_roundtrip():
    step = InferenceStep(
        step_id="s1",
        max_length=128,
        session_id="abc",
        alloc_timeout=2.5,
        next_servers=(NextServer("peer", "sess", 3, 7),),
        start_from_position=4,
        fork_of="earlier",
        keep=True,
    )
    parsed = InferenceStep.from_bytes(step.to_bytes(), first=True)
    assert parsed == step


def test_later_steps_ignore_session_fields():
    raw = packed(step_id="s2", max_length="not even checked")
    assert InferenceStep.from_bytes(raw, first=False) == InferenceStep(step_id="s2")


def test_unknown_keys_are_ignored():
    assert InferenceStep.from_bytes(packed(max_length=5, future_field=[1, 2]), first=True).max_length == 5


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (packed(), "'max_length' is required"),
        (packed(max_length="10"), "'max_length' must be an integer, got str"),
        (packed(max_length=10.5), "'max_length' must be an integer, got float"),
        (packed(max_length=True), "'max_length' must be an integer, got bool"),
        (packed(max_length=0), "'max_length' must be >= 1, got 0"),
        (packed(max_length=8, alloc_timeout=-1), "'alloc_timeout' must be >= 0.0"),
        (packed(max_length=8, alloc_timeout=float("nan")), "'alloc_timeout' must be a finite number"),
        (packed(max_length=8, session_id=5), "'session_id' must be a string"),
        (packed(max_length=8, session_id="x" * 500), "'session_id' has 500 characters, the limit is 128"),
        (packed(max_length=8, start_from_position=-2), "'start_from_position' must be >= 0"),
        (
            packed(max_length=8, next_servers=[["p", "s", 5, 2]]),
            "next_servers[0]' has an invalid block range",
        ),
        (packed(max_length=8, next_servers="peer"), "'next_servers' must be a list"),
        (packed(max_length=8, version=99), "'version' must be <= 1"),
        (packed(max_length=8, fork_of=["s"]), "'fork_of' must be a string"),
        (packed(max_length=8, keep="yes"), "'keep' must be a boolean, got str"),
        (b"\xc1\xff\x00garbage", "not valid msgpack"),
        (packed(max_length=8)[:-1], "not valid msgpack"),
        (msgpack.packb([1, 2, 3]), "must be a msgpack map, got list"),
        (b"\x00" * 70_000, "the limit is 65536"),
    ],
)
def test_malformed_metadata_is_rejected_with_the_field_named(raw, message):
    with pytest.raises(InvalidRequest) as info:
        InferenceStep.from_bytes(raw, first=True)
    assert message in str(info.value)


def test_forward_request_roundtrip_and_compression_type():
    assert ForwardRequest.from_bytes(ForwardRequest(output_compression=2).to_bytes()).output_compression == 2
    with pytest.raises(InvalidRequest, match="output_compression"):
        ForwardRequest.from_bytes(packed(output_compression=["fp16"]))


def test_server_info_roundtrip():
    info = ServerStatus(
        version="0.1.0",
        dht_prefix="m",
        start=0,
        end=4,
        dtype="float32",
        inference_max_length=64,
        max_batch_size=8,
        cache_tokens_total=100,
        cache_tokens_available=40,
        num_sessions=2,
    )
    assert ServerStatus.from_bytes(info.to_bytes()) == info


def test_step_reply_names_its_step_and_rejects_garbage():
    assert StepReply.from_bytes(StepReply("abc").to_bytes()).step_id == "abc"
    assert StepReply.from_bytes(b"").step_id is None  # a reply without metadata names no step
    with pytest.raises(
        InvalidRequest, match="rpc_inference reply: field 'step_id' must be a string, got int"
    ):
        StepReply.from_bytes(msgpack.packb({"step_id": 7}))
    with pytest.raises(InvalidRequest, match="rpc_inference reply: metadata is not valid msgpack"):
        StepReply.from_bytes(b"\xc1")


def test_a_status_record_carries_the_weights_precision():
    from corolla.wire.records import ServerStatus

    status = ServerStatus(0, 3, "0.1.0", "float32", 64, 100, precision="int4")
    again = ServerStatus.from_dict(status.to_dict())
    assert (again.precision, again.quantized) == ("int4", True)
    older = {k: v for k, v in status.to_dict().items() if k != "precision"}  # a peer that predates it
    assert (ServerStatus.from_dict(older).precision, ServerStatus.from_dict(older).quantized) == ("", False)
    with pytest.raises(InvalidRequest, match="precision"):
        ServerStatus.from_dict({**status.to_dict(), "precision": 4})


def test_tree_and_accepted_fields_roundtrip_and_reject_garbage():
    step = InferenceStep(step_id="s", start_from_position=4, tree=(-1, 0, 0), accepted=(0, 2))
    assert InferenceStep.from_bytes(step.to_bytes(), first=False) == step
    for fields, message in [
        (dict(tree=[]), "'tree' must hold one parent per token"),
        (dict(tree=[-1, "x"]), "'tree[1]' must be an integer"),
        (dict(accepted=[0, -1]), "'accepted[1]' must be an integer >= 0"),
        (dict(tree=list(range(2000))), "'tree' has 2000 items, the limit is 1024"),
    ]:
        with pytest.raises(InvalidRequest, match=re.escape(message)):
            InferenceStep.from_bytes(msgpack.packb(fields), first=False)


def test_a_refused_steps_reply_carries_its_error():
    reply = StepReply.from_bytes(StepReply("s", error="tree[1]=1: a cycle").to_bytes())
    assert reply == StepReply("s", "tree[1]=1: a cycle")


def test_a_step_reply_names_the_position_and_inputs_it_ran():
    reply = StepReply("s", position=7, inputs="ab" * 16)
    assert StepReply.from_bytes(reply.to_bytes()) == reply
    assert StepReply.from_bytes(StepReply("s").to_bytes()).inputs is None  # a reply that names none
    with pytest.raises(InvalidRequest, match="'position' must be >= 0"):
        StepReply.from_bytes(msgpack.packb({"step_id": "s", "position": -1}))
    with pytest.raises(InvalidRequest, match="'inputs' has 65 characters, the limit is 64"):
        StepReply.from_bytes(msgpack.packb({"step_id": "s", "inputs": "a" * 65}))
