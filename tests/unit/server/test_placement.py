"""Placement: which blocks a new server takes, and which one server moves when that helps (pure logic)."""

import random

import pytest

from corolla.errors import InvalidRequest
from corolla.models.model_config import ModelConfig
from corolla.swarm.policy import placement
from corolla.swarm.policy.placement import (
    best_move,
    better_blocks,
    block_bytes,
    blocks_for_budget,
    choose_blocks,
    coverage,
    my_move,
    planned_moves,
    replicas,
    weakest_holders,
    windows,
)


def test_placement_fills_holes_first():
    assert coverage([(0, 3, 1.0), (2, 5, 1.0)], 6) == [1, 1, 2, 1, 1, 0]
    assert choose_blocks([(0, 10, 1.0), (10, 20, 1.0)], 10, 30) == (20, 30)
    assert choose_blocks([(0, 10, 1.0), (0, 10, 1.0), (10, 30, 1.0)], 10, 30) == (10, 20)
    assert choose_blocks([], 30, 30) == (0, 30)
    # three servers of 12 blocks on a 30-block model cover everything, in the order they arrive
    placed: list = []
    for _ in range(3):
        start, end = choose_blocks(placed, 12, 30)
        placed.append((start, end, 1.0))
    assert min(coverage(placed, 30)) == 1
    # a fourth goes where coverage is thinnest: afterwards no block has fewer servers than before
    fourth = choose_blocks(placed, 12, 30)
    assert (
        min(coverage([*placed, (*fourth, 1.0)], 30)) == 1 and sum(coverage(placed, 30)[slice(*fourth)]) == 12
    )


def test_a_server_moves_only_to_fill_a_hole_or_clearly_help():
    others = [(0, 12, 1.0), (18, 30, 1.0)]  # blocks 12-17 have no server
    target = better_blocks(others, (0, 12), 30, 1.0)  # a server duplicating blocks 0-11 moves to the hole
    assert target is not None and min(coverage([*others, (*target, 1.0)], 30)) == 1
    balanced = [(0, 12, 1.0), (12, 24, 1.0)]
    assert better_blocks(balanced, (18, 30), 30, 1.0) is None  # already no hole: stay
    slow = [(0, 15, 1.0), (15, 30, 10.0)]  # blocks 0-14 have a tenth of the throughput of 15-29
    assert better_blocks(slow, (15, 30), 30, 10.0) == (0, 15)


def test_with_two_holes_moves_that_fill_one_at_a_time_are_made():
    """No single server can fill both holes (blocks 5 and 15): before, the weakest coverage stayed 0
    whatever moved, so nothing moved and both stayed empty for good (corolla sim, a half-crashed swarm).
    Now each move fills one hole without opening another, until none is left."""
    servers = {"a": (0, 5, 1.0), "b": (6, 15, 1.0), "c": (6, 10, 1.0), "d": (16, 20, 1.0)}
    holes = [coverage(servers.values(), 20).count(0.0)]
    while (move := best_move(servers, 20)) is not None:
        servers[move[0]] = (*move[1], 1.0)
        holes.append(coverage(servers.values(), 20).count(0.0))
    assert holes == [2, 1, 0]


def test_a_new_server_gives_blocks_held_once_a_second_server_before_adding_throughput():
    """Blocks 0-9 have one fast server, 10-19 two slow ones: by throughput 10-19 is the thinnest part,
    but a crash of the one fast server would leave 0-9 with none; the new server goes there."""
    others = [(0, 10, 10.0), (10, 20, 1.0), (10, 20, 1.0)]
    assert replicas(others, 20) == [1] * 10 + [2] * 10
    assert choose_blocks(others, 10, 20) == (0, 10)
    # once every block has two, throughput decides again: the thinnest part is 10-19
    assert choose_blocks([*others, (0, 10, 10.0)], 10, 20) == (10, 20)
    # 24 servers of 5 to 7 blocks on 40 blocks, arriving one by one: every block ends on two servers
    rng = random.Random(3)
    placed: list = []
    for _ in range(24):
        weight = rng.uniform(0.5, 4.0)
        placed.append((*choose_blocks(placed, rng.randint(5, 7), 40, weight), weight))
    assert min(replicas(placed, 40)) >= 2
    # a record found down one path of the records' tree stands for more servers than itself: it counts so
    assert replicas([(0, 10, 8.0, 4.0), (5, 10, 1.0)], 10) == [4.0] * 5 + [5.0] * 5
    assert choose_blocks([(0, 10, 8.0, 4.0), (10, 20, 1.0, 1.0)], 10, 20) == (10, 20)


def test_a_server_moves_to_give_a_block_held_once_a_second_server_but_never_takes_one_away():
    # blocks 10-19 are held once (by "b"), 0-9 three times
    servers = {"a": (0, 10, 5.0), "b": (10, 20, 1.0), "c": (0, 10, 5.0), "d": (0, 10, 5.0)}
    assert better_blocks([(0, 10, 1.0), (10, 20, 1.0)], (0, 10), 20, 1.0) is None  # a swap: no gain
    assert best_move(servers, 20) == ("a", (10, 20))  # equal candidates: the smallest peer id
    servers["a"] = (10, 20, 5.0)
    assert best_move(servers, 20) is None  # every block has two: another move would take one away
    # two servers for 20 blocks of 10 each cannot give every block two: nobody moves
    assert best_move({"a": (0, 10, 1.0), "b": (10, 20, 1.0)}, 20) is None


