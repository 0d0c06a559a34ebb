"""Every benchmark's result, printed and kept with what it was measured on.

`report(__file__, result)` prints the result as JSON (as the scripts always did) and writes it, stamped
with the command and its options, the commit (and whether the tree had changes), the date, the machine's
cores and CPU, and its load average before and after the run, to bench/results/SCRIPT.json (SCRIPT: the
script's file name, whatever its group): the latest run of each script, which docs/benchmarks.md quotes
(`make bench-docs`). A number without its machine and load is not a measurement.
"""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "results"  # bench/results
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
        "command": " ".join(["python -m", _module(), *sys.argv[1:]]),  # the options it ran with
        "commit": _git("rev-parse", "--short=12", "HEAD") or None,
        "uncommitted_changes": bool(_git("status", "--porcelain", "--untracked-files=no")),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "cores": os.cpu_count(),
        "cpu": platform.processor() or platform.machine(),
        "load_average_1m": {"start": round(STARTED_LOAD[0], 2), "end": round(os.getloadavg()[0], 2)},
    }


def _module() -> str:
    """The running script as `python -m` names it (the path given when it was run as a file)."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    return spec.name if spec is not None else (sys.argv[0] or "?")


def compact(text: str) -> str:
    """Indented JSON with each list or object of plain values on one line."""
    short = r"([\[{])\s+([^\[\]{}]*?)\s+([\]}])"
    return re.sub(short, lambda m: " ".join(m.group(2).split()).join(m.group(1, 3)), text)


def report(
    script: str, result: object, results: Path = RESULTS, short: bool = False, variant: str = ""
) -> Path:
    """Print `result` as JSON (`short`: compact) and keep it, stamped, as results/<script's name>.json
    (a `variant` of the script's run: <script's name>_<variant>.json); the file's path."""
    text = json.dumps(result, indent=2)
    print(compact(text) if short else text, flush=True)
    results.mkdir(exist_ok=True)
    path = results / f"{Path(script).stem}{'_' + variant if variant else ''}.json"
    path.write_text(json.dumps({"measured_on": stamp(), "result": result}, indent=2) + "\n")
    return path
