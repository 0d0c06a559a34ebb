"""Server-to-server push is really used, and results do not depend on it."""

from __future__ import annotations

import time

import pytest
import torch

from corolla.swarm.local import LocalSwarm
from swarm_helpers import connect


@pytest.fixture(scope="module")
def chain(tiny_models):
    with LocalSwarm(
        str(tiny_models["llama"]), [(0, 2), (2, 4), (4, 6)], server_args=["--announce-period", "1"]
    ) as swarm:
        yield swarm


def step_counts(model, swarm) -> list[tuple[int, int]]:
    infos = [model.runtime.run(model.swarm.server_info(s.peer_id)) for s in swarm.servers]
    return [(info.steps_from_client, info.steps_from_push) for info in infos]


def test_most_steps_arrive_by_push_and_results_do_not_change(chain, tiny_models):
    prompt = torch.randint(3, 300, (1, 12), generator=torch.Generator().manual_seed(3))
    with connect(tiny_models["llama"], chain, use_push=False) as model:
        before = step_counts(model, chain)
        without_push = model.generate(prompt, max_new_tokens=32, ignore_eos=True)
        after = step_counts(model, chain)
    assert all(b[1] == a[1] for a, b in zip(after, before, strict=True))  # no push at all
    with connect(tiny_models["llama"], chain) as model:
        before = step_counts(model, chain)
        with_push = model.generate(prompt, max_new_tokens=32, ignore_eos=True)
        after = step_counts(model, chain)
    assert torch.equal(with_push, without_push)
    client_steps = [a[0] - b[0] for a, b in zip(after, before, strict=True)]
    pushed_steps = [a[1] - b[1] for a, b in zip(after, before, strict=True)]
    assert pushed_steps[0] == 0 and client_steps[0] == 32  # the first server hears from the client only
    for server in (1, 2):  # every step ran once; most of them by push
        assert client_steps[server] + pushed_steps[server] == 32
        assert pushed_steps[server] > 16, f"server {server}: {pushed_steps[server]} of 32 steps by push"


def test_servers_announce_their_links_to_the_next_servers(chain, tiny_models):
    first, second, third = (s.peer_id for s in chain.servers)
    with connect(tiny_models["llama"], chain) as model:
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            links = {s.peer_id: dict(s.info.next_pings) for s in model.runtime.run(model.swarm.refresh())}
            if second in links.get(first, {}) and third in links.get(second, {}):
                break
            time.sleep(1)
    assert set(links[first]) == {second} and set(links[second]) == {third} and not links[third]
    assert all(0 < rtt < 1 for rtt in [*links[first].values(), *links[second].values()])
