"""Options and helpers shared by several subcommands."""

from __future__ import annotations

import argparse
import logging
import sys

from corolla.config import SwarmConfig
from corolla.errors import InvalidRequest
from corolla.swarm.addresses import parse_peer


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    logging.getLogger("corolla").setLevel(level)


def add_swarm_args(parser: argparse.ArgumentParser, *, default_host: str, listen_flag: str = "") -> None:
    """The swarm options; `listen_flag` prefixes --host/--port (e.g. "p2p-") when a command needs those
    names for something else."""
    group = parser.add_argument_group("swarm")
    group.add_argument(
        "--initial-peers",
        action="append",
        type=_peer,
        default=[],
        metavar="MADDR",
        help="multiaddress of a peer already in the swarm, as `corolla dht` prints it (repeat the option "
        "for several peers)",
    )
    group.add_argument(
        f"--{listen_flag}host",
        dest="host",
        default=default_host,
        help="address to listen on for the swarm (default: %(default)s)",
    )
    group.add_argument(
        f"--{listen_flag}port",
        dest="port",
        type=int,
        default=0,
        help="TCP port to listen on for the swarm (default: any free port)",
    )
    group.add_argument(
        "--announce-host",
        default=None,
        help="address other peers should use to reach this one (needs --port)",
    )
    group.add_argument(
        "--nat-port-map",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="ask the LAN gateway (UPnP / NAT-PMP) to forward our port; default: on unless "
        "--host is a loopback address. Turn it off in tests and private networks",
    )
    group.add_argument(
        "--identity",
        default=None,
        metavar="PATH",
        help="private key file that fixes this peer's id across restarts (created if missing)",
    )


def _peer(text: str) -> str:
    try:
        return parse_peer(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def swarm_config(args: argparse.Namespace, *, client_mode: bool = False) -> SwarmConfig:
    if not 0 <= args.port <= 65535:
        raise InvalidRequest(f"--port must lie in 0..65535, got {args.port}")
    return SwarmConfig(
        initial_peers=tuple(args.initial_peers),
        host=args.host,
        port=args.port,
        announce_host=args.announce_host,
        nat_port_map=args.nat_port_map,
        identity_path=args.identity,
        client_mode=client_mode,
    )
