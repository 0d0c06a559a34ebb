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
