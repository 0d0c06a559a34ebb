"""A server that measured its speed at a busy moment (here: a slow figure left in its cache by an earlier
start) measures again once idle and announces the new figure: in its status and in its DHT records, where
placement and the blocks' keys read it. Not while a session is open."""

from __future__ import annotations

import json
import re
import time

import torch

from corolla.launch.local import LocalSwarm
from corolla.models.span import Span
from corolla.server.hosting import startup_speed
from corolla.swarm.p2p.ping import fetch_status
from swarm_helpers import connect

SLOW = 0.5  # blocks per second: what a server starting beside a busy job might have measured
AGAIN = re.compile(r"Measured again while idle: ([\d.]+) blocks/s \(was ([\d.]+)\)")


def seed_slow_figure(path, cache) -> None:
    """The cache entry a server of this model (one thread, float32) reads at start for its first block."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the server's --num-threads: part of the cache key
    try:
        key = startup_speed._cache_key(Span.load(path, 0, 1, torch.float32))
    finally:
        torch.set_num_threads(threads)
    entry = {"blocks_per_s": SLOW, "batch_growth": 0.5, "measured_at": time.time()}
    (cache / "throughput.json").write_text(json.dumps({key: entry}))


def remeasured(server) -> list[tuple[float, float]]:
    return [(float(new), float(was)) for new, was in AGAIN.findall(server.log())]


def wait_for(condition, timeout: float):
    deadline = time.monotonic() + timeout
    while not (value := condition()) and time.monotonic() < deadline:
        time.sleep(0.5)
    return value


def test_an_idle_server_replaces_a_slow_start_up_figure(tiny_models, tmp_path, monkeypatch):
    path = tiny_models["llama"]
    monkeypatch.setenv("COROLLA_CACHE", str(tmp_path))
    seed_slow_figure(path, tmp_path)
    with LocalSwarm(str(path), []) as swarm:
        args = ["--remeasure-period", "1", "--announce-period", "1"]
        server = swarm.add_server((0, 6), extra_args=args)
        assert f"Measured {SLOW}" not in server.log()  # it took the cached figure
        checks = wait_for(lambda: remeasured(server), timeout=60)
        assert checks, server.log_tail()
        new, was = checks[0]
        assert was == SLOW and new > 10 * SLOW  # a tiny llama's blocks: thousands a second here
        with connect(path, swarm) as model:
            status = model.runtime.run(fetch_status(model.client.swarm.peers.transport, server.peer_id, 10))
            assert status.throughput > 10 * SLOW and status.throughput != SLOW
            spans = wait_for(  # its next announcement carries it: what placement and the keys read
                lambda: [
                    s
                    for s in model.runtime.run(model.client.swarm.view.refresh())
                    if s.info.throughput > SLOW
                ],
                timeout=10,
            )
            assert spans and spans[0].peer_id == server.peer_id
            with model.inference_session(max_length=16) as session:
                model.generate([1, 96, 198, 26], session=session, max_new_tokens=2)
                time.sleep(1)  # a measurement under way as the session opened has ended and logged
                during = len(remeasured(server))
                time.sleep(2.5)  # over two periods with a session open: no measurement
                assert len(remeasured(server)) == during
