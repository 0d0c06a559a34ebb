"""The records' tree (swarm/record_cells.py): servers placed by its own rules in an in-memory DHT
(sim/record_tree.py), read back by its own walks."""

import random

import pytest

from corolla.sim.record_tree import RecordTree, seen
from corolla.swarm.record_cells import (
    CELL_SERVERS,
    READ_ON,
    cell_key,
    cell_of,
    choose_level,
    position,
    weight,
)

PREFIX = "m"


def grow(servers: int, num_blocks: int, span: int, rounds: int, rng: random.Random) -> RecordTree:
    """`servers` servers of `span` blocks each join one by one, then all re-announce `rounds` times."""
    spans = []
    for _ in range(servers):
        start = rng.randrange(num_blocks - span + 1)
        spans.append(range(start, start + span))
    return RecordTree.settled(PREFIX, num_blocks, spans, rounds, rng)


def test_a_small_swarm_is_level_zero_and_read_whole():
    tree = grow(servers=40, num_blocks=20, span=5, rounds=2, rng=random.Random(0))
    assert all(place.level == 0 for place in tree.places.values())
    assert set(tree.cells) <= {cell_key(PREFIX, b, 0, 0) for b in range(20)}  # the blocks' keys themselves
    for where in (None, 0, 2**63):
        assert set(seen(tree.walk(where))) == set(tree.places)


@pytest.mark.parametrize("servers", [300, 1200])
def test_a_large_swarm_keeps_cells_bounded_and_every_server_seen_on_its_path(servers):
    rng = random.Random(servers)
    tree = grow(servers, num_blocks=20, span=6, rounds=3, rng=rng)
    per_block = servers * 6 / 20
    assert max(len(peers) for peers in tree.cells.values()) <= 2 * CELL_SERVERS + 4
    assert max(place.level for place in tree.places.values()) >= 2
    for peer, place in tree.places.items():  # a reader down a server's path reaches its level
        assert seen(tree.walk(place.where)).get(peer) == place.level
    samples = [seen(tree.walk(rng.getrandbits(64))) for _ in range(20)]
    assert max(len(s) for s in samples) < 0.7 * servers  # a sample, not the swarm
    # weighted by the servers each stands for, a walk estimates a block's servers without bias
    estimates = [sum(weight(level) for level in s.values()) for s in samples]
    assert 0.6 * servers < sum(estimates) / len(estimates) < 1.4 * servers
    assert per_block > READ_ON


def test_after_a_third_of_the_servers_left_the_roots_refill_and_every_server_is_seen():
    rng = random.Random(5)
    tree = grow(servers=1200, num_blocks=20, span=6, rounds=2, rng=rng)
    for peer in rng.sample(sorted(tree.places), 400):  # gone: their records expired
        for key in tree.keys_of(peer):
            tree.cells[key].discard(peer)
        del tree.places[peer]
    for _ in range(2):
        for peer in rng.sample(sorted(tree.places), len(tree.places)):
            tree.announce(peer, tree.blocks[peer], rng)
    for peer, place in tree.places.items():
        assert seen(tree.walk(place.where)).get(peer) == place.level
    for block in range(20):
        servers = sum(block in blocks for peer, blocks in tree.blocks.items() if peer in tree.places)
        # refilled from below, toward READ_ON (each round brings the missing ones in expectation)
        assert len(tree.cells[cell_key(PREFIX, block, 0, 0)]) >= min(READ_ON // 2, servers)


def test_the_whole_tree_walk_sees_every_server():
    tree = grow(servers=600, num_blocks=20, span=6, rounds=2, rng=random.Random(1))
    everything = tree.walk(None)
    assert set(seen(everything)) == set(tree.places)
    assert len(everything.found) >= 3


def test_a_level_is_kept_while_readers_reach_it_and_left_when_they_do_not():
    full = CELL_SERVERS
    assert choose_level([[0]], None) == 0
    assert choose_level([[full, 3], [4, full], [3, 3]], None) == 2  # the shallowest with room in each
    assert choose_level([[full - 1, 3], [full, 3], [3, 3]], None) == 0
    assert choose_level([[full, full], [full, 3], [3, 3]], current=0) == 0  # readers still reach it
    assert choose_level([[5]], current=3) == 0  # readers stop at level 0 now: it comes up
    crowded = [[10 * full], [3]]
    stays = sum(choose_level(crowded, 0, random.Random(i)) == 0 for i in range(1000))
    assert 120 < stays < 280  # a cell 5x past its bound keeps about 2 x CELL_SERVERS of its servers
    # a block's root lost its servers (READ_ON - 4 left): under it, 2 x 32 at level 1, 4 x 32 at level 2,
    # 8 x 8 at level 3 (7 others and this one): 256 servers, of which about 4 come up
    emptied = [[READ_ON - 4, full], [full, full], [full, full], [7, 7]]
    up = sum(choose_level(emptied, 3, random.Random(i)) == 0 for i in range(2000))
    assert 12 < up < 55  # 4 / 256 of the time: 31 expected
    assert choose_level([[READ_ON - 4, 2 * full], [full, full], [7, 7]], 2, random.Random(0)) == 2  # no room
    assert choose_level([[READ_ON, full], [full, full], [7, 7]], 2, random.Random(0)) == 2  # not empty


def test_cells_and_positions():
    assert cell_key("m", 7, 0, 0) == "m.7"
    assert cell_key("m", 7, 3, 5) == "m.7.3.5"
    where = position("peer")
    assert position("peer") == where and 0 <= where < 2**64
    assert cell_of(where, 0) == 0 and cell_of(where, 1) == where >> 63 and cell_of(where, 64) == where
