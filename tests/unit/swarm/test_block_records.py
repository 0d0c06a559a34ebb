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
from corolla.swarm.dht import start_dht, visible_addresses
from corolla.swarm.records import record_cells
from corolla.swarm.records.block_records import Sighting, _span, announce, find_spans, placed, read_swarm
from corolla.swarm.records.record_cells import Place, position
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


def record(throughput: float) -> ServerStatus:
    now = get_dht_time()
    return ServerStatus(
        0,
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
