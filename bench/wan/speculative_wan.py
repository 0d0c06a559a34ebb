"""Speculative decoding across an emulated internet, and on loopback: tokens/s, acceptance, exactness.

Single-session decoding of SmolLM2 through 3 servers (blocks 0:10, 10:20, 20:30), with the DHT, each
server and the client in their own network namespace (bench/lib/wan.py; 50 ms round trips by default), on a
fixed set of 8 prompts (bench/lib/prompts.py: chat questions, summaries of a given paragraph, edits of given
code). Systems, run one after the other in each round: plain (no push), push, push + prompt lookup, push +
a draft model (an int8 copy of SmolLM2 on the client) as a chain and as a tree; lookup and the chain each
synchronous (a round trip per draft), pipelined (drafts in flight: client/generation/pipelined.py) and
as the client picks (`auto`: the default, whichever of the two it measured faster). Every system must give
the same tokens (`identical_outputs`). Reports per system the median over rounds of decode tokens/s (all
prompts, and per category), the drafted tokens' acceptance, tokens per step (per round trip) and the
ratio to push. The same runs on loopback show what speculation costs when round trips are cheap.
Then, with every host's upload capped (--rate), the time to first token of a 2,000-token prompt with
the wire lossless and with each lossy encoding, and (uncapped) each lossy encoding's greedy-token
agreement with lossless over 64 tokens (bench/wan/ttft.py). Needs root and iptables for the emulated internet.

    python -m bench.wan.speculative_wan [--delay-ms 25] [--rate 20mbit] [--runs 3] [--new-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from bench.lib.env import parser, wan_flags
from bench.lib.prompts import PROMPTS, benchmark_prompts
from bench.lib.stamp import report
from bench.lib.wan import SPANS, WanSwarm, address
from bench.wan.ttft import ENCODINGS, LONG_PROMPT_TOKENS, measure_agreement, measure_ttft
from corolla.launch.local import client_config

DRAFT = "smollm2"


def client_configs(host: str, peers: list[str], names: list[str] | None = None) -> dict:
    from corolla.config import SpeculationConfig

    draft = dict(draft=DRAFT, quantize="int8")
    configs = {
        "plain": dict(use_push=False),
        "push": {},
        "push+lookup": dict(speculation=SpeculationConfig(pipeline=1)),
        "push+lookup pipelined": dict(speculation=SpeculationConfig(adaptive=False)),
        "push+lookup auto": dict(speculation=SpeculationConfig()),
        "push+draft chain": dict(speculation=SpeculationConfig(**draft, width=1, pipeline=1)),
        "push+draft pipelined": dict(speculation=SpeculationConfig(**draft, adaptive=False)),
        "push+draft auto": dict(speculation=SpeculationConfig(**draft)),
        "push+draft tree": dict(speculation=SpeculationConfig(**draft, width=3)),
    }
    return {
        name: client_config(host, peers, request_timeout=120, **extra)
        for name, extra in configs.items()
        if names is None or name in names or name == "push"
    }


def encoding_configs(host: str, peers: list[str]) -> dict:
    return {e: client_config(host, peers, request_timeout=300, wire_encoding=e) for e in ENCODINGS}


def connect(configs: dict) -> dict:
    from corolla.client.model import DistributedModelForCausalLM

    return {
        name: DistributedModelForCausalLM.from_pretrained("smollm2", config=c) for name, c in configs.items()
    }


def measure(configs: dict, runs: int, new_tokens: int) -> dict:
    """Every system on every prompt, `runs` rounds after a warm-up round; figures per system."""
    models = connect(configs)
    prompts = benchmark_prompts(next(iter(models.values())).tokenizer)
    records: dict[str, list[list[tuple[str, int, float]]]] = {name: [] for name in models}
    outputs: dict[str, list[list[int]]] = {}
    try:
        for round_ in range(runs + 1):  # round 0 warms up connections and caches
            for name, model in models.items():
                stats = model.speculator.stats if model.speculator else None
                rows = []
                for i, (kind, ids) in enumerate(prompts):
                    stamps, tokens = [], []
                    for step in model.generate_stream(ids, max_new_tokens=new_tokens):
                        stamps.append(time.perf_counter())
                        tokens.append(int(step[0]))
                    rows.append((kind, len(tokens) - 1, stamps[-1] - stamps[0]))
                    outputs[f"{name}/{i}"] = tokens
                if round_:
                    records[name].append(rows)
                if stats and round_ == 0:  # count only the measured rounds
                    stats.steps = stats.drafted = stats.accepted = stats.emitted = 0
    finally:
        for model in models.values():
            model.shutdown()
    return summary(models, records, outputs)


def summary(models: dict, records: dict, outputs: dict) -> dict:
    names = list(models)
    identical = all(
        outputs[f"{name}/{i}"] == outputs[f"{names[0]}/{i}"] for name in names for i in range(len(PROMPTS))
    )
    result = {"identical_outputs": identical, "systems": {}}
    for name, model in models.items():
        rounds = records[name]

        def rate(kinds: tuple[str, ...], rounds: list = rounds) -> float:
            per_round = [
                sum(n for k, n, _ in rows if k in kinds) / sum(s for k, _, s in rows if k in kinds)
                for rows in rounds
            ]
            return round(statistics.median(per_round), 2)

        entry = {
            "tokens_per_s": rate(("chat", "summarise", "edit")),
            "chat": rate(("chat",)),
            "summarise": rate(("summarise",)),
            "edit": rate(("edit",)),
            "summarise+edit": rate(("summarise", "edit")),
        }
        stats = model.speculator.stats if model.speculator else None
        if stats is not None:
            entry.update(
                acceptance=round(stats.acceptance, 3),
                tokens_per_step=round(stats.tokens_per_step, 2),
                most_in_flight=stats.most_in_flight,
            )
        result["systems"][name] = entry
    push = result["systems"]["push"]
    for entry in result["systems"].values():
        entry["vs_push"] = round(entry["tokens_per_s"] / push["tokens_per_s"], 2)
        entry["summarise+edit_vs_push"] = round(entry["summarise+edit"] / push["summarise+edit"], 2)
    return result


def run_client(peers: list[str], args: argparse.Namespace) -> None:
    """Inside the client's host: one section of the benchmark, printed as JSON."""
    import torch

    torch.set_num_threads(1)
    if args.section == "decode":
        result = measure(client_configs(address(4), peers, args.systems), args.runs, args.new_tokens)
    else:
        models = connect(encoding_configs(address(4), peers))
        try:
            result = measure_ttft(models, args.runs) if args.section == "ttft" else measure_agreement(models)
        finally:
            for model in models.values():
                model.shutdown()
    print(json.dumps(result))


