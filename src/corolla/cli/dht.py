"""`corolla dht`: a bootstrap peer for a private swarm; prints the address others pass to --initial-peers."""

from __future__ import annotations

import argparse
import logging
import signal
import threading

from corolla.cli.common import add_swarm_args, swarm_config

logger = logging.getLogger(__name__)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "dht",
        help="start a DHT bootstrap peer",
        description="Start a DHT peer that servers and clients use to find each other. It prints the "
        "multiaddress to pass to their --initial-peers and runs until SIGINT, SIGTERM or SIGHUP.",
    )
    add_swarm_args(parser, default_host="0.0.0.0")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> None:
    from corolla.swarm.dht import start_dht, visible_addresses  # here: `corolla --help` stays quick

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda *_: stop.set())
    dht = start_dht(swarm_config(args))
    try:
        addresses = visible_addresses(dht)
        print("corolla dht ready; other peers can join with:", flush=True)
        for address in addresses:
            print(f"  --initial-peers {address}", flush=True)
        while not stop.wait(1.0):
            pass
        logger.info("Shutting down the DHT peer")
    finally:
        dht.shutdown()
