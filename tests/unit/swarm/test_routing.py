import random

import pytest

from corolla.errors import MissingBlocks
from corolla.swarm.dht import RemoteSpan
from corolla.swarm.policy.routing import JITTER, Estimate, Hop, chain_cost, choose_chain, format_blocks
from corolla.wire.records import ServerStatus


def span(peer, start, end):
    info = ServerStatus(start, end, "0.1.0", "float32", 128, 100)
    return RemoteSpan(peer, start, end, info)


def test_fewest_hops_using_part_of_a_span():
    spans = [span("a", 0, 2), span("b", 2, 4), span("c", 0, 3), span("d", 3, 6), span("e", 1, 6)]
    chain = choose_chain(spans, 0, 6, rng=random.Random(0))
    assert len(chain) == 2
    assert chain[0].start == 0 and chain[-1].end == 6
    assert all(a.end == b.start for a, b in zip(chain, chain[1:], strict=False))


def test_the_chain_uses_the_servers_it_is_given_and_parts_of_their_spans():
    spans = {s.peer_id: s for s in [span("a", 0, 6), span("b", 0, 3), span("c", 3, 6), span("d", 0, 2)]}
    spans["e"] = span("e", 2, 4)
    assert choose_chain([spans["a"]], 0, 6) == [Hop("a", 0, 6)]
    assert choose_chain([spans[p] for p in "bcde"], 0, 6) == [Hop("b", 0, 3), Hop("c", 3, 6)]
    chain = choose_chain([spans[p] for p in "dec"], 0, 6)
    assert [hop.peer_id for hop in chain] == ["d", "e", "c"]
    assert chain[0] == Hop("d", 0, 2) and chain[1].start == 2 and chain[-1].end == 6
    assert choose_chain([spans[p] for p in "ce"], 3, 5) == [Hop("c", 3, 5)]  # only the blocks asked for


def test_replicas_are_chosen_at_random():
    spans = [span("a", 0, 4), span("b", 0, 4)]
    picks = {choose_chain(spans, 0, 4, rng=random.Random(seed))[0].peer_id for seed in range(20)}
    assert picks == {"a", "b"}


def test_missing_blocks_are_named():
    spans = [span("a", 0, 2), span("b", 5, 8)]
    with pytest.raises(MissingBlocks) as info:
        choose_chain(spans, 0, 10)
    assert info.value.blocks == (2, 3, 4, 8, 9)
    assert "blocks 2-4, 8-9" in str(info.value)
    assert format_blocks((1,)) == "1"


def test_costs_steer_the_chain_to_fast_lightly_loaded_servers():
    spans = [span("slow", 0, 4), span("fast", 0, 4), span("busy", 0, 4)]
    estimates = {
        "slow": Estimate(seconds_per_block=0.05),
        "fast": Estimate(seconds_per_block=0.01),
        "busy": Estimate(seconds_per_block=0.01, load=30),
    }
    picks = {
        choose_chain(spans, 0, 4, estimates=estimates, rng=random.Random(seed))[0].peer_id
        for seed in range(20)
    }
    assert picks == {"fast"}
    # one distant fast server versus two close ones: a round trip costs as much as some compute
    spans = [span("far", 0, 4), span("near1", 0, 2), span("near2", 2, 4)]
    far = {"far": Estimate(rtt=0.2), "near1": Estimate(rtt=0.001), "near2": Estimate(rtt=0.001)}
    assert [h.peer_id for h in choose_chain(spans, 0, 4, estimates=far)] == ["near1", "near2"]
    assert [h.peer_id for h in choose_chain(spans, 0, 4)] == ["far"]  # by default: fewer hops


def test_a_servers_own_batch_growth_prices_its_load():
    """A GPU that batches almost for free (it measured 1% per more session) stays cheapest with 20
    sessions on it; priced by the constant guess (25% each) it would be passed over for a slower one."""
    spans = [span("gpu", 0, 4), span("home", 0, 4)]
    measured = {
        "gpu": Estimate(seconds_per_block=0.001, load=20, load_growth=0.01),
        "home": Estimate(seconds_per_block=0.003),
    }
    assert choose_chain(spans, 0, 4, estimates=measured)[0].peer_id == "gpu"
    guessed = {**measured, "gpu": Estimate(seconds_per_block=0.001, load=20)}
    assert choose_chain(spans, 0, 4, estimates=guessed)[0].peer_id == "home"


def test_with_push_the_links_between_servers_count():
    spans = [span("a", 0, 2), span("b1", 2, 4), span("b2", 2, 4)]
    estimates = {peer: Estimate(rtt=0.05) for peer in ("a", "b1", "b2")}
    links = {"a": {"b1": 0.08, "b2": 0.002}}  # b2 sits next to a; b1 is far from it
    for seed in range(10):
        chain = choose_chain(
            spans, 0, 4, estimates=estimates, links=links, push=True, rng=random.Random(seed)
        )
        assert [h.peer_id for h in chain] == ["a", "b2"]
    # without push the servers never talk to each other: the link does not matter, replicas alternate
    picks = {
        choose_chain(spans, 0, 4, estimates=estimates, links=links, rng=random.Random(seed))[1].peer_id
        for seed in range(20)
    }
    assert picks == {"b1", "b2"}


