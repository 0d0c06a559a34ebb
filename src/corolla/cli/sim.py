"""`corolla sim SCENARIO`: a simulated swarm under corolla's own placement and routing code, as JSON."""

from __future__ import annotations

import argparse
import json

from corolla.config import MAX_PIPELINE


def _share(text: str) -> float:
    value = float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must lie in [0, 1), got {value}")
    return value


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "sim",
        help="simulate a swarm's placement, crashes, routing and sessions (no network, no real time)",
        description="Run a scenario (a JSON file, or the name of a bundled one: small, crash10, flash, "
        "one_by_one, day, five, thin, liars, waves) through corolla's own placement, rebalancing, routing, "
        "admission and failover code under a simulated clock (servers priced by a compute model calibrated "
        "on corolla's engine, uploads, peers behind NAT reached through relays), and print what it "
        "measured as JSON: coverage of the blocks through crashes and how soon it was restored, the moves "
        "that did it, the sessions (finished, lost, lost while every block had a server, turned away for "
        "want of cache, failovers, per-token latency) and their chains against an oracle that knows every "
        "server's true speed and load and every round trip and upload.",
    )
    parser.add_argument("scenario", metavar="SCENARIO", help="a scenario file, or a bundled scenario's name")
    projection = parser.add_argument_group(
        "speculation",
        "with --speculation, project one session's tokens/s through chains of each server class alone "
        "instead (plain decoding, synchronous speculation, pipelined, and pipelined with epoch fences)",
    )
    projection.add_argument(
        "--speculation", action="store_true", help="project one session's decoding speed per server class"
    )
    projection.add_argument(
        "--acceptance",
        type=_share,
        default=0.8,
        help="share of drafted tokens the model accepts (default 0.8)",
    )
    projection.add_argument(
        "--draft-ms", type=float, default=5.0, help="the drafter's milliseconds per token (default 5)"
    )
    projection.add_argument(
        "--frames-in-flight",
        type=int,
        default=3,
        choices=range(1, MAX_PIPELINE + 1),
        metavar=f"1..{MAX_PIPELINE}",
        help="pipelined frames in flight at most (default 3, as `--draft-pipeline`)",
    )
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
    if args.speculation:
        from corolla.sim.speculation import Drafting, project

        drafting = Drafting(args.acceptance, args.draft_ms / 1000)
        print(json.dumps(project(scenario, drafting, args.frames_in_flight), indent=2), flush=True)
        return
    if args.plot:
        check_plot_path(args.plot)  # before the run, not after it
    logging.getLogger("corolla.client").setLevel(logging.WARNING)  # thousands of simulated clients' bans
    result = simulate(scenario)
    print(json.dumps(result, indent=2), flush=True)
    if args.plot:
        plot(result, args.plot)
