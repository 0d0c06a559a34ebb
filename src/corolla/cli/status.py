"""`corolla status --initial-peers ...`: print which servers host which blocks, as the DHT shows them."""

from __future__ import annotations

import argparse
import asyncio
import json

from corolla.cli.common import add_swarm_args, swarm_config
from corolla.errors import InvalidRequest


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "status",
        help="show the swarm: servers, their spans and load, and block coverage",
        description="Read the swarm's DHT and print, for every model its servers announce (or only "
        "--model), a coverage line per block and one line per server: span, state, throughput, sessions, "
        "queued tokens and free cache; the servers that clients' spot checks reported faulty; and the DHT "
        "records this peer refused (forged, unsigned, malformed or, in a private swarm, from peers not "
        "allowed).",
    )
    parser.add_argument(
        "--model",
        default=None,
        metavar="PREFIX",
        help="only this model's DHT prefix (as servers print it, e.g. SmolLM2-135M-Instruct)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    add_swarm_args(parser, default_host="127.0.0.1")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> None:
    from corolla.swarm.dht import find_models, start_dht
    from corolla.swarm.overview import format_table, read_overview

    config = swarm_config(args, client_mode=True)
    if not config.initial_peers:
        raise InvalidRequest("--initial-peers is required: status reads the swarm's DHT")

    async def read_all() -> list:
        models = await find_models(dht)
        if args.model is not None:
            models = {args.model: models[args.model]} if args.model in models else {}
        if not models:
            raise InvalidRequest(
                "no server announces " + (f"model {args.model}" if args.model else "any model") + " now"
            )
        p2p = await dht.replicate_p2p()  # each server's live figures, not its last announcement
        try:
            return [await read_overview(dht, prefix, blocks, p2p=p2p) for prefix, blocks in models.items()]
        finally:
            await p2p.shutdown()

    dht = start_dht(config)
    try:
        overviews = asyncio.run(read_all())
    finally:
        dht.shutdown()
    if args.json:
        print(json.dumps([overview.to_dict() for overview in overviews], indent=2))
    else:
        print("\n\n".join(format_table(overview) for overview in overviews))
