import pytest

from corolla.errors import InvalidRequest
from corolla.wire.records import ServerState, ServerStatus, block_uids


def record(**changes):
    base = ServerStatus(
        state=ServerState.ONLINE,
        start=2,
        end=5,
        version="0.1.0",
        dtype="float32",
        inference_max_length=128,
        cache_tokens_available=1000,
        num_sessions=1,
    )
    return {**base.to_dict(), **changes}


def test_roundtrip():
    assert ServerStatus.from_dict(record()).end == 5


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (record(state=7), "'state' must be <= 2"),
        (record(start=5, end=5), "'end' must be greater than start=5"),
        (record(version=None), "'version' is required"),
        (record(adapters=[1]), "'adapters' must be a list of strings"),
        ("not a dict", "announcement must be a map"),
    ],
)
def test_malformed_records_are_rejected(data, message):
    with pytest.raises(InvalidRequest, match=message):
        ServerStatus.from_dict(data)


def test_block_uids():
    assert block_uids("m", 2, 5) == "m.2 m.3 m.4"


def test_next_pings_roundtrip_and_validation():
    data = record(next_pings={"peerB": 0.0123})
    assert ServerStatus.from_dict(data).next_pings == (("peerB", 0.0123),)
    with pytest.raises(InvalidRequest, match="next_pings"):
        ServerStatus.from_dict(record(next_pings={"peerB": "fast"}))
    with pytest.raises(InvalidRequest, match="next_pings"):
        ServerStatus.from_dict(record(next_pings={f"p{i}": 0.1 for i in range(100)}))