def loopback(args: argparse.Namespace) -> dict:
    from corolla.launch.local import LocalSwarm
    from corolla.models.source import resolve_model

    path = resolve_model("smollm2").path
    with LocalSwarm(str(path), SPANS, server_args=["--num-threads", "1"]) as swarm:
        configs = client_configs("127.0.0.1", swarm.initial_peers, args.systems)
        return measure(configs, args.runs, args.new_tokens)


def wan(args: argparse.Namespace) -> dict:
    """Decoding at the delay, then (with every host's upload capped) time to first token per encoding."""
    common = ["--runs", str(args.runs), "--new-tokens", str(args.new_tokens)]
    if args.systems:
        common += ["--systems", *args.systems]
    results: dict = {"round_trip_ms": 2 * args.delay_ms}
    with WanSwarm(args.delay_ms) as swarm:
        if not args.no_decode:
            results["decode"] = swarm.run_client(__spec__.name, [*common, "--section", "decode"])
        if not args.no_ttft:
            swarm.set(args.delay_ms, args.rate)
            ttft = swarm.run_client(__spec__.name, [*common, "--section", "ttft"])
            results["ttft"] = {"prompt_tokens": LONG_PROMPT_TOKENS, "upload_cap": args.rate, **ttft}
            swarm.set(args.delay_ms)
            results["lossy_agreement_64_tokens"] = swarm.run_client(
                __file__, [*common, "--section", "agreement"]
            )
    return results


def main() -> None:
    flags = parser(__doc__, wan_flags())
    flags.add_argument("--rate", default="20mbit", help="every host's upload cap for time to first token")
    flags.add_argument("--runs", type=int, default=3, help="rounds over the 8 prompts (after a warm-up)")
    flags.add_argument("--new-tokens", type=int, default=64)
    flags.add_argument("--systems", nargs="+", default=None, help="run only these systems (and push)")
    flags.add_argument("--no-loopback", action="store_true", help="skip the loopback runs")
    flags.add_argument("--no-wan", action="store_true", help="skip the emulated internet")
    flags.add_argument("--no-decode", action="store_true", help="skip decoding on the emulated internet")
    flags.add_argument("--no-ttft", action="store_true", help="skip time to first token and agreement")
    flags.add_argument("--section", default="decode", help=argparse.SUPPRESS)
    args = flags.parse_args()
    if args.client:
        run_client(args.client, args)
        return
    results: dict = {"model": "SmolLM2-135M-Instruct", "servers": 3, "prompts": len(PROMPTS)}
    results["new_tokens"] = args.new_tokens
    if not args.no_wan:
        results["wan"] = wan(args)
    if not args.no_loopback:
        results["loopback"] = loopback(args)
    report(__file__, results)


if __name__ == "__main__":
    main()
