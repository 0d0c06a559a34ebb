"""How local swarms start their peers: forked from a preloaded process, or fresh where CUDA is visible."""

from __future__ import annotations

import os
import subprocess

import torch

from corolla.launch.forked import ForkedPeer
from corolla.launch.local import PeerProcess

ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


def start(tmp_path) -> PeerProcess:
    peer = PeerProcess("version", ["--version"], tmp_path / "version.log", ENV)
    assert peer.popen.wait(timeout=120) == 0
    return peer


def test_peers_are_forked_on_a_machine_without_cuda(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    peer = start(tmp_path)
    assert isinstance(peer.popen, ForkedPeer)
    assert "corolla " in peer.log()


def test_peers_start_fresh_where_cuda_is_visible(tmp_path, monkeypatch):
    """A process forked from one that asked torch about GPUs cannot use CUDA (seen on an H200)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    peer = start(tmp_path)
    assert isinstance(peer.popen, subprocess.Popen)
    assert "corolla " in peer.log()


def test_a_fresh_peer_writes_its_errors_where_asked(tmp_path, monkeypatch):
    from corolla.launch.forked import fork_peer

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    peer = fork_peer(["no-such-command"], tmp_path / "out.log", ENV, err_path=tmp_path / "err.log")
    assert isinstance(peer, subprocess.Popen) and peer.wait(timeout=120) == 2
    assert "no-such-command" in (tmp_path / "err.log").read_text()
    assert (tmp_path / "out.log").read_text() == ""


def test_a_local_swarm_of_fresh_processes_serves_and_stops(tiny_models, monkeypatch):
    """The whole swarm as a GPU machine starts it (CUDA only pretended here: the children see none and
    compute on the CPU): ready lines read, greedy tokens as transformers', every process gone after."""
    import psutil

    from corolla.launch.local import LocalSwarm
    from swarm_helpers import connect, reference_generate
    from tiny_models import load_reference

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    path = tiny_models["llama"]
    ids = torch.tensor([[5, 6, 7, 8]])
    expected = reference_generate(load_reference(path), ids, max_new_tokens=4)
    with LocalSwarm(str(path), [(0, 3), (3, 6)]) as swarm:
        assert all(isinstance(server.popen, subprocess.Popen) for server in swarm.servers)
        pids = [server.pid for server in [swarm.dht, *swarm.servers]]
        with connect(path, swarm) as model:
            assert torch.equal(model.generate(ids, max_new_tokens=4), expected)
    assert not [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]
