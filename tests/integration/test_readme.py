"""The README's Python snippets run as pasted, against a local swarm: only the addresses change (the
initial peer that `corolla dht` prints, the API's port)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).parents[2] / "README.md"
PEER_PLACEHOLDER = "/ip4/HOST/tcp/31337/p2p/PEER"
API_PLACEHOLDER = "http://127.0.0.1:8000/v1"


def snippets() -> dict[str, str]:
    """The README's ```python blocks, by the heading of their section."""
    found, heading = {}, "top"
    for block in re.split(r"^(## .*)$", README.read_text(), flags=re.M):
        if block.startswith("## "):
            heading = block[3:].strip()
            continue
        for i, code in enumerate(re.findall(r"^```python\n(.*?)^```", block, flags=re.M | re.S)):
            found[heading if i == 0 else f"{heading} {i + 1}"] = code
    return found


SNIPPETS = snippets()


def test_the_readme_has_its_snippets():
    assert {"The OpenAI API", "From Python", "Fine-tuning"} <= set(SNIPPETS)
    for name, code in SNIPPETS.items():
        assert PEER_PLACEHOLDER in code or API_PLACEHOLDER in code, f"{name}: no swarm address to replace"


def test_every_snippet_runs_as_pasted(smol_swarm, smol_api):
    """All at once (each is a fresh Python process: imports and a DHT peer of its own)."""
    runs = {}
    for name, code in SNIPPETS.items():
        code = code.replace(PEER_PLACEHOLDER, smol_swarm.initial_peers[0])
        code = code.replace(API_PLACEHOLDER, f"{smol_api.url}/v1")
        runs[name] = subprocess.Popen(
            [sys.executable, "-c", code],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=smol_swarm.env,
        )
    try:
        for name, run in runs.items():
            stdout, stderr = run.communicate(timeout=300)
            assert run.returncode == 0, f"{name}:\n{stderr[-3000:]}"
            if name != "Fine-tuning":
                assert stdout.strip(), f"{name} printed nothing"
    finally:
        for run in runs.values():
            if run.poll() is None:
                run.kill()
                run.communicate()
