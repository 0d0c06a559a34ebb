"""Signals that end a command through its cleanup: `with` blocks and `finally` clauses still run."""

from __future__ import annotations

import signal


def exit_on(*signals: signal.Signals, status: int | None = None) -> None:
    """From now on, the first of `signals` raises SystemExit(status, or 128 + its number) in the main
    thread, and the others are then ignored while the command stops what it started.

    Without this, SIGTERM (`kill`, docker stop) and SIGHUP (a closed terminal) end the process at once:
    its DHT child process, libp2p daemon or local swarm stay behind.
    """

    def handler(signum: int, _frame: object) -> None:
        for sig in signals:
            signal.signal(sig, signal.SIG_IGN)
        raise SystemExit(128 + signum if status is None else status)

    for sig in signals:
        signal.signal(sig, handler)
