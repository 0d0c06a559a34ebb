"""What `make check-clients` installs before it runs anything: the Python clients' venv and the npm packages
(the Node client and the coding agents' programs), each redone only when its pins change."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
ENVS = HERE / ".envs"


def say(text: str) -> None:
    print(f"[check-clients] {text}", file=sys.stderr, flush=True)


def run_quietly(command: list[str], cwd: Path | None = None) -> None:
    """Run an install step; on failure, its output goes to stderr and the error names the command."""
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.stderr.write(done.stdout[-4000:] + done.stderr[-4000:])
        raise SystemExit(f"`{' '.join(command)}` failed with exit code {done.returncode}")


def file_hash(*paths: Path, extra: str = "") -> str:
    digest = hashlib.sha256(extra.encode())
    for path in paths:
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def python_env() -> Path:
    """The clients' venv, made once per requirements (stale ones are removed); returns its python."""
    requirements, constraints = HERE / "requirements.txt", HERE / "constraints.txt"
    env = ENVS / f"python-{file_hash(requirements, constraints, extra=sys.version)}"
    python = env / "bin" / "python"
    if (env / ".ready").is_file():
        return python
    for stale in ENVS.glob("python-*"):
        shutil.rmtree(stale)
    say(f"installing the Python clients into {env.relative_to(ROOT)} (once; needs PyPI)")
    run_quietly([sys.executable, "-m", "venv", str(env)])
    pip = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    run_quietly([*pip, "-r", str(requirements), "-c", str(constraints)])
    (env / ".ready").write_text("installed\n")
    return python


def node_env() -> None:
    """clients/node_modules from package-lock.json (`npm ci`), redone when the lock file changes."""
    key = file_hash(HERE / "package.json", HERE / "package-lock.json")
    marker = HERE / "node_modules" / ".corolla-check-key"
    if marker.is_file() and marker.read_text() == key:
        return
    if shutil.which("npm") is None or shutil.which("node") is None:
        raise SystemExit("the Node client needs node (20 or newer) and npm; `--clients python` leaves it out")
    say("installing the Node client into clients/node_modules (once; needs the npm registry)")
    run_quietly(["npm", "ci", "--no-audit", "--no-fund", "--loglevel=error"], cwd=HERE)
    marker.write_text(key)
