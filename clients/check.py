"""Real OpenAI and Ollama clients against `corolla api` on a local swarm (issue 16): the official `openai`
clients for Python and Node, litellm, LangChain and the official `ollama` client (Ollama's routes), each
in an environment of its own, pinned.

Run with the main venv's python (`make check-clients`). It installs the clients once into clients/.envs/
(Python, keyed by a hash of requirements.txt + constraints.txt) and clients/node_modules/ (`npm ci` from
package-lock.json), starts a swarm on 127.0.0.1 (one DHT peer; one server and one `corolla api --api-key`
per model: a tiny random Qwen2 with a tool-capable chat template, and SmolLM2), runs python_checks.py and
node_checks.mjs against it, prints one JSON summary and exits 1 if any check failed. Every process it
starts is ended, by its id, on success, failure, Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
ENVS = HERE / ".envs"
os.environ["HF_HUB_OFFLINE"] = "1"  # before corolla's imports: the swarm's peers inherit it
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(ROOT / "tests"))  # tool_model.py (and the tiny-model helpers it uses)

from corolla.errors import CorollaError  # noqa: E402
from corolla.launch.local import LocalSwarm, PeerProcess  # noqa: E402
from corolla.models.model_config import ModelConfig  # noqa: E402
from corolla.models.source import resolve_model  # noqa: E402
from tool_model import save_tool_model  # noqa: E402

TOOL_MODEL, SMOL_MODEL = "tool-model", "smollm2"  # the served names (--served-model-name)
SERVER_ARGS = ["--max-cache-tokens", "8192", "--inference-max-length"]  # + the model's session limit
START_TIMEOUT = 180.0


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


def tool_model(path: Path) -> Path:
    """tests/tool_model.py's checkpoint (without transformers' "Writing model shards" bar)."""
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    return save_tool_model(path)


class Swarm:
    """One DHT peer, then a server (all blocks) and an API per model, on 127.0.0.1; stop() ends them all."""

    def __init__(self, workdir: Path, key: str):
        self.workdir, self.key = workdir, key
        self.swarms: list[LocalSwarm] = []

    def start(self) -> dict[str, str]:
        models = {
            TOOL_MODEL: tool_model(self.workdir / "tool-model"),
            SMOL_MODEL: resolve_model("smollm2").path,
        }
        for name, path in models.items():
            self.swarms.append(
                LocalSwarm(str(path), [], workdir=self.workdir / name, start_timeout=START_TIMEOUT)
            )
        first = self.swarms[0].start()  # no spans: the DHT peer only, which every peer joins
        servers: list[tuple[LocalSwarm, PeerProcess]] = []
        for swarm, path in zip(self.swarms, models.values(), strict=True):
            swarm.initial_peers = first.initial_peers
            config = ModelConfig.from_folder(path)
            length = str(min(config.max_position_embeddings, 2048))
            swarm.server_args = [*SERVER_ARGS, length]
            servers.append((swarm, swarm.add_server((0, config.num_hidden_layers), wait=False)))
        for swarm, server in servers:
            swarm.wait_ready(server)
        with ThreadPoolExecutor(len(models)) as pool:  # each API loads its model's head and tokenizer
            apis = pool.map(self._add_api, self.swarms, models)
        return {name: f"{api.url}/v1" for name, api in zip(models, apis, strict=True)}  # served name -> URL

    def _add_api(self, swarm: LocalSwarm, name: str) -> PeerProcess:
        # `--api-key=KEY`: a random key may begin with "-", which argparse would take for an option
        return swarm.add_api(extra_args=["--served-model-name", name, f"--api-key={self.key}"])

    def stop(self) -> None:
        """The APIs and servers first, the DHT peer (of the first swarm) last."""
        for swarm in reversed(self.swarms):
            swarm.stop()


class Clients:
    """The client scripts as child processes, each in a session of its own, killed if still running."""

    def __init__(self, python: Path, targets: dict[str, str], key: str, timeout: float):
        args = [
            *("--tool-url", targets[TOOL_MODEL], "--tool-model", TOOL_MODEL),
            *("--smol-url", targets[SMOL_MODEL], "--smol-model", SMOL_MODEL),
        ]
        self.commands = {
            "python": [str(python), str(HERE / "python_checks.py"), *args],
            "node": ["node", str(HERE / "node_checks.mjs"), *args],
        }
        self.env = {**os.environ, "COROLLA_CHECK_KEY": key}
        self.timeout = timeout
        self.running: list[subprocess.Popen] = []

    def run(self, which: list[str], parallel: bool) -> dict[str, dict]:
        results: dict[str, dict] = {}
        batches = [which] if parallel else [[name] for name in which]
        for batch in batches:
            started = {name: self._start(name) for name in batch}
            for name, process in started.items():
                results.update(self._collect(name, process))
        return results

    def _start(self, name: str) -> subprocess.Popen:
        say(f"running the {name} clients")
        process = subprocess.Popen(
            self.commands[name], stdout=subprocess.PIPE, env=self.env, text=True, start_new_session=True
        )
        self.running.append(process)
        return process

    def _collect(self, name: str, process: subprocess.Popen) -> dict[str, dict]:
        """The script's JSON (its last stdout line), or one failed entry saying why there is none."""
        try:
            stdout, _ = process.communicate(timeout=self.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)  # its own session: the script and its children
            process.communicate()
            return {name: {"script": {"ok": False, "detail": f"still running after {self.timeout:.0f}s"}}}
        lines = stdout.strip().splitlines()
        try:
            return json.loads(lines[-1])
        except (IndexError, json.JSONDecodeError):
            detail = f"exit code {process.returncode}, no JSON summary on stdout: {stdout[-500:]!r}"
            return {name: {"script": {"ok": False, "detail": detail}}}

    def kill(self) -> None:
        for process in self.running:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)  # its own session: the script and its children
                process.wait()


