"""Servers measure their links to the next servers and announce them in the DHT
(server/upkeep/link_monitor.py), which needs real peers; push itself is tested socket-free in
tests/unit/client/test_push.py."""

from __future__ import annotations

import time

import pytest

from corolla.launch.local import LocalSwarm
from swarm_helpers import connect


@pytest.fixture(scope="module")
def chain(tiny_models):
    with LocalSwarm(
        str(tiny_models["llama"]), [(0, 2), (2, 4), (4, 6)], server_args=["--announce-period", "1"]
    ) as swarm:
        yield swarm


def test_servers_announce_their_links_to_the_next_servers(chain, tiny_models):
    first, second, third = (s.peer_id for s in chain.servers)
    with connect(tiny_models["llama"], chain) as model:
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            links = {
                s.peer_id: dict(s.info.next_pings)
                for s in model.runtime.run(model.client.swarm.view.refresh())
            }
            if second in links.get(first, {}) and third in links.get(second, {}):
                break
            time.sleep(1)
    assert set(links[first]) == {second} and set(links[second]) == {third} and not links[third]
    assert all(0 < rtt < 1 for rtt in [*links[first].values(), *links[second].values()])
