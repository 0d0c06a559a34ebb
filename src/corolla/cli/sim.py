"""`corolla sim SCENARIO`: a simulated swarm under corolla's own placement and routing code, as JSON."""

from __future__ import annotations

import argparse
import json


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "sim",
        help="simulate a swarm's placement, crashes, routing and sessions (no network, no real time)",
        description="Run a scenario (a JSON file, or the name of a bundled one: small, crash10, flash, "
        "one_by_one, day) through corolla's own placement, rebalancing, routing and failover code under a "
        "simulated clock, and print what it measured as JSON: coverage of the blocks through crashes and how "
        "soon it was restored, the moves that did it, the sessions (finished, lost, lost while every block "
        "had a server, failovers, per-token latency) and their chains against an oracle that knows every "
        "server's true speed and every round trip.",
    )
    parser.add_argument("scenario", metavar="SCENARIO", help="a scenario file, or a bundled scenario's name")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> None:
    import logging

    from corolla.sim.report import simulate
    from corolla.sim.scenario import load

    logging.getLogger("corolla.client").setLevel(logging.WARNING)  # thousands of simulated clients' bans
    print(json.dumps(simulate(load(args.scenario)), indent=2), flush=True)
