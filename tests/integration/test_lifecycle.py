"""Servers announce themselves, leave gracefully, and clients get clear errors when blocks are missing."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import torch

from corolla.errors import MissingBlocks
from corolla.launch.local import READY_SERVER, LocalSwarm, PeerProcess
from corolla.wire.records import ServerState
from swarm_helpers import connect, fresh_spans, run_corolla


@pytest.fixture(scope="module")
def half_swarm(tiny_models):
    """Blocks 0:3 only; tests add the other half when they need it."""
    args = ["--announce-period", "2", "--max-cache-tokens", "4096"]
    with LocalSwarm(str(tiny_models["llama"]), [(0, 3)], server_args=args) as swarm:
        yield swarm


def read_spans(swarm: LocalSwarm):
    async def read():
        return await fresh_spans(swarm)

    return asyncio.run(read())


def test_announcement_carries_span_limits_and_free_cache(half_swarm):
    (span,) = read_spans(half_swarm)
    assert (span.peer_id, span.start, span.end) == (half_swarm.servers[0].peer_id, 0, 3)
    assert span.info.state == ServerState.ONLINE
    assert span.info.inference_max_length == 4096 and span.info.cache_tokens_available == 4096
    assert span.info.dtype == "float32" and span.info.num_sessions == 0


def test_missing_blocks_are_named_then_served_once_a_server_joins(half_swarm, tiny_models):
    with connect(tiny_models["llama"], half_swarm, routing_timeout=2.0) as model:
        started = time.monotonic()
        with pytest.raises(MissingBlocks, match="no server available for blocks 3-5") as info:
            model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2)
        assert info.value.blocks == (3, 4, 5)
        assert time.monotonic() - started < 10
        server = half_swarm.add_server((3, 6))
        try:
            assert model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2).shape == (1, 5)
        finally:
            server.stop()
            half_swarm.servers.remove(server)


def test_sigterm_announces_offline_and_exits_cleanly(half_swarm):
    server = half_swarm.add_server((3, 6))
    assert {s.peer_id for s in read_spans(half_swarm)} >= {server.peer_id}
    server.signal(signal.SIGTERM)
    assert server.popen.wait(timeout=20) == 0
    assert "Shutting down (signal received)" in server.log()
    assert server.peer_id not in {s.peer_id for s in read_spans(half_swarm)}  # OFFLINE, not just expired
    server.kill_group()
    half_swarm.servers.remove(server)


def test_num_blocks_fills_the_gap_and_dead_servers_expire(half_swarm, tiny_models):
    args = [
        "server",
        str(tiny_models["llama"]),
        "--num-blocks",
        "3",
        "--host",
        "127.0.0.1",
        "--no-nat-port-map",
        "--num-threads",
        "1",
        "--announce-period",
        "2",
        "--initial-peers",
        *half_swarm.initial_peers,
    ]
    placed = PeerProcess("placed server", args, half_swarm.workdir / "placed.log", half_swarm.env)
    try:
        placed.wait_for(READY_SERVER, 120)
        spans = {s.peer_id: (s.start, s.end) for s in read_spans(half_swarm)}
        peer_id = READY_SERVER.search(placed.log()).group(1)
        assert spans[peer_id] == (3, 6)  # the blocks nobody served
        time.sleep(6)  # longer than a record's lifetime (2.5 announce periods): re-announced, still there
        assert peer_id in {s.peer_id for s in read_spans(half_swarm)}
        os.kill(placed.pid, signal.SIGKILL)  # dies without announcing OFFLINE
        deadline = time.monotonic() + 15
        while peer_id in {s.peer_id for s in read_spans(half_swarm)}:
            assert time.monotonic() < deadline, "a dead server's records did not expire"
            time.sleep(1)
    finally:
        placed.kill_group()


def test_cli_help_and_bad_arguments(tiny_models):
    llama = str(tiny_models["llama"])
    help_run, server_help_run, bad_range, reversed_range, no_model = run_corolla(
        ["--help"],
        ["server", "--help"],
        ["server", llama, "--blocks", "4:9", "--host", "127.0.0.1", "--no-nat-port-map"],
        ["server", llama, "--blocks", "3:1"],
        ["server", "/no/such/model", "--host", "127.0.0.1", "--no-nat-port-map", "--log-level", "ERROR"],
    )
    help_text = help_run.stdout
    for command in ("dht", "server", "generate", "demo"):
        assert command in help_text
    server_help = server_help_run.stdout
    for option in (
        "--blocks",
        "--num-blocks",
        "--initial-peers",
        "--max-cache-tokens",
        "--inference-max-length",
        "--nat-port-map",
        "--dtype",
        "--step-timeout",
    ):
        assert option in server_help
    assert (
        bad_range.returncode == 2
        and "--blocks 4:9 is not a range inside the model's 6 blocks" in bad_range.stderr
    )
    assert reversed_range.returncode == 2 and "expected A:B with 0 <= A < B" in reversed_range.stderr
    assert no_model.returncode == 2 and "no such folder or file: /no/such/model" in no_model.stderr
    assert "Traceback" not in no_model.stderr
    assert no_model.stderr.count("\n") == 1  # --log-level ERROR after the subcommand took effect
