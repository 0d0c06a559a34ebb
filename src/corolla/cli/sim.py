"""`corolla sim SCENARIO`: a simulated swarm under corolla's own placement and routing code, as JSON."""

from __future__ import annotations

import argparse
import json


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "sim",
        help="simulate a swarm's placement, crashes and routing (no network, no real time)",
        description="Run a scenario (a JSON file, or the name of a bundled one: small, crash10) through "
        "corolla's own placement, rebalancing and routing code under a simulated clock, and print what it "
        "measured as JSON: coverage of the blocks through crashes and how soon it was restored, the moves "
        "that did it, and the chains clients chose against an oracle that knows every server's true speed.",
    )
    parser.add_argument("scenario", metavar="SCENARIO", help="a scenario file, or a bundled scenario's name")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> None:
    from corolla.sim.report import simulate
    from corolla.sim.scenario import load

    print(json.dumps(simulate(load(args.scenario)), indent=2), flush=True)
