"""The processes a DHT peer starts, and how they end with it.

hivemind's DHT runs in a child process that starts a libp2p daemon (p2pd). A peer killed with SIGKILL
cannot stop them, and nothing else did: both lived on (parent: PID 1) for as long as the machine ran,
the daemon still answering for the dead server's peer id. Now the DHT child watches its parent and ends
itself once the parent is gone (`watch_parent`), and every daemon it starts asks the kernel for SIGTERM
when the DHT child dies (`daemons_die_with_this_process`, Linux's parent-death signal).

hivemind also checks that an existing identity is not in use by starting an anonymous daemon of its own,
always with NAT port mapping on; `identity_taken` does that check with the peer's own settings instead.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.utils import ControlFailure

PR_SET_PDEATHSIG = 1  # linux/prctl.h
PARENT_CHECK_PERIOD = 0.25  # seconds between the DHT child's looks at its parent


def watch_parent(parent_pid: int) -> None:
    """In the DHT child: end this process (SIGTERM: its daemons get their parent-death signal) once
    `parent_pid` is no longer its parent. A thread that polls rather than a parent-death signal: that
    signal follows the parent's *thread* that forked, and clients start their DHT from a worker thread."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_CHECK_PERIOD)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="corolla-parent-watch", daemon=True).start()


def daemons_die_with_this_process() -> None:
    """In the DHT child: every subprocess started through asyncio from now on (hivemind's p2pd) gets
    SIGTERM from the kernel when this process dies, however it dies. No-op off Linux."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)  # loaded here: the preexec hook runs between fork and exec
    start = asyncio.subprocess.create_subprocess_exec

    def set_parent_death_signal() -> None:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)

    async def create_subprocess_exec(*args, **kwargs):
        kwargs.setdefault("preexec_fn", set_parent_death_signal)
        return await start(*args, **kwargs)

    asyncio.subprocess.create_subprocess_exec = create_subprocess_exec


def identity_taken(
    identity_path: Path, initial_peers: Sequence[str], host_maddrs: Sequence[str], nat_port_map: bool
) -> bool:
    """Whether a peer with this identity is in the swarm now: hivemind's check (an anonymous client-mode
    daemon tries to connect to that peer id), with the caller's host and NAT port mapping."""
    peer_id = PeerID.from_identity(identity_path.read_bytes())
    any_port = [maddr.rsplit("/tcp/", 1)[0] + "/tcp/0" for maddr in host_maddrs]

    async def check() -> bool:
        probe = await P2P.create(
            initial_peers=list(initial_peers),
            dht_mode="client",
            host_maddrs=any_port,
            nat_port_map=nat_port_map,
        )
        try:
            await probe._client.connect(peer_id, [])
            return True
        except ControlFailure:
            return False
        finally:
            await probe.shutdown()

    # start_dht may run inside an event loop (a client's) or outside any: the check gets its own
    outcome: list[bool | BaseException] = []

    def run() -> None:
        try:
            outcome.append(asyncio.run(check()))
        except BaseException as e:  # re-raised in the caller's thread
            outcome.append(e)

    thread = threading.Thread(target=run, name="corolla-identity-check")
    thread.start()
    thread.join()
    if isinstance(outcome[0], BaseException):
        raise outcome[0]
    return outcome[0]
