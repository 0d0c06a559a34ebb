"""Small process helpers shared by benchmarks, tests and the CLI."""

from __future__ import annotations

import os


def peak_rss_bytes(pid: int | None = None) -> int:
    """Peak resident memory (VmHWM) of a process, from /proc (Linux)."""
    with open(f"/proc/{pid or os.getpid()}/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise OSError("VmHWM not found in /proc/<pid>/status")
