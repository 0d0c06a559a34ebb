import pytest

from corolla.errors import InvalidRequest
from corolla.wire.records import STALE_PERIODS, STALE_SLACK, ServerState, ServerStatus, block_uids


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
    assert ServerStatus.from_dict(record()).batch_growth is None  # from a peer too old to say
    assert ServerStatus.from_dict(record(batch_growth=0.04)).batch_growth == 0.04


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (record(state=7), "'state' must be <= 2"),
        (record(start=5, end=5), "'end' must be greater than start=5"),
        (record(version=None), "'version' is required"),
        (record(adapters=[1]), "'adapters' must be a list of strings"),
        (record(batch_growth=-0.5), "'batch_growth' must be >= 0"),
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


def test_a_record_not_renewed_for_one_and_a_half_periods_is_stale():
    status = ServerStatus.from_dict(record(announced_at=1000.0, announce_period=30.0))
    assert (status.announced_at, status.announce_period) == (1000.0, 30.0)
    limit = 1000.0 + STALE_PERIODS * 30.0 + STALE_SLACK  # 50 s: a live server renews every 30 s
    assert not status.stale(1000.0 + 31) and not status.stale(limit) and status.stale(limit + 0.1)
    assert not ServerStatus.from_dict(record()).stale(1e12)  # a peer too old to say: never stale
    with pytest.raises(InvalidRequest, match="announce_period"):
        ServerStatus.from_dict(record(announce_period="often"))
