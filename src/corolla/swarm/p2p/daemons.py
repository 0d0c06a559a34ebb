"""The processes a DHT peer starts, and how they end with it.

hivemind's DHT runs in a child process that starts a libp2p daemon (p2pd). A peer killed with SIGKILL
cannot stop them, and nothing else did: both lived on (parent: PID 1) for as long as the machine ran,
the daemon still answering for the dead server's peer id. Now the DHT child watches its parent and ends
itself once the parent is gone (`watch_parent`). The daemon needs nothing more: hivemind's p2pd exits
when the process holding its control connection dies (the DHT child; kill -9 of the DHT child alone
leaves no daemon within a second).

hivemind also checks that an existing identity is not in use by starting an anonymous daemon of its own,
always with NAT port mapping on; `identity_taken` does that check with the peer's own settings instead.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import TypeVar

from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.utils import ControlFailure

T = TypeVar("T")
PARENT_CHECK_PERIOD = 0.25  # seconds between the DHT child's looks at its parent


def watch_parent(parent_pid: int) -> None:
    """In the DHT child: end this process (SIGTERM, whose default action it has) once `parent_pid` is no
    longer its parent. A thread that polls rather than Linux's parent-death signal: that signal follows
    the parent's *thread* that forked, and clients start their DHT from a worker thread."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_CHECK_PERIOD)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="corolla-parent-watch", daemon=True).start()


CHECK_ATTEMPTS = 3  # lookups of an identity's peer before it counts as absent


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
            for attempt in range(CHECK_ATTEMPTS):  # a loaded machine's first lookup can miss a present peer
                try:
                    await probe._client.connect(peer_id, [])
                    return True
                except ControlFailure:
                    if attempt + 1 < CHECK_ATTEMPTS:
                        await asyncio.sleep(0.5)
            return False
        finally:
            await probe.shutdown()

    return run_apart(check)


def run_apart(work: Callable[[], Awaitable[T]]) -> T:
    """`work()` run to completion in an event loop of its own, in a thread of its own: start_dht may be
    called inside an event loop (a client's) or outside any."""
    outcome: list[T | BaseException] = []

    def run() -> None:
        try:
            outcome.append(asyncio.run(work()))
        except BaseException as e:  # re-raised in the caller's thread
            outcome.append(e)

    thread = threading.Thread(target=run, name="corolla-daemon-check")
    thread.start()
    thread.join()
    if isinstance(outcome[0], BaseException):
        raise outcome[0]
    return outcome[0]
