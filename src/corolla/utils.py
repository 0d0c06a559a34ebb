"""Small process helpers shared by benchmarks, tests and the CLI."""

from __future__ import annotations

import ctypes
import os
import platform
import subprocess
import sys
from pathlib import Path

# What a user does to run a model locally: load it whole with transformers and run it, which touches
# every weight. Run in a fresh process so that nothing else counts towards its peak.
_WHOLE_MODEL_PROBE = """
import sys, torch
from transformers import AutoModelForCausalLM
from corolla.utils import peak_rss_bytes
torch.set_num_threads(1)
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
with torch.no_grad():
    model(torch.arange(1, 33)[None])
print(peak_rss_bytes())
"""


def release_freed_memory() -> None:
    """Hand memory that Python and torch have freed back to the OS (glibc's malloc_trim), so that a
    server's RSS after quantizing its span is its weights, not the full-precision copies it dropped.
    A no-op where the C library has no malloc_trim."""
    try:
        libc = ctypes.CDLL(None)
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return
    trim(0)


def peak_rss_bytes(pid: int | None = None) -> int:
    """Peak resident memory (VmHWM) of a process, from /proc (Linux)."""
    with open(f"/proc/{pid or os.getpid()}/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise OSError("VmHWM not found in /proc/<pid>/status")


def whole_model_peak_rss_bytes(model_path: str | os.PathLike) -> int:
    """Peak memory of a separate process that loads the whole model with transformers and runs it once."""
    result = subprocess.run(
        [sys.executable, "-c", _WHOLE_MODEL_PROBE, str(model_path)],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    return int(result.stdout.strip().splitlines()[-1])


def cpu_name() -> str:
    """The CPU's model name (what `lscpu` calls it), or the platform's word for it."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
