"""The records' tree over real hivemind DHT peers on 127.0.0.1: four servers' signed records placed by
record_cells' rules (its bounds lowered to one server a key, so that four make a tree), read back down
each server's own path, down other paths, and whole."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from unittest.mock import Mock

import pytest
from hivemind.utils import get_dht_time

from corolla.config import SwarmConfig
from corolla.server.upkeep.link_monitor import LinkMonitor
from corolla.swarm.dht import RemoteSpan, start_dht, visible_addresses
from corolla.swarm.records import record_cells
from corolla.swarm.records.block_records import (
    KeptPath,
    Sighting,
    SwarmRead,
    _span,
    announce,
    find_spans,
    placed,
    read_swarm,
)
from corolla.swarm.records.record_cells import Place, Walk, position
from corolla.wire.records import ServerState, ServerStatus

PREFIX = "tree-test"
BLOCKS = 4


@pytest.fixture(scope="module")
def peers():
    first = start_dht(SwarmConfig(host="127.0.0.1", nat_port_map=False, reachability="public"))
    started = [first]
    try:
        joined = SwarmConfig(
            host="127.0.0.1",
            nat_port_map=False,
            reachability="public",
            initial_peers=tuple(visible_addresses(first)),
        )
        started += [start_dht(joined) for _ in range(3)]
        yield started
    finally:
        for dht in started:
            dht.shutdown()


def record(throughput: float, start: int = 0) -> ServerStatus:
    now = get_dht_time()
    return ServerStatus(
        start,
        BLOCKS,
        "test",
        "float32",
        8192,
        1000,
        throughput=throughput,
        announced_at=now,
        announce_period=30.0,
    )


def test_servers_fill_the_tree_and_each_is_found_down_its_own_path(peers, monkeypatch):
    for bound in ("CELL_SERVERS", "READ_ON", "DEEP_SERVERS", "DEEP_READ_ON"):
        monkeypatch.setattr(record_cells, bound, 1)

    speeds = {}

    async def scenario():
        places = {}
        for i, dht in enumerate(peers):  # one by one, as servers join (each slower than the last): each
            me = str(dht.peer_id)  # walks its own path, then announces
            speeds[me] = 4.0 - i
            place = Place(position(me))
            read = await read_swarm(dht, PREFIX, BLOCKS, place.where)
            place.update(read.walk, range(BLOCKS), me, speeds[me])
            assert await announce(dht, PREFIX, record(speeds[me]), 60, level=place.level, where=place.where)
            places[me] = place
        return places, {me: await read_swarm(peers[0], PREFIX, BLOCKS, p.where) for me, p in places.items()}

    places, own_paths = asyncio.run(scenario())
    levels = sorted(place.level for place in places.values())
    assert levels[0] == 0 and levels[1] == 1 and levels[-1] >= 1  # the blocks' keys held the fastest
    for me, read in own_paths.items():
        found = {span.peer_id: span for span in read.spans}
        assert found[me].level == places[me].level and (found[me].start, found[me].end) == (0, BLOCKS)
        stands_for = 2 ** places[me].level  # it stands for 2**level servers, counted as replicas too
        assert placed(read)[me][2:] == (speeds[me] * stands_for, stands_for)
    whole = asyncio.run(find_spans(peers[0], PREFIX, BLOCKS))
    assert sorted(span.peer_id for span in whole) == sorted(places)
    deep = next(me for me, place in places.items() if place.level >= 1)
    elsewhere = places[deep].where ^ (1 << 63)  # a path parting from its own at level 1
    other = asyncio.run(find_spans(peers[0], PREFIX, BLOCKS, where=elsewhere))
    assert deep not in {span.peer_id for span in other}
    assert any(span.level == 0 for span in other)  # the root is on every path


def test_a_servers_newest_record_decides_and_older_ones_count_only_where_it_agrees():
    def status(start, end, at, state=ServerState.ONLINE):
        return ServerStatus(start, end, "test", "float32", 8192, 1000, state=state, announced_at=at)

    old = status(0, 4, 100.0)  # left behind under blocks 0..3 when the server moved into a cell
    moved = status(2, 8, 200.0)
    seen = [Sighting(old, 0, range(b, b + 1)) for b in range(4)] + [Sighting(moved, 2, range(2, 8))]
    span = _span("p", seen, (ServerState.ONLINE,))
    assert (span.start, span.end, span.level, span.info) == (2, 8, 2, moved)
    stopped = status(2, 8, 300.0, ServerState.OFFLINE)
    assert _span("p", [*seen, Sighting(stopped, 0, range(2, 3))], (ServerState.ONLINE,)) is None
    # under block keys, only the blocks it was found under count: a record claiming 0:4 found under 0, 1
    partial = [Sighting(old, 0, range(b, b + 1)) for b in range(2)]
    found = _span("p", partial, (ServerState.ONLINE,))
    assert (found.start, found.end, found.level) == (0, 2, 0)


def test_a_server_settles_its_place_before_its_first_announcement(peers, monkeypatch):
    """server/upkeep/link_monitor.py `place_first`: a server joining where the blocks' keys are full announces
    in a cell at once (a thousand servers joining together would otherwise all land on the blocks' keys for a
    period); with the DHT unreachable it announces at level 0 rather than not start."""
    for bound in ("CELL_SERVERS", "READ_ON", "DEEP_SERVERS", "DEEP_READ_ON"):
        monkeypatch.setattr(record_cells, bound, 1)
    prefix = "first-place-test"
    spans = SimpleNamespace(primary=SimpleNamespace(blocks=(0, BLOCKS)), dht_prefix=prefix)

    def monitor(dht) -> LinkMonitor:
        return LinkMonitor(dht, None, spans, str(dht.peer_id), BLOCKS, 30.0, lambda: 1.0)

    async def scenario():
        assert await announce(peers[0], prefix, record(9.0), 60)  # a fast server holds the blocks' keys
        joining = monitor(peers[1])
        await joining.place_first()
        return joining.place.level

    assert asyncio.run(scenario()) == 1
    gone = SimpleNamespace(peer_id=peers[2].peer_id, run_coroutine=Mock(side_effect=RuntimeError("DHT gone")))
    broken = monitor(gone)
    asyncio.run(broken.place_first())  # logged, not raised
    assert (broken.place.level or 0) == 0


def test_a_servers_walks_reuse_their_reads_of_the_upper_levels_as_the_swarm_grows(peers, monkeypatch):
    """A server's own walks (links, rebalancing: KeptPath) read each level of its path afresh with
    record_cells.read_chance of the swarm the last walk counted; a reused read still counts the servers it
    found while their records were fresh when it was made."""
    monkeypatch.setattr(record_cells, "KEY_READERS", 1)  # a swarm of two servers is "large"
    prefix, reader = "kept-path-test", peers[1]
    where = position(str(reader.peer_id))

    async def scenario():
        kept = KeptPath()
        assert await announce(peers[0], prefix, record(2.0), 60)
        first = await read_swarm(reader, prefix, BLOCKS, where, kept=kept)
        assert kept.servers == 1.0 and first.read_at == {}  # one server: the blocks' keys read afresh
        assert await announce(peers[2], prefix, record(1.0, start=2), 60)  # a second joins the blocks' keys
        kept.servers = 1e9  # as a swarm of thousands makes it
        reused = await read_swarm(reader, prefix, BLOCKS, where, kept=kept)
        kept.servers = 1.0
        fresh = await read_swarm(reader, prefix, BLOCKS, where, kept=kept)
        return kept, first, reused, fresh

    kept, first, reused, fresh = asyncio.run(scenario())
    assert [span.peer_id for span in first.spans] == [str(peers[0].peer_id)]
    assert [span.peer_id for span in reused.spans] == [str(peers[0].peer_id)]  # the second not yet seen
    assert list(reused.read_at) == [0] and reused.read_at[0] < get_dht_time()
    assert sorted(span.peer_id for span in fresh.spans) == sorted(
        str(p.peer_id) for p in (peers[0], peers[2])
    )
    assert fresh.read_at == {} and kept.servers == 2.0
    assert record_cells.read_chance(0, kept.servers) == 0.5  # half the walks read the blocks' keys
    assert record_cells.read_chance(1, kept.servers) == 1.0  # a cell on half the paths: every walk


def test_a_reused_read_judges_its_records_fresh_as_of_when_it_was_made():
    now = get_dht_time()
    old = ServerStatus(0, BLOCKS, "test", "float32", 8192, 1000, announced_at=now - 100, announce_period=30.0)
    span = RemoteSpan("p", 0, BLOCKS, old, level=0)
    walk = Walk(PREFIX, BLOCKS, where=0)
    assert placed(SwarmRead([span], walk)) == {}  # not renewed for 100 s: gone
    assert placed(SwarmRead([span], walk, {0: now - 90})) == {"p": (0, BLOCKS, 1.0, 1.0)}
    deep = RemoteSpan("p", 0, BLOCKS, old, level=1)  # its level read afresh: judged now
    assert placed(SwarmRead([deep], walk, {0: now - 90})) == {}