def test_a_wide_hole_is_filled_by_several_servers_planned_at_once_from_one_view():
    """Blocks 4-11 lost their servers: no single server of 4 blocks fills them, so the moves that fill
    them one after another are planned together and each server in the plan moves at its own check."""
    servers = {f"s{i}": (start, start + 4, 1.0) for i, start in enumerate([0, 0, 0, 12, 12, 12, 16, 16])}
    plan = planned_moves(servers, 20)
    assert sorted(plan.values()) == [(4, 8), (8, 12)] and len(set(plan)) == 2
    assert {peer: my_move(servers, peer, 20) for peer in plan} == plan  # each its own part of the plan
    after = {**servers, **{peer: (*target, 1.0) for peer, target in plan.items()}}
    assert min(replicas(after.values(), 20)) >= 1 and planned_moves(after, 20) == {}


def test_the_weakest_blocks_servers_are_the_ones_pinged_while_some_block_has_few():
    servers = {"a": (0, 5, 1.0), "b": (0, 10, 1.0), "c": (5, 10, 1.0), "d": (5, 10, 1.0), "e": (5, 10, 1.0)}
    # blocks 0-4 have two servers, 5-9 four: a and b first (fewest), then the others by peer id
    assert weakest_holders(servers, 10, 3) == ["a", "b", "c"]
    crowded = {f"s{i}": (0, 10, 1.0) for i in range(4)}  # every block has four: nothing to watch
    assert weakest_holders(crowded, 10, 16) == []


def test_memory_budget_sets_the_number_of_blocks():
    config = ModelConfig.from_dict(
        dict(
            model_type="llama",
            vocab_size=10,
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
        )
    )
    per_block = block_bytes(config, 4)
    assert per_block == (576 * 64 * (18 + 6) + 3 * 576 * 1536 + 2 * 576) * 4  # SmolLM2: about 13.6 MB
    cache = 1024 * config.kv_bytes_per_token_per_block(4)
    assert blocks_for_budget(config, 4, 12 * (per_block + cache), 1024) == 12
    assert blocks_for_budget(config, 4, 10**12, 1024) == 30
    weights = block_bytes(config, 1)  # int8 servers hold about 4x, int4 ones about 7x the blocks' weights
    assert blocks_for_budget(config, 4, 12 * int(weights * 1.02), 0, "int8") == 12
    assert blocks_for_budget(config, 4, 12 * int(weights * 4), 0, "int4") == 30


def test_only_one_server_moves_into_a_hole():
    servers = {"a": (0, 12, 1.0), "b": (0, 12, 1.0), "c": (18, 30, 1.0)}  # blocks 12-17 uncovered
    moves = {peer: my_move(servers, peer, 30) for peer in servers}
    assert moves["a"] is not None and moves["b"] is None and moves["c"] is None  # "a": the smaller peer id
    servers["a"] = (*moves["a"], 1.0)
    assert min(coverage(servers.values(), 30)) == 1
    assert all(my_move(servers, peer, 30) is None for peer in servers)  # then everyone stays put


def test_a_move_that_helps_too_little_is_not_made():
    # blocks 0-14 at 1.0 and 15-29 at 1.1: moving would raise the weakest coverage by less than 20%
    servers = {"a": (0, 15, 1.0), "b": (15, 30, 1.0), "c": (15, 30, 0.1)}
    assert all(my_move(servers, peer, 30) is None for peer in servers)
    # with two whole extra replicas of 15-29, moving one of them to 0-14 doubles the weakest coverage;
    # the three equal candidates leave it to the smallest peer id
    servers["c"], servers["d"] = (15, 30, 1.0), (15, 30, 1.0)
    assert {peer: my_move(servers, peer, 30) for peer in servers} == {
        "a": None,
        "b": (0, 15),
        "c": None,
        "d": None,
    }


def test_placement_never_cuts_layers_that_share_keys_and_values():
    # a 35-block model whose blocks 13-34 read blocks 13 and 14's keys and values (Gemma 3n's layout)
    forbidden = frozenset(range(14, 35))
    found = windows(10, 35, forbidden)
    assert found[:4] == [(0, 10), (1, 11), (2, 12), (3, 13)]  # full windows, then shorter ones up to 13
    assert found[4:] == [(start, 13) for start in range(4, 13)] and (13, 35) not in found
    # a server of 10 blocks takes a window that ends at 13 at the latest; one that holds 22 takes the group
    assert choose_blocks([], 10, 35, forbidden_cuts=forbidden) == (0, 10)
    assert choose_blocks([(0, 10, 1.0)], 10, 35, forbidden_cuts=forbidden) == (3, 13)
    assert choose_blocks([(0, 13, 1.0)], 22, 35, forbidden_cuts=forbidden) == (13, 35)
    others = [(0, 13, 1.0)]  # the group has no server: one holding 25 blocks moves onto it whole
    assert better_blocks(others, (0, 25), 35, 1.0, forbidden) == (10, 35)
    with pytest.raises(InvalidRequest, match="no span of 5 blocks or fewer keeps the model's layers"):
        windows(5, 35, frozenset(range(1, 35)))


def test_servers_too_short_to_help_are_skipped_without_changing_the_move(monkeypatch):
    """best_move skips servers whose span cannot hold every block a move must raise (_weak_reach): on
    random swarms it picks the same move as trying every server."""
    rng = random.Random(1)
    for _ in range(150):
        total = rng.randint(4, 30)
        servers = {}
        for i in range(rng.randint(2, 40)):
            length = rng.randint(1, total)
            start = rng.randint(0, total - length)
            servers[f"s{i:03d}"] = (start, start + length, rng.choice([1.0, rng.uniform(0.5, 3)]))
        pruned = best_move(servers, total)
        with monkeypatch.context() as patch:
            patch.setattr(placement, "_weak_reach", lambda whole, held: 0)
            assert best_move(servers, total) == pruned
