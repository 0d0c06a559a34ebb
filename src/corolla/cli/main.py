"""The `corolla` command: parse the subcommand, then hand its arguments to that subcommand's module."""

from __future__ import annotations

import argparse
import sys

from corolla.cli import api, demo, dht, generate, identity, server, sim, status
from corolla.cli.common import setup_logging
from corolla.errors import CorollaError
from corolla.version import __version__

SUBCOMMANDS = (dht, server, generate, api, status, demo, identity, sim)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="corolla",
        description="Run large language models across a swarm of ordinary machines.",
    )
    parser.add_argument("--version", action="version", version=f"corolla {__version__}")
    _log_level_option(parser, "INFO")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in SUBCOMMANDS:
        module.add_parser(subparsers)
    for subparser in subparsers.choices.values():  # also after the subcommand; unset there, INFO stays
        _log_level_option(subparser, argparse.SUPPRESS)
    return parser


def _log_level_option(parser: argparse.ArgumentParser, default: str) -> None:
    parser.add_argument(
        "--log-level",
        default=default,
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="logging verbosity (logs go to stderr; default: INFO)",
    )


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level)
    try:
        args.run(args)
    except CorollaError as e:
        print(f"corolla {args.command}: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
