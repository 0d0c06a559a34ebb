"""Starting `corolla` peers by forking a process that has already imported corolla, torch and hivemind.

A fresh `python -m corolla server` spends about 2 CPU-seconds importing before it does anything; a local
swarm of five servers on a two-core machine then takes 12 s to start instead of 4. Local swarms (tests,
`corolla demo`, benchmarks) therefore fork their peers from one multiprocessing fork server that
preloads those modules. Each peer is still a process of its own: it starts its own session (process
group), writes stdout and stderr to its log, runs the same `corolla` command line, and is stopped and
killed with signals like any other. The `ForkedPeer` object answers the few `subprocess.Popen` calls
that `PeerProcess` makes.

Environment variables that libraries read when they are imported (HF_HUB_OFFLINE) take the values the
fork server started with, which are the first local swarm's; thread counts are set again in each peer.
A peer may run in a named network namespace (`ip netns add NAME`: an emulated host behind a router, or
across an emulated internet): it enters that namespace before it opens a socket, as `ip netns exec NAME`
would put a fresh process there, and its DHT process and libp2p daemon start inside it too.

On a machine with a CUDA GPU peers are started as fresh processes instead (`forking_works`): importing
the preloaded modules asks torch how many GPUs there are, and CUDA cannot be used in a process forked
from one that did (seen on an H200: every forked server failed "Cannot re-initialize CUDA in forked
subprocess" at its first CUDA call).
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

# what the fork server imports once (by name: launching a peer needs no CLI code here, only the child does)
PRELOAD = ["corolla.cli.main", "corolla.server.server"]
CLONE_NEWNET = 0x40000000  # setns(2): join a network namespace
_context: multiprocessing.context.ForkServerContext | None = None


def forking_works() -> bool:
    """Whether peers may be forked from the fork server: not where torch sees a CUDA GPU (above)."""
    return not torch.cuda.is_available()


def fork_peer(
    args: Sequence[str],
    log_path: Path,
    env: dict[str, str],
    err_path: Path | None = None,
    netns: str | None = None,
    script: Path | None = None,
) -> ForkedPeer | subprocess.Popen:
    """Start `corolla ARGS` (or, with `script`, that Python file with ARGS) as a forked peer, its output
    going to `log_path` (its stderr to `err_path`, when given), in network namespace `netns` if given; a
    fresh process in a session of its own where forking does not work (`forking_works`)."""
    global _context
    if not forking_works():
        prefix = ["ip", "netns", "exec", netns] if netns else []
        main = [str(script)] if script else ["-m", "corolla"]
        with open(log_path, "wb") as out, open(err_path or os.devnull, "wb") as err:
            errors = err if err_path else subprocess.STDOUT
            command = [*prefix, sys.executable, *main, *args]
            return subprocess.Popen(command, stdout=out, stderr=errors, env=env, start_new_session=True)
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
    for path in (log_path, err_path or log_path):
        path.write_bytes(b"")  # exists at once: the caller reads it while the peer starts
    streams = (str(log_path), str(err_path or log_path))
    script_path = str(script) if script else None
    # not daemonic: a peer runs a DHT, which is a child process of its own
    process = _context.Process(
        target=_peer_main, args=(list(args), streams, env, netns, script_path), daemon=False
    )
    process.start()
    return ForkedPeer(process, list(args))


class ForkedPeer:
    """A forked peer, with the Popen methods PeerProcess uses (its return code is -N if signal N ended it)."""

    def __init__(self, process: multiprocessing.process.BaseProcess, args: list[str]):
        self._process = process
        self.args = args
        self.pid = process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return self._process.exitcode

    def send_signal(self, sig: int) -> None:
        """Signal it, if it still runs (the fork server, its parent, reaps it: it can be gone before its
        exit code reaches us)."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, sig)

    def kill_group(self) -> None:
        """SIGKILL its process group (its DHT process and daemon too), or itself if it has none yet."""
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:  # it had not started its own session yet
            if self._process.exitcode is None:
                self.send_signal(signal.SIGKILL)


def _peer_main(
    args: list[str], streams: tuple[str, str], env: dict[str, str], netns: str | None, script: str | None
) -> None:
    """In the forked child: its network namespace, a session of its own, stdout and stderr to their files,
    the environment, then `corolla` (or the script)."""
    if netns is not None:
        _enter_netns(netns)
    os.setsid()
    for fd, path in zip((1, 2), streams, strict=True):
        file = os.open(path, os.O_WRONLY | os.O_APPEND)
        os.dup2(file, fd)
        os.close(file)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 (the process's own streams)
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    os.environ.clear()
    os.environ.update(env)
    if "OMP_NUM_THREADS" in env:  # OpenMP read the fork server's environment when torch was imported
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    # hivemind creates MPFuture's two process-shared locks when it is imported, here in the fork server:
    # every peer forked from it would share them, and a peer killed while holding one (kill -9, a test's
    # kill_group) would leave every later peer waiting on it forever at its DHT's start. Its own locks:
    from hivemind.utils.mpfuture import MPFuture

    MPFuture.reset_backend()
    if script is not None:
        sys.argv = [script, *args]
        runpy.run_path(script, run_name="__main__")  # as `python SCRIPT ARGS` runs
        return
    sys.argv = ["corolla", *args]
    runpy.run_module("corolla", run_name="__main__", alter_sys=True)  # as `python -m corolla ARGS` runs


def _enter_netns(name: str) -> None:
    """Move this (single-threaded) process into network namespace `name` (needs CAP_SYS_ADMIN, as `ip
    netns exec` does); the processes it starts later are there too."""
    libc = ctypes.CDLL(None, use_errno=True)
    with open(f"/run/netns/{name}", "rb") as namespace:
        if libc.setns(namespace.fileno(), CLONE_NEWNET) != 0:
            error = ctypes.get_errno()
            raise OSError(error, f"cannot enter network namespace {name}: {os.strerror(error)}")
