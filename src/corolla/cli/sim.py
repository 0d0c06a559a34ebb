"""`corolla sim SCENARIO`: a simulated swarm under corolla's own placement and routing code, as JSON."""

from __future__ import annotations

import argparse
import json


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "sim",
        help="simulate a swarm's placement, crashes, routing and sessions (no network, no real time)",
        description="Run a scenario (a JSON file, or the name of a bundled one: small, crash10, flash, "
        "one_by_one, day, five) through corolla's own placement, rebalancing, routing, admission and "
        "failover code under a simulated clock (servers priced by a compute model calibrated on corolla's "
        "engine, uploads, peers behind NAT reached through relays), and print what it measured as JSON: "
        "coverage of the blocks through crashes and how soon it was restored, the moves that did it, the "
        "sessions (finished, lost, lost while every block had a server, turned away for want of cache, "
        "failovers, per-token latency) and their chains against an oracle that knows every server's true "
        "speed and load and every round trip and upload.",
    )
    parser.add_argument("scenario", metavar="SCENARIO", help="a scenario file, or a bundled scenario's name")
    parser.add_argument(
        "--plot",
        metavar="FILE",
        help="also draw the coverage over time (and crashes) to FILE (.png, .svg or .pdf; needs matplotlib)",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> None:
    import logging

    from corolla.sim.plot import check_plot_path, plot
    from corolla.sim.report import simulate
    from corolla.sim.scenario import load

    scenario = load(args.scenario)
    if args.plot:
        check_plot_path(args.plot)  # before the run, not after it
    logging.getLogger("corolla.client").setLevel(logging.WARNING)  # thousands of simulated clients' bans
    result = simulate(scenario)
    print(json.dumps(result, indent=2), flush=True)
    if args.plot:
        plot(result, args.plot)
