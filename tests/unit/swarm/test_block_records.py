"""The records' tree over real hivemind DHT peers on 127.0.0.1: four servers' signed records placed by
record_cells' rules (its bounds lowered to one server a cell, so that four make a tree), read back down
each server's own path, down other paths, and whole."""

from __future__ import annotations

import asyncio

import pytest
from hivemind.utils import get_dht_time

from corolla.config import SwarmConfig
from corolla.swarm import record_cells
from corolla.swarm.block_records import announce, find_spans, placed, read_swarm
from corolla.swarm.dht import start_dht, visible_addresses
from corolla.swarm.record_cells import Place, position
from corolla.wire.records import ServerStatus

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
    monkeypatch.setattr(record_cells, "CELL_SERVERS", 1)
    monkeypatch.setattr(record_cells, "READ_ON", 1)

    async def scenario():
        places = {}
        for dht in peers:  # one by one, as servers join: each walks its own path, then announces
            me = str(dht.peer_id)
            place = Place(position(me))
            read = await read_swarm(dht, PREFIX, BLOCKS, place.where)
            place.update(read.walk, range(BLOCKS), me)
            assert await announce(dht, PREFIX, record(2.0), 60, level=place.level, where=place.where)
            places[me] = place
        return places, {me: await read_swarm(peers[0], PREFIX, BLOCKS, p.where) for me, p in places.items()}

    places, own_paths = asyncio.run(scenario())
    levels = sorted(place.level for place in places.values())
    assert levels[0] == 0 and levels[1] == 1 and levels[-1] >= 1  # the root held one: the others went down
    for me, read in own_paths.items():
        found = {span.peer_id: span for span in read.spans}
        assert found[me].level == places[me].level and (found[me].start, found[me].end) == (0, BLOCKS)
        assert placed(read)[me][2] == 2.0 * 2 ** places[me].level  # it stands for 2**level servers
    whole = asyncio.run(find_spans(peers[0], PREFIX, BLOCKS))
    assert sorted(span.peer_id for span in whole) == sorted(places)
    deep = next(me for me, place in places.items() if place.level >= 1)
    elsewhere = places[deep].where ^ (1 << 63)  # a path parting from its own at level 1
    other = asyncio.run(find_spans(peers[0], PREFIX, BLOCKS, where=elsewhere))
    assert deep not in {span.peer_id for span in other}
    assert any(span.level == 0 for span in other)  # the root is on every path
