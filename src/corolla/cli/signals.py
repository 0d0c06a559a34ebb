"""Signals that end a command through its cleanup: `with` blocks and `finally` clauses still run."""

from __future__ import annotations

import logging
import os
import signal
import sys


def exit_on(*signals: signal.Signals, status: int | None = None, quiet: bool = False) -> None:
    """From now on, the first of `signals` raises SystemExit(status, or 128 + its number) in the main
    thread, and the others are then ignored while the command stops what it started; `quiet`: warnings
    are no longer logged then (a second Ctrl-C reaches the command's group, its DHT process and libp2p
    daemon among it: the client would warn of the server it can no longer reach while it stops).

    Without this, SIGTERM (`kill`, docker stop) and SIGHUP (a closed terminal) end the process at once:
    its DHT child process, libp2p daemon or local swarm stay behind.
    """

    def handler(signum: int, _frame: object) -> None:
        for sig in signals:
            signal.signal(sig, signal.SIG_IGN)
        if quiet:
            logging.disable(logging.WARNING)
        raise SystemExit(128 + signum if status is None else status)

    for sig in signals:
        signal.signal(sig, handler)


def exit_now(status: int | str | None) -> None:
    """Exit with `status` at once, once a command has stopped what it started: without the interpreter's
    teardown, which frees torch's and transformers' state for 1-2 s after Ctrl-C (the user waits for
    the prompt)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe
            pass
    os._exit(status if isinstance(status, int) else 1)