def test_a_server_short_of_cache_is_avoided_when_another_has_room():
    spans = [span("full", 0, 4), span("roomy", 0, 4)]
    estimates = {"full": Estimate(free_cache=100), "roomy": Estimate(free_cache=100_000)}
    picks = {
        choose_chain(spans, 0, 4, estimates=estimates, needed_cache=2048, rng=random.Random(seed))[0].peer_id
        for seed in range(20)
    }
    assert picks == {"roomy"}


def test_no_hop_starts_or_ends_inside_layers_that_share_keys_and_values():
    # blocks 4-5 of Gemma: 5 attends with 4's keys and values, so no hop may start or end at 5
    spans = [span("a", 0, 5), span("b", 0, 4), span("c", 4, 6), span("d", 5, 6)]
    cuts = frozenset({5})
    for seed in range(10):
        chain = choose_chain(spans, 0, 6, rng=random.Random(seed), forbidden_cuts=cuts)
        assert [(hop.start, hop.end) for hop in chain] == [(0, 4), (4, 6)] and chain[1].peer_id == "c"
    # without the rule, the cheapest chains of two hops cut there too
    cutting = {tuple(choose_chain(spans, 0, 6, rng=random.Random(seed))) for seed in range(10)}
    assert (Hop("a", 0, 5), Hop("d", 5, 6)) in cutting
    # served only by spans that cut the group: no chain, and the error says why
    with pytest.raises(MissingBlocks, match="without splitting layers that share keys and values") as e:
        choose_chain([span("a", 0, 5), span("d", 5, 6)], 0, 6, forbidden_cuts=cuts)
    assert e.value.blocks == (5,)


def test_a_given_chains_cost_is_what_routing_weighs():
    """Round trips (halves between servers with push) and compute per block, the compute stretched by
    load and short cache (a busy server computes slower; the network is no slower for it)."""
    estimates = {
        "a": Estimate(rtt=0.1, seconds_per_block=0.01),
        "b": Estimate(rtt=0.2, seconds_per_block=0.02, load=4),  # 2x slower for its load
    }
    hops = [Hop("a", 0, 2), Hop("b", 2, 4)]
    assert chain_cost(hops, estimates) == pytest.approx((0.1 + 0.02) + (0.2 + 0.04 * 2))
    pushed = (0.05 + 0.02) + (0.15 / 2 + 0.04 * 2) + 0.1
    assert chain_cost(hops, estimates, push=True) == pytest.approx(pushed)
    short = {"a": Estimate(rtt=0.1, seconds_per_block=0.01, free_cache=10)}
    assert chain_cost([Hop("a", 0, 2)], short, needed_cache=100) == pytest.approx(0.1 + 2 * 0.02)


def every_chain(spans: list[RemoteSpan], position: int, end: int, cuts: frozenset[int]):
    """Every chain over [position, end): each hop on any server holding its blocks, cut anywhere allowed."""
    if position == end:
        yield []
        return
    for s in spans:
        for stop in range(position + 1, min(s.end, end) + 1):
            if s.start <= position and (stop == end or stop not in cuts):
                for rest in every_chain(spans, stop, end, cuts):
                    yield [Hop(s.peer_id, position, stop), *rest]


@pytest.mark.parametrize("push", [False, True])
def test_the_chosen_chain_costs_the_least_of_every_possible_chain(push):
    """Against an exhaustive search of small random swarms (servers' speeds, round trips, loads, short
    caches, measured links between servers, layers that may not be cut): no chain costs less than the
    chosen one, but for routing's jitter, which may trade at most JITTER of a chain's cost."""
    rng = random.Random(7)
    for _ in range(150):
        blocks, peers = rng.randint(2, 6), [f"p{i}" for i in range(rng.randint(1, 5))]
        spans = [span(p, s := rng.randint(0, blocks - 1), rng.randint(s + 1, blocks)) for p in peers]
        estimates = {
            p: Estimate(
                rng.uniform(0.005, 0.3), rng.uniform(0.001, 0.05), rng.randint(0, 3), rng.choice([None, 9])
            )
            for p in peers
        }
        links = {a: {b: rng.uniform(0.001, 0.2) for b in peers if rng.random() < 0.3} for a in peers}
        cuts = frozenset(rng.sample(range(1, blocks), k=min(rng.randint(0, 2), blocks - 1)))
        options = dict(estimates=estimates, links=links, push=push, needed_cache=10, forbidden_cuts=cuts)
        chains = list(every_chain(spans, 0, blocks, cuts))
        if not chains:
            with pytest.raises(MissingBlocks):
                choose_chain(spans, 0, blocks, rng=rng, **options)
            continue
        chosen = choose_chain(spans, 0, blocks, rng=rng, **options)
        assert chosen in chains
        cost = chain_cost(chosen, estimates, links, push, needed_cache=10)
        least = min(chain_cost(chain, estimates, links, push, needed_cache=10) for chain in chains)
        best_chain = min(chains, key=lambda c: chain_cost(c, estimates, links, push, needed_cache=10))
        assert cost <= least * (1 + JITTER) + 1e-12, (chosen, best_chain, spans, estimates, links, cuts)
