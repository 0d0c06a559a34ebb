"""Options made from configuration fields (cli/config_options.py): each has its field's default, and a bad
value gets the configuration's own error, the same from the command line as from Python."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

import pytest

from corolla.cli import api as api_cli
from corolla.cli import server as server_cli
from corolla.cli.common import client_config, swarm_config
from corolla.cli.config_options import add_field, field_default, field_values
from corolla.cli.main import build_parser, main
from corolla.config import (
    ApiConfig,
    ClientConfig,
    EngineConfig,
    ServerConfig,
    SpeculationConfig,
    SwarmConfig,
)
from corolla.errors import InvalidRequest

PEER = "/ip4/127.0.0.1/tcp/31337/p2p/QmXfmJmpNSm5pjFXvEMcXxf2NAzAvmbeWRbxeAjJwHiFHf"


def subparser(command: str) -> argparse.ArgumentParser:
    return build_parser()._subparsers._group_actions[0].choices[command]


def options(command: str) -> dict[str, argparse.Action]:
    return {flag: action for action in subparser(command)._actions for flag in action.option_strings}


# (command, configuration, fields with no option of their own: why, flags not named after their field)
OPTIONS_OF = [
    ("server", EngineConfig, {}, {}),
    ("server", ServerConfig, {"model": "MODEL", "swarm": "swarm_config", "engine": "the engine options"}, {}),
    (
        "server",
        SwarmConfig,
        {"client_mode": "the command's"},
        {"identity_path": "--identity", "reachability": "--public"},
    ),
    ("api", ApiConfig, {}, {"api_keys": "--api-key"}),
]


@pytest.mark.parametrize(("command", "config", "without", "flags"), OPTIONS_OF)
def test_every_option_of_a_field_has_the_fields_default(command, config, without, flags):
    found = options(command)
    for spec in dataclasses.fields(config):
        flag = flags.get(spec.name, "--" + spec.name.replace("_", "-"))
        assert (flag in found) == (spec.name not in without), f"{config.__name__}.{spec.name}: {flag}"
        if spec.name in without or (config, spec.name) == (ApiConfig, "api_keys"):  # unset: COROLLA_API_KEY
            continue
        default = found[flag].default
        default = tuple(default) if isinstance(default, list) else default  # a repeated option's list
        assert default == field_default(config, spec.name), f"{flag} of {config.__name__}.{spec.name}"


def test_the_client_options_have_the_client_configurations_defaults():
    found = options("api")
    client, speculation = ClientConfig(), SpeculationConfig()
    for flag, value in [
        ("--routing-timeout", client.routing_timeout),
        ("--prefix-cache", client.prefix_cache),
        ("--spot-checks", client.spot_checks),
        ("--wire-encoding", client.wire_encoding),
        ("--exact", client.exact),
        ("--draft-depth", speculation.max_depth),
        ("--draft-device", speculation.device),
        ("--draft-width", speculation.width),
        ("--p2p-host", client.swarm.host),  # a client listens on loopback, a server everywhere
    ]:
        assert found[flag].default == value, flag
    assert options("server")["--host"].default == SwarmConfig().host


def test_the_command_line_builds_the_configurations_defaults(monkeypatch):
    monkeypatch.delenv("COROLLA_API_KEY", raising=False)
    args = build_parser().parse_args(["server", "m"])
    assert set(field_values(args, ServerConfig)) == {f.name for f in dataclasses.fields(ServerConfig)} - {
        "swarm",
        "engine",
    }
    assert server_cli.build_config(args) == ServerConfig(model="m")
    assert api_cli.api_config(build_parser().parse_args(["api", "m"])) == ApiConfig()
    generate = build_parser().parse_args(["generate", "m", "p", "--draft", "lookup"])
    assert client_config(generate) == ClientConfig(speculation=SpeculationConfig())


def build(*argv: str) -> Any:
    """The configuration the command line `argv` builds (what the command builds before it starts)."""
    args = build_parser().parse_args(list(argv))
    builders = {"server": server_cli.build_config, "dht": swarm_config, "generate": client_config}
    return api_cli.api_config(args) if args.command == "api" else builders[args.command](args)


@pytest.mark.parametrize(
    ("argv", "python"),
    [
        (["server", "m", "--max-sessions", "0"], lambda: EngineConfig(max_sessions=0)),
        (
            ["server", "m", "--page-size", "32", "--max-cache-tokens", "16"],
            lambda: EngineConfig(max_cache_tokens=16, page_size=32),
        ),
        (["server", "m", "--max-tree-tokens", "200"], lambda: ServerConfig(model="m", max_tree_tokens=200)),
        (["server", "m", "--num-threads", "0"], lambda: ServerConfig(model="m", num_threads=0)),
        (["dht", "--relay-circuits", "0"], lambda: SwarmConfig(relay_circuits=0)),
        (["api", "m", "--max-model-len", "1"], lambda: ApiConfig(max_model_len=1)),
        (["api", "m", "--port", "0"], lambda: ApiConfig(port=0)),
        (["generate", "m", "p", "--prefix-cache", "-1"], lambda: ClientConfig(prefix_cache=-1)),
        (["generate", "m", "p", "--spot-checks", "2"], lambda: ClientConfig(spot_checks=2.0)),
    ],
)
def test_a_bad_value_gets_the_same_error_from_the_cli_and_from_python(argv, python):
    with pytest.raises(InvalidRequest) as from_python:
        python()
    with pytest.raises(InvalidRequest) as from_cli:
        build(*argv)
    assert str(from_cli.value) == str(from_python.value)
    assert f"(--{argv[-2].lstrip('-')})" in str(from_cli.value)  # it names the option too


def test_routing_timeout_is_named_by_its_option():
    message = r"^routing_timeout \(--routing-timeout\) must be at least 0, got -1.0$"
    with pytest.raises(InvalidRequest, match=message):
        ClientConfig(routing_timeout=-1.0)
    args = build_parser().parse_args(["api", "m", "--routing-timeout", "-1"])
    with pytest.raises(InvalidRequest, match=message):
        client_config(args, routing_timeout=args.routing_timeout)


def test_the_draft_options_errors_name_the_draft_flags():
    with pytest.raises(InvalidRequest, match=r"^max_depth must be greater than 0, got 0$"):
        SpeculationConfig(max_depth=0)
    with pytest.raises(InvalidRequest, match=r"^max_depth \(--draft-depth\) must be greater than 0, got 0$"):
        build("generate", "m", "p", "--draft", "lookup", "--draft-depth", "0")
    with pytest.raises(InvalidRequest, match=r"^width \(--draft-width\) must be greater than 0, got -1$"):
        build("generate", "m", "p", "--initial-peers", PEER, "--draft", "x", "--draft-width", "-1")
    with pytest.raises(InvalidRequest, match=r"^draft \(--draft\) must be 'lookup' or a model$"):
        build("generate", "m", "p", "--draft", "")


def test_the_command_prints_the_configurations_error(capsys, monkeypatch):
    monkeypatch.setattr("corolla.cli.main.setup_logging", lambda level: None)
    with pytest.raises(SystemExit) as exit_info:
        main(["server", "m", "--max-sessions", "0", "--no-nat-port-map"])
    assert exit_info.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == "corolla server: max_sessions (--max-sessions) must be greater than 0, got 0"


@dataclasses.dataclass(frozen=True)
class Example:
    max_batch_tokens: int = 128
    timeout: float | None = None
    name: str = "x"
    is_fast: bool = True
    peers: tuple[str, ...] = ("a",)
    span: tuple[int, int] = (0, 1)
    items: list[int] = dataclasses.field(default_factory=lambda: [1, 2])


def test_an_option_takes_its_flag_dest_type_and_default_from_the_field():
    parser = argparse.ArgumentParser()
    for name in ("max_batch_tokens", "timeout", "name", "is_fast", "peers"):
        add_field(parser, Example, name, "(default: %(default)s)")
    assert vars(parser.parse_args([])) == {
        "max_batch_tokens": 128,
        "timeout": None,
        "name": "x",
        "is_fast": True,
        "peers": ["a"],
    }
    args = parser.parse_args(["--max-batch-tokens=7", "--timeout=1.5", "--no-is-fast", "--peers", "b"])
    assert (args.max_batch_tokens, args.timeout, args.is_fast, args.peers) == (7, 1.5, False, ["a", "b"])
    assert "(default: 128)" in parser.format_help()
    assert field_values(args, Example) == {**vars(args), "peers": ("a", "b")}


def test_a_field_argparse_cannot_parse_needs_its_own_type():
    parser = argparse.ArgumentParser()
    with pytest.raises(TypeError, match=r"Example\.span is a tuple\[int, int\]: its option needs a type="):
        add_field(parser, Example, "span", "")
    add_field(parser, Example, "span", "", "-s", type=lambda text: tuple(map(int, text.split(":"))))
    assert parser.parse_args(["-s", "2:5"]).span == (2, 5)
    assert field_default(Example, "items") == [1, 2]
