"""The Python snippets of the README and of docs/ run as pasted, against a local swarm: only the addresses
change (the initial peer that `corolla dht` prints, the API's port)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PEER_PLACEHOLDER = "/ip4/HOST/tcp/31337/p2p/PEER"
API_PLACEHOLDER = "http://127.0.0.1:8000/v1"


def snippets() -> dict[str, str]:
    """Every ```python block, named by its document and the heading of its section (then 2, 3...)."""
    found: dict[str, str] = {}
    for document in DOCUMENTS:
        heading, code, in_other_block = "top", None, False
        for line in document.read_text().splitlines(keepends=True):
            fence = line.startswith("```")
            if code is not None:  # inside a python block
                if fence:
                    name = f"{document.relative_to(ROOT)}: {heading}"
                    count = sum(other == name or other.startswith(f"{name} ") for other in found)
                    found[f"{name} {count + 1}" if count else name] = code
                    code = None
                else:
                    code += line
            elif in_other_block:  # a "# comment" there is no heading
                in_other_block = not fence
            elif line.startswith("```python"):
                code = ""
            elif fence:
                in_other_block = True
            elif re.match(r"#{1,3} ", line):
                heading = line.lstrip("#").strip()
    return found


SNIPPETS = snippets()


def test_the_documents_have_their_snippets():
    assert {"README.md: The OpenAI API", "README.md: From Python", "docs/python.md: Fine-tuning"} <= set(
        SNIPPETS
    )
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
            if not name.endswith("Fine-tuning"):
                assert stdout.strip(), f"{name} printed nothing"
    finally:
        for run in runs.values():
            if run.poll() is None:
                run.kill()
                run.communicate()
