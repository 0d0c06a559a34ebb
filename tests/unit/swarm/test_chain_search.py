"""swarm/policy/chain_search.py: the servers sorted once by what they cost over a guessed link give what
trying every server after every previous one gives, so routing in time about linear in the servers chooses the
chains the quadratic search chose."""

from __future__ import annotations

import random

from corolla.swarm.dht import RemoteSpan
from corolla.swarm.policy.routing import Estimate, choose_chain
from corolla.wire.records import ServerStatus


def test_guessed_links_read_off_the_envelope_choose_what_trying_every_link_chooses():
    """The same swarms twice: with a few announced links (the rest guessed: read off the sorted servers,
    skipping those whose link is announced), and with every guess written out as if announced (every
    server tried after every previous one). Same jitter, same chains."""
    for seed in range(40):
        rng = random.Random(seed)
        blocks, peers = 16, [f"p{i}" for i in range(40)]
        spans = []
        for i, peer in enumerate(peers):
            start = 0 if i == 0 else rng.randint(0, blocks - 1)
            end = blocks if i == 1 else rng.randint(start + 1, min(blocks, start + 6))
            spans.append(RemoteSpan(peer, start, end, ServerStatus(start, end, "m", "float16", 1, 1)))
        estimates = {
            p: Estimate(rng.uniform(0.005, 0.3), rng.uniform(0.001, 0.02), rng.randint(0, 3)) for p in peers
        }
        announced = {a: {b: rng.uniform(0.005, 0.3) for b in rng.sample(peers, 4)} for a in peers}
        written_out = {
            a: {b: announced[a].get(b, (estimates[a].rtt + estimates[b].rtt) / 2) for b in peers}
            for a in peers
        }
        chains = [
            choose_chain(
                spans, 0, blocks, estimates=estimates, links=links, push=True, rng=random.Random(seed)
            )
            for links in (announced, written_out)
        ]
        assert chains[0] == chains[1]
