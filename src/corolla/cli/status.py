"""`corolla status --initial-peers ...`: print which servers host which blocks: the DHT's records, checked
by pinging each server (only those that answer count)."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

from corolla.cli.common import CLIENT_HOST, add_swarm_args, swarm_config
from corolla.errors import InvalidRequest


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "status",
        help="show the swarm: servers, their spans and load, and block coverage",
        description="Read the swarm's DHT, ping every server it names, and print, for every model the "
        "servers that answer announce (or only --model), a coverage line per block and one line per "
        "answering server: span, state, throughput, sessions, queued tokens and free cache (live); the "
        "records of servers that do not answer (never counted); the servers that clients' spot checks "
        "reported faulty; and the DHT records this peer refused (forged, unsigned, malformed or, in a "
        "private swarm, from peers not allowed).",
    )
    parser.add_argument(
        "--model",
        default=None,
        metavar="PREFIX",
        help="only this model's DHT prefix (as servers print it, e.g. SmolLM2-135M-Instruct)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    add_swarm_args(parser, default_host=CLIENT_HOST)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> None:
    from corolla.swarm.dht import find_models, start_dht
    from corolla.swarm.records.overview import confirmed_models, format_table, read_overview

    config = swarm_config(args, client_mode=True)
    if not config.initial_peers:
        raise InvalidRequest("--initial-peers is required: status reads the swarm's DHT")

    async def read_all() -> tuple[list, list[str]]:
        claims = await find_models(dht)
        if args.model is not None:
            claims = {args.model: claims[args.model]} if args.model in claims else {}
        p2p = await dht.replicate_p2p()  # each server's live figures, not its last announcement
        try:
            models = await confirmed_models(p2p, claims)  # only servers that answer say what a model is
            if not models:
                raise InvalidRequest(
                    "no server that answers announces "
                    + (f"model {args.model}" if args.model else "any model")
                    + " now"
                    + (f" ({_unconfirmed(claims)})" if claims else "")
                )
            overviews = [
                await read_overview(dht, prefix, blocks, p2p=p2p) for prefix, blocks in models.items()
            ]
        finally:
            await p2p.shutdown()
        return overviews, sorted(set(claims) - set(models))

    dht = start_dht(config)
    try:
        overviews, unconfirmed = asyncio.run(read_all())
    finally:
        dht.shutdown()
    if unconfirmed:
        print(f"not shown: {_unconfirmed({prefix: {} for prefix in unconfirmed})}", file=sys.stderr)
    if args.json:
        print(json.dumps([overview.to_dict() for overview in overviews], indent=2))
    else:
        print("\n\n".join(format_table(overview) for overview in overviews))


def _unconfirmed(claims: dict) -> str:
    return "DHT records name model(s) " + ", ".join(sorted(claims)) + " but no server of theirs answers"
