"""swarm/chain_search.py: the lower envelope that prices guessed links gives what trying every server
gives, so routing in time linear in the servers chooses the chains the quadratic search chose."""

from __future__ import annotations

import random

from corolla.swarm.chain_search import Candidate, _Envelope
from corolla.swarm.dht import RemoteSpan
from corolla.swarm.routing import Estimate, choose_chain
from corolla.wire.records import ServerStatus


def test_the_envelope_is_the_least_of_its_lines_everywhere():
    rng = random.Random(3)
    for _ in range(200):
        lines = [
            (rng.choice([0.25, 0.5, rng.uniform(0, 1)]), rng.uniform(-1, 1), i)
            for i in range(rng.randint(1, 30))
        ]
        envelope = _Envelope([(a, b, Candidate(str(i), 0, 1, 0.0, 1.0, 0.0)) for a, b, i in lines])
        for x in [0.0, *(rng.uniform(0, 3) for _ in range(20))]:
            value, item = envelope.least(x)
            assert abs(value - min(a * x + b for a, b, _ in lines)) < 1e-12
            a, b, _ = lines[int(item.peer_id)]  # and the line it names gives that value
            assert abs(a * x + b - value) < 1e-12


def test_guessed_links_read_off_the_envelope_choose_what_trying_every_link_chooses():
    """The same swarms twice: with a few announced links (the rest guessed: the envelope, and the scan
    of the others when the envelope's least is an announced one), and with every guess written out as if
    announced (every server tried after every previous one). Same jitter, same chains."""
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
