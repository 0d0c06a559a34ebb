"""Servers without --blocks place themselves on the tiny llama's 6 blocks and rebalance when one leaves (the
left blocks seen without a server by the next announce period's read, the dead server found by a ping
rather than by its records going stale: link_monitor.py, rebalancer.py `look`); a session running across a
move completes with the right tokens."""

from __future__ import annotations

import threading
import time

import torch

from corolla.launch.local import LocalSwarm
from corolla.swarm.policy.placement import coverage
from swarm_helpers import connect

BUDGET_2_BLOCKS = "2400000"  # 2 x (148 KB of weights + 4096 tokens x 256 B of cache) for the tiny llama
# every server keeps the figure cached at start (no idle re-measurement): the mover below is named by the
# placement's tie-break between servers of equal speed
ARGS = ["--memory-budget", BUDGET_2_BLOCKS, "--announce-period", "1", "--balance-period", "2"]
ARGS += ["--remeasure-period", "0"]
BLOCKS = 6


def current_spans(model) -> dict[str, tuple[int, int]]:
    spans = model.runtime.run(model.client.swarm.view.refresh())
    return {s.peer_id: (s.start, s.end) for s in spans}


def wait_for(condition, timeout: float, interval: float = 1.0):
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


def test_self_placement_and_rebalancing(tiny_models):
    path = tiny_models["llama"]
    with LocalSwarm(str(path), []) as swarm:
        first_three = [swarm.add_server(None, extra_args=ARGS) for _ in range(3)]
        assert [server.blocks[1] - server.blocks[0] for server in first_three] == [2, 2, 2]
        before = coverage([(*s.blocks, 1.0) for s in first_three], BLOCKS)
        assert min(before) == 1  # all 6 blocks covered by three servers of 2

        fourth = swarm.add_server(None, extra_args=ARGS)
        lowest = min(before)
        assert all(before[i] == lowest for i in range(*fourth.blocks))  # it went where coverage is thinnest

        # the server to remove: the only one covering some blocks; the server that will move: of the two
        # holding the same blocks, the one with the smaller peer id (placement.my_move breaks ties so)
        def unique(server):
            rest = coverage([(*o.blocks, 1.0) for o in swarm.servers if o is not server], BLOCKS)
            return any(rest[i] == 0 for i in range(*server.blocks))

        alone = next(s for s in swarm.servers if unique(s))
        twins = [s for s in swarm.servers if [o.blocks for o in swarm.servers].count(s.blocks) == 2]
        mover = min(twins, key=lambda s: s.peer_id)
        keep = [i for i, s in enumerate(swarm.servers) if s is not alone and s not in twins]
        pinned = [
            swarm.servers.index(mover),
            swarm.servers.index(alone),
            *keep,
        ]  # the session runs on the mover
        # the session waits for the move however long a loaded machine takes (the test's timeout bounds it)
        with connect(path, swarm, pinned, routing_timeout=300.0) as model:
            # each record says when it was stored and how often it is renewed (the rebalancer's staleness)
            infos = model.runtime.run(model.client.swarm.view.refresh())
            assert all(s.info.announce_period == 1 and s.info.announced_at > 0 for s in infos)
            prompt = [1, 96, 198, 26, 35, 253, 56, 56, 2]
            expected = model.generate(prompt, max_new_tokens=40, ignore_eos=True)
            results = {}
            session_ready = threading.Event()

            def long_generation():
                with model.inference_session(max_length=len(prompt) + 40) as session:
                    results["tokens"] = model.generate(
                        prompt,
                        session=session,
                        max_new_tokens=40,
                        ignore_eos=True,
                        streamer=lambda _: session_ready.set() or time.sleep(0.2),
                    )
                    results["route"] = [hop.peer_id for hop in session.route]
                results["ended"] = time.time()

            worker = threading.Thread(target=long_generation)
            worker.start()
            assert session_ready.wait(60)
            alone.kill_group()
            swarm.servers.remove(alone)
            worker.join(timeout=180)

            assert torch.equal(results["tokens"], expected)  # through the departure and the move
            assert results["route"][0] == mover.peer_id  # its first hop stayed on the mover's old blocks
            covered = wait_for(
                lambda: min(coverage([(*b, 1.0) for b in current_spans(model).values()], BLOCKS)) > 0,
                timeout=60,
            )
            assert covered, f"blocks left uncovered: {current_spans(model)}"
        assert [s for s in swarm.servers if "Moving from blocks" in s.log()] == [mover]
        # the dead server's blocks were seen bare by pinging it (its records outlive it by 1.5 periods)
        assert any(log_lines(s, f"...{alone.peer_id[-6:]} did not answer") for s in swarm.servers)
        moved = log_lines(mover, "Moving from blocks")
        unloaded = wait_for(lambda: log_lines(mover, "Unloaded blocks"), 10)  # soon after our session ends
        assert unloaded, "the mover never unloaded its old blocks:\n" + mover.log_tail(25)
        waited = seconds_of_day(unloaded[0]) - seconds_of_day(moved[0])
        assert waited >= 2, f"old blocks unloaded {waited}s after the move, while our session still used them"


def log_lines(server, text: str) -> list[str]:
    return [line for line in server.log().splitlines() if text in line]


def seconds_of_day(log_line: str) -> int:
    hours, minutes, seconds = (int(part) for part in log_line.split()[0].split(":"))
    return 3600 * hours + 60 * minutes + seconds
