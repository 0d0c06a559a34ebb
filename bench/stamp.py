"""Every benchmark's result, printed and kept with what it was measured on.

`report(__file__, result)` prints the result as JSON (as the scripts always did) and writes it, stamped
with the commit (and whether the tree had changes), the date, the machine's cores and CPU, and its load
average before and after the run, to bench/results/SCRIPT.json: the latest run of each script, which
docs/benchmarks.md quotes. A number without its machine and load is not a measurement.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
STARTED_LOAD = os.getloadavg()  # when the script imported this: the load it started under


def _git(*args: str) -> str:
    try:
        done = subprocess.run(
            ["git", *args], cwd=RESULTS.parent, capture_output=True, text=True, timeout=10, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout.strip()


def stamp() -> dict:
    """What a result was measured on."""
    return {
        "commit": _git("rev-parse", "--short=12", "HEAD") or None,
        "uncommitted_changes": bool(_git("status", "--porcelain", "--untracked-files=no")),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "cores": os.cpu_count(),
        "cpu": platform.processor() or platform.machine(),
        "load_average_1m": {"start": round(STARTED_LOAD[0], 2), "end": round(os.getloadavg()[0], 2)},
    }


def report(script: str, result: object, results: Path = RESULTS) -> Path:
    """Print `result` as JSON and keep it, stamped, as results/<script's name>.json; the file's path."""
    print(json.dumps(result, indent=2), flush=True)
    results.mkdir(exist_ok=True)
    path = results / f"{Path(script).stem}.json"
    path.write_text(json.dumps({"measured_on": stamp(), "result": result}, indent=2) + "\n")
    return path
