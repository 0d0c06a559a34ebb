"""`corolla demo` (what `make demo` runs): a whole local swarm, a coherent answer, a clean shutdown."""

from __future__ import annotations

import subprocess
import sys


def test_demo_answers_and_shuts_down():
    result = subprocess.run(
        [sys.executable, "-m", "corolla", "demo", "--max-new-tokens", "24"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Paris" in result.stdout
    assert "Swarm ready" in result.stderr and "shutting the swarm down" in result.stderr
