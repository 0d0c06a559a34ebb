"""Server-to-server push is really used, and results do not depend on it."""

from __future__ import annotations

import time

import pytest
import torch
from corolla.client.span_session import StepRoute

from corolla.launch.local import LocalSwarm
from corolla.wire.messages import NextServer
from swarm_helpers import connect
from tiny_models import load_reference


@pytest.fixture(scope="module")
def chain(tiny_models):
    with LocalSwarm(
        str(tiny_models["llama"]), [(0, 2), (2, 4), (4, 6)], server_args=["--announce-period", "1"]
    ) as swarm:
        yield swarm


def step_counts(model, swarm) -> list[tuple[int, int]]:
    infos = [model.runtime.run(model.client.swarm.peers.status(s.peer_id)) for s in swarm.servers]
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
            links = {
                s.peer_id: dict(s.info.next_pings)
                for s in model.runtime.run(model.client.swarm.view.refresh())
            }
            if second in links.get(first, {}) and third in links.get(second, {}):
                break
            time.sleep(1)
    assert set(links[first]) == {second} and set(links[second]) == {third} and not links[third]
    assert all(0 < rtt < 1 for rtt in [*links[first].values(), *links[second].values()])


def test_a_step_abandoned_midway_is_rolled_back_and_its_late_replies_are_skipped(chain, tiny_models):
    """A step cancelled after its first server (as when a caller gives up) still reaches the next servers
    by push, and they reply to it. The next step at the same position must roll every server back, and
    the client must not take those late replies for the next step's."""
    ids = torch.randint(3, 300, (1, 6), generator=torch.Generator().manual_seed(4))
    with connect(tiny_models["llama"], chain) as model, model.inference_session(max_length=16) as session:
        session.step(model.head.embed(ids[:, :5]))
        assert [s.hop.peer_id for s in session.spans] == [s.peer_id for s in chain.servers]
        first, *later = session.spans
        before = step_counts(model, chain)
        next_servers = tuple(NextServer(s.hop.peer_id, s.session_id, s.hop.start, s.hop.end) for s in later)
        abandoned = first.step(
            model.head.embed(torch.tensor([[7]])), None, None, 5, StepRoute("abandoned", next_servers)
        )
        model.runtime.run(abandoned)  # only the first hop: the client never sends this step further

        def pushed_to_both() -> bool:
            after = step_counts(model, chain)
            return all(after[i][1] - before[i][1] == 1 for i in (1, 2))

        deadline = time.monotonic() + 10
        while not pushed_to_both() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert pushed_to_both()  # the second and third servers ran the abandoned step
        last = session.step(model.head.embed(ids[:, 5:6]))
        assert session.num_failovers == 0
        logits = model.head.logits(last)
    with torch.no_grad():
        expected = load_reference(tiny_models["llama"])(ids).logits[:, 5:6]
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)
