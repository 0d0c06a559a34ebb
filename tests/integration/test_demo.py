"""`corolla demo` (what `make demo` runs): a whole local swarm, a coherent answer, a clean shutdown."""

from __future__ import annotations

from swarm_helpers import run_corolla


def test_demo_answers_and_shuts_down():
    (result,) = run_corolla(["demo", "--max-new-tokens", "24"], timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Paris" in result.stdout
    assert "Swarm ready" in result.stderr and "shutting the swarm down" in result.stderr
