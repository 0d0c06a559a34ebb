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
