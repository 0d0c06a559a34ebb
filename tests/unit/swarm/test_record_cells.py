"""The records' tree (swarm/records/record_cells.py): servers placed by its own rules in an in-memory DHT
(sim/record_tree.py), read back by its own walks."""

import random

import pytest

from corolla.sim.record_tree import RecordTree, seen
from corolla.swarm.records.record_cells import (
    CELL_SERVERS,
    DEEP_READ_ON,
    DEEP_SERVERS,
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


def roots(num_blocks: int) -> set[str]:
    return {cell_key(PREFIX, 0, 0, block) for block in range(num_blocks)}


def test_a_small_swarm_is_level_zero_and_read_whole():
    tree = grow(servers=40, num_blocks=20, span=5, rounds=2, rng=random.Random(0))
    assert all(place.level == 0 for place in tree.places.values())
    assert set(tree.cells) <= roots(20)  # the blocks' keys themselves
    for where in (None, 0, 2**63):
        assert set(seen(tree.walk(where))) == set(tree.places)


@pytest.mark.parametrize("servers", [300, 1500])
def test_a_large_swarm_keeps_keys_bounded_and_every_server_seen_on_its_path(servers):
    rng = random.Random(servers)
    tree = grow(servers, num_blocks=20, span=6, rounds=3, rng=rng)
    for key, peers in tree.cells.items():
        assert len(peers) <= 2 * (CELL_SERVERS if key in roots(20) else DEEP_SERVERS) + 4, key
    assert max(place.level for place in tree.places.values()) >= 2
    for peer, place in tree.places.items():  # a reader down a server's path reaches its level
        assert seen(tree.walk(place.where)).get(peer) == place.level
    walks = [tree.walk(rng.getrandbits(64)) for _ in range(20)]
    samples = [seen(walk) for walk in walks]
    assert max(len(s) for s in samples) < 0.8 * servers  # a sample, not the swarm
    # the blocks' keys, then one key a level
    assert all(sum(len(level) for level in walk.found) <= 20 + len(walk.found) for walk in walks)
    # weighted by the servers each stands for, a walk estimates the swarm without bias
    estimates = [sum(weight(level) for level in s.values()) for s in samples]
    assert 0.7 * servers < sum(estimates) / len(estimates) < 1.3 * servers


def test_after_a_third_of_the_servers_left_the_roots_refill_and_every_server_is_seen():
    rng = random.Random(5)
    tree = grow(servers=1200, num_blocks=20, span=6, rounds=2, rng=rng)
    for peer in rng.sample(sorted(tree.places), 400):  # gone: their records expired
        tree.remove(peer)
    for _ in range(2):
        for peer in rng.sample(sorted(tree.places), len(tree.places)):
            tree.announce(peer, tree.blocks[peer], rng)
    for peer, place in tree.places.items():
        assert seen(tree.walk(place.where)).get(peer) == place.level
    for block in range(20):
        servers = sum(block in blocks for blocks in tree.blocks.values())
        # refilled from below, toward READ_ON (each round brings the missing ones in expectation)
        assert len(tree.cells[cell_key(PREFIX, 0, 0, block)]) >= min(READ_ON // 2, servers)


def test_the_whole_tree_walk_sees_every_server():
    tree = grow(servers=1500, num_blocks=20, span=6, rounds=2, rng=random.Random(1))
    everything = tree.walk(None)
    assert set(seen(everything)) == set(tree.places)
    assert len(everything.found) >= 3


def test_a_clients_read_takes_the_first_levels_whole_then_one_path():
    tree = grow(servers=1500, num_blocks=20, span=6, rounds=2, rng=random.Random(3))
    walk = tree.walk(None, budget=5)  # levels 1 (2 cells) and 2 (4) do not fit in 5: level 2 on a path
    assert [len(found) for found in walk.found][:3] == [20, 2, 1]
    assert all(len(found) == 1 for found in walk.found[2:])
    found = seen(walk)
    assert {peer for peer, place in tree.places.items() if place.level <= 1} <= set(found)
    assert set(seen(tree.walk(None, budget=1000))) == set(tree.places)  # enough for the whole tree
    # the path a budget leaves to chance is the given generator's (the simulator's seeded one), not Python's
    paths = []
    for global_seed in (1, 2):
        random.seed(global_seed)
        rng = random.Random(7)
        paths.append([tree.walk(None, budget=5, rng=rng).where for _ in range(3)])
    assert paths[0] == paths[1] and len(set(paths[0])) > 1


def test_a_level_is_kept_while_readers_reach_it_and_left_when_they_do_not():
    full = CELL_SERVERS
    deep = DEEP_SERVERS
    assert choose_level([[0]], None) == 0
    assert choose_level([[full, 3], [deep], [3]], None) == 2  # the shallowest cell with room
    assert choose_level([[full - 1, 3], [deep], [3]], None) == 0
    assert choose_level([[full, full], [deep], [3]], current=0) == 0  # still among the 2 x 32 fastest
    assert choose_level([[2 * full], [3]], current=0) == 1  # fallen behind: leaves
    assert choose_level([[5], [3], [3]], current=2) == 0  # room under every block's key: comes up
    assert choose_level([[5], [deep]], current=3) == 0  # readers stop at level 1 now: it comes up
    # under the blocks' keys the fastest stay: 40 others, 10 and 31 of them faster than this server
    assert choose_level([[40, 40], [3]], None, faster=[10, 31]) == 0
    assert choose_level([[80], [3]], 0, faster=[63]) == 0
    assert choose_level([[80], [3]], 0, faster=[64]) == 1
    crowded = [[full], [10 * deep], [3]]
    stays = sum(choose_level(crowded, 1, rng=random.Random(i)) == 1 for i in range(1000))
    assert 120 < stays < 280  # a cell 5x past its room keeps about twice its room of its servers
    # a cell lost its servers (DEEP_READ_ON - 4 left): under it 2 x 64 at level 2 and 4 x 8 at level 3
    # (7 others and this one): 160, of which about 4 come up
    emptied = [[full], [DEEP_READ_ON - 4], [deep], [7]]
    up = sum(choose_level(emptied, 3, rng=random.Random(i)) == 1 for i in range(2000))
    assert 25 < up < 80  # 4 / 160 of the time: 50 expected


def test_the_blocks_keys_keep_the_fastest_servers():
    rng = random.Random(7)
    spans = [range(s, s + 6) for s in (rng.randrange(15) for _ in range(1500))]
    speeds = [rng.uniform(1, 100) for _ in spans]
    tree = RecordTree.settled(PREFIX, 20, spans, rounds=2, rng=rng, speeds=speeds)
    at_root = [i for i in range(1500) if tree.places[f"peer{i}"].level == 0]
    deeper = [i for i in range(1500) if tree.places[f"peer{i}"].level > 0]
    assert sum(speeds[i] for i in at_root) / len(at_root) > 1.5 * sum(speeds[i] for i in deeper) / len(deeper)
    for i in deeper:  # none of them would be among the 32 fastest under each of its blocks' keys
        ahead = [
            sum(tree.speeds[p] > speeds[i] for p in tree.cells[cell_key(PREFIX, 0, 0, b)]) for b in spans[i]
        ]
        assert max(ahead) >= CELL_SERVERS
    assert all(len(tree.cells[cell_key(PREFIX, 0, 0, b)]) <= 2 * CELL_SERVERS + 4 for b in range(20))


def test_keys_and_positions():
    assert cell_key("m", 0, 0, 7) == "m.7"  # a block's key: what servers of small swarms use
    assert cell_key("m", 3, 5) == "m.cells.3.5"
    where = position("peer")
    assert position("peer") == where and 0 <= where < 2**64
    assert cell_of(where, 0) == 0 and cell_of(where, 1) == where >> 63 and cell_of(where, 64) == where
