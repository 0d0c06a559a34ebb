"""`corolla dht`: a bootstrap peer for a private swarm; prints the address others pass to --initial-peers."""

from __future__ import annotations

import argparse
import logging
import signal
import threading

from corolla.cli.common import SERVER_HOST, add_swarm_args, swarm_config

logger = logging.getLogger(__name__)
CHECK_PERIOD = 15.0  # seconds between a public DHT peer's requests to be dialed back, until one is answered


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "dht",
        help="start a DHT bootstrap peer",
        description="Start a DHT peer that servers and clients use to find each other. It prints the "
        "multiaddress to pass to their --initial-peers and runs until SIGINT, SIGTERM or SIGHUP. It is "
        "taken to be reachable (--public: run it on a machine with a public address, or forward its "
        "--port) and relays for servers behind NAT (--no-relay: not); once peers join, it asks them to "
        "dial it back and warns when none can.",
    )
    add_swarm_args(parser, default_host=SERVER_HOST)
    parser.set_defaults(run=run, reachability="public")


def run(args: argparse.Namespace) -> None:
    from corolla.swarm.dht import start_dht, visible_addresses  # here: `corolla --help` stays quick
    from corolla.swarm.nat.joining import confirm_public

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda *_: stop.set())
    config = swarm_config(args)
    dht = start_dht(config)
    try:
        addresses = visible_addresses(dht)
        print("corolla dht ready; other peers can join with:", flush=True)
        for address in addresses:
            print(f"  --initial-peers {address}", flush=True)
        checked = config.reachability != "public"  # a public one asks peers to dial it back, once some join
        while not stop.wait(CHECK_PERIOD if not checked else 1.0):
            checked = checked or dht.run_coroutine(confirm_public)
        logger.info("Shutting down the DHT peer")
    finally:
        dht.shutdown()