def serve(targets: dict[str, str], key: str) -> None:
    """Keep the swarm up for running a client script by hand (the command is printed) until Ctrl-C."""
    args = f"--tool-url {targets[TOOL_MODEL]} --tool-model {TOOL_MODEL}"
    args += f" --smol-url {targets[SMOL_MODEL]} --smol-model {SMOL_MODEL}"
    say("serving until Ctrl-C; run a client script against it from the repository's root, e.g.:")
    say(f"COROLLA_CHECK_KEY={key} node clients/node_checks.mjs {args}")
    say(f"COROLLA_CHECK_KEY={key} clients/.envs/python-*/bin/python clients/python_checks.py {args}")
    with contextlib.suppress(KeyboardInterrupt):
        signal.pause()


def pinned_versions() -> dict[str, str]:
    """The clients' versions as pinned here (the scripts print the versions they imported, to stderr)."""
    versions = {}
    for line in (HERE / "requirements.txt").read_text().splitlines():
        name, _, version = line.partition("==")
        if version and not line.startswith("#"):
            versions[f"python {name.strip()}"] = version.strip()
    lock = json.loads((HERE / "package-lock.json").read_text())
    versions["node openai"] = lock["packages"]["node_modules/openai"]["version"]
    return versions


def summarize(results: dict[str, dict], seconds: float) -> dict:
    checks = [check for client in results.values() for check in client.values()]
    failed = sum(not check["ok"] for check in checks)
    return {
        "passed": len(checks) - failed,
        "failed": failed,
        "seconds": round(seconds, 1),
        "versions": pinned_versions(),
        "clients": results,
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--clients", default="python,node", help="which scripts to run (default: python,node)"
    )
    parser.add_argument("--sequential", action="store_true", help="run the scripts one after the other")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds a client script may run")
    parser.add_argument("--logs", type=Path, help="keep the swarm's logs in this folder (default: removed)")
    parser.add_argument(
        "--serve", action="store_true", help="start the swarm, print its URLs and key, serve until Ctrl-C"
    )
    args = parser.parse_args()
    args.clients = [name.strip() for name in args.clients.split(",") if name.strip()]
    if not args.clients or not set(args.clients) <= {"python", "node"}:
        parser.error(f"--clients takes python, node or both, not {args.clients}")
    return args


def run(args: argparse.Namespace, python: Path, workdir: Path, started: float) -> dict[str, dict] | None:
    """Start the swarm, run the client scripts against it (None: --serve), stop everything."""
    key = secrets.token_urlsafe(16)
    swarm = Swarm(workdir, key)
    clients: Clients | None = None
    try:
        say(f"starting the swarm (logs in {workdir})")
        try:
            targets = swarm.start()
        except CorollaError as error:  # a peer that did not start: its log's tail is in the message
            return {"swarm": {"start": {"ok": False, "detail": str(error)}}}
        say(f"swarm ready after {time.monotonic() - started:.0f}s: {json.dumps(targets)}")
        if args.serve:
            serve(targets, key)
            return None
        clients = Clients(python, targets, key, args.timeout)
        return clients.run(args.clients, parallel=not args.sequential)
    finally:
        if clients is not None:
            clients.kill()
        swarm.stop()


def main() -> int:
    # Ctrl-C (even where a shell started us with SIGINT ignored), SIGTERM and SIGHUP all go through the
    # finally blocks, which end every process started here
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    signal.signal(signal.SIGHUP, lambda *_: sys.exit(129))
    args = parse_args()
    started = time.monotonic()
    python = python_env() if "python" in args.clients else Path(sys.executable)
    if "node" in args.clients:
        node_env()
    with tempfile.TemporaryDirectory(prefix="corolla-clients-") as tmp:
        results = run(args, python, args.logs.resolve() if args.logs else Path(tmp), started)
    if results is None:
        return 0
    summary = summarize(results, time.monotonic() - started)
    print(json.dumps(summary, indent=2))
    if summary["failed"] and not args.logs:
        say("some checks failed; --logs DIR keeps the swarm's logs (the APIs' logs say what they refused)")
    return 1 if summary["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
