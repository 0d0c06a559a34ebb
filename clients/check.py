"""The clients people use against `corolla api` on a local swarm (`make check-clients`): the official openai
(Python with its Responses calls, and Node), anthropic and ollama clients, the OpenAI Agents SDK, litellm,
LangChain, and the coding agents' own programs (Codex CLI, Claude Code), each in an environment of its own,
pinned.

Run with the main venv's python. It installs the clients once (installs.py: clients/.envs/ for Python,
clients/node_modules/ for npm), then goes on in a network namespace of its own where only loopback is up
(unless --no-isolate or --serve), starts a swarm on 127.0.0.1 (one DHT peer; a server per model, a tiny
random Qwen2 with a tool-capable chat template and SmolLM2, and their `corolla api --api-key` servers),
runs python_checks.py, node_checks.mjs and cli_checks.py against it, prints one JSON summary and exits 1 if
any check failed. Every process it starts is ended, by its id, on success, failure, Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import contextlib
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
os.environ["HF_HUB_OFFLINE"] = "1"  # before corolla's imports: the swarm's peers inherit it
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(ROOT / "tests"))  # tool_model.py (and the tiny-model helpers it uses)

from corolla.errors import CorollaError  # noqa: E402
from corolla.launch.local import LocalSwarm, PeerProcess  # noqa: E402
from corolla.models.model_config import ModelConfig  # noqa: E402
from corolla.models.source import resolve_model  # noqa: E402
from tool_model import save_tool_model  # noqa: E402

sys.path.insert(0, str(HERE))
from installs import node_env, python_env, run_quietly, say  # noqa: E402

TOOL_MODEL, SMOL_MODEL = "tool-model", "smollm2"  # the served names (--served-model-name)
# a second API on SmolLM2's servers for the coding agents (cli_checks.py): its template renders their tools,
# it samples greedily where they send no temperature, and its context holds Codex's ~5,400-token prompt
AGENT_MODEL = "smollm2-agents"
AGENT_API_ARGS = ["--chat-template", "chatml-tools", "--default-temperature", "0", "--max-model-len", "8192"]
SERVER_ARGS = ["--max-cache-tokens", "16384", "--inference-max-length"]  # + the model's session limit
START_TIMEOUT = 180.0
SCRIPTS = ("python", "node", "agents")  # python_checks.py, node_checks.mjs, cli_checks.py
ISOLATED = "COROLLA_CHECK_ISOLATED"  # set in the network namespace isolate() re-runs this command in


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
            length = str(min(config.max_position_embeddings, 8192))
            swarm.server_args = [*SERVER_ARGS, length]
            servers.append((swarm, swarm.add_server((0, config.num_hidden_layers), wait=False)))
        for swarm, server in servers:
            swarm.wait_ready(server)
        tool_swarm, smol_swarm = self.swarms
        apis = {
            TOOL_MODEL: (tool_swarm, []),
            SMOL_MODEL: (smol_swarm, []),
            AGENT_MODEL: (smol_swarm, AGENT_API_ARGS),
        }
        with ThreadPoolExecutor(len(apis)) as pool:  # each API loads its model's head and tokenizer
            started = {name: pool.submit(self._add_api, name, *api) for name, api in apis.items()}
        return {name: f"{api.result().url}/v1" for name, api in started.items()}  # served name -> URL

    def _add_api(self, name: str, swarm: LocalSwarm, args: list[str]) -> PeerProcess:
        # `--api-key=KEY`: a random key may begin with "-", which argparse would take for an option
        return swarm.add_api(extra_args=["--served-model-name", name, f"--api-key={self.key}", *args])

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
            "agents": [sys.executable, str(HERE / "cli_checks.py"), "--url", targets[AGENT_MODEL]],
        }
        self.commands["agents"] += ["--model", AGENT_MODEL]
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


def isolate() -> None:
    """Go on in a network namespace of this command's own where only loopback is up, so that no client (nor
    anything they start) reaches another host: re-run this command under `unshare --net` (in a user
    namespace of its own where not root), which then brings loopback up with `ip`."""
    if os.environ.get(ISOLATED):
        run_quietly(["ip", "link", "set", "lo", "up"])
        return
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        raise SystemExit(
            "isolating the clients needs unshare (util-linux) and ip (iproute2); or --no-isolate"
        )
    as_root = [] if os.geteuid() == 0 else ["--map-root-user"]
    command = ["unshare", "--net", *as_root, sys.executable, __file__, *sys.argv[1:]]
    say("running the swarm and the clients in a network namespace where only loopback is up")
    os.execvpe("unshare", command, {**os.environ, ISOLATED: "1"})


def serve(targets: dict[str, str], key: str) -> None:
    """Keep the swarm up for running a client script by hand (the command is printed) until Ctrl-C."""
    args = f"--tool-url {targets[TOOL_MODEL]} --tool-model {TOOL_MODEL}"
    args += f" --smol-url {targets[SMOL_MODEL]} --smol-model {SMOL_MODEL}"
    say("serving until Ctrl-C; run a client script against it from the repository's root, e.g.:")
    say(f"COROLLA_CHECK_KEY={key} node clients/node_checks.mjs {args}")
    say(f"COROLLA_CHECK_KEY={key} clients/.envs/python-*/bin/python clients/python_checks.py {args}")
    say(
        f"COROLLA_CHECK_KEY={key} .venv/bin/python clients/cli_checks.py --url {targets[AGENT_MODEL]} "
        f"--model {AGENT_MODEL}"
    )
    with contextlib.suppress(KeyboardInterrupt):
        signal.pause()


def pinned_versions() -> dict[str, str]:
    """The clients' versions as pinned here (the scripts print the versions they imported, to stderr)."""
    versions = {}
    for line in (HERE / "requirements.txt").read_text().splitlines():
        name, _, version = line.partition("==")
        if version and not line.startswith("#"):
            versions[f"python {name.strip()}"] = version.strip()
    lock = json.loads((HERE / "package-lock.json").read_text())["packages"]
    for name in ("openai", "@openai/codex", "@anthropic-ai/claude-code"):
        versions[f"node {name}"] = lock[f"node_modules/{name}"]["version"]
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
        "--clients", default=",".join(SCRIPTS), help=f"which scripts to run (default: {','.join(SCRIPTS)})"
    )
    parser.add_argument("--sequential", action="store_true", help="run the scripts one after the other")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds a client script may run")
    parser.add_argument("--logs", type=Path, help="keep the swarm's logs in this folder (default: removed)")
    parser.add_argument(
        "--serve", action="store_true", help="start the swarm, print its URLs and key, serve until Ctrl-C"
    )
    parser.add_argument(
        "--no-isolate",
        dest="isolate",
        action="store_false",
        help="run in this machine's network, not in a namespace of its own where only loopback is up",
    )
    args = parser.parse_args()
    args.clients = [name.strip() for name in args.clients.split(",") if name.strip()]
    if not args.clients or not set(args.clients) <= set(SCRIPTS):
        parser.error(f"--clients takes some of {', '.join(SCRIPTS)}, not {args.clients}")
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
    if {"node", "agents"} & set(args.clients):
        node_env()
    if args.isolate and not args.serve:
        isolate()  # from here on, in a network namespace of its own
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
