"""Many sessions across an emulated internet: aggregate tokens/s of 1 and of N concurrent sessions, and
where the CPU goes.

The swarm of bench/lib/wan.py (DHT, 3 SmolLM2 servers and the client in 5 network namespaces, 50 ms round
trips by default); the client runs 1, then N sessions at once (threads of one client, as `corolla api`
serves concurrent users), each generating the same number of tokens with push. Reports aggregate decode
tokens/s, its ratio to N x the single session's, per-token latency percentiles, the servers' mean rows per
engine pass, and the CPU seconds each part of the machine used meanwhile: the servers (with their
libp2p daemons), the client, the DHT and the emulator's packet delayers (one Python process per host,
handling every packet), against the 2 cores' wall time. The same client on loopback shows the swarm
without the emulator.

    python -m bench.wan.sessions_wan [--delay-ms 25] [--sessions 8] [--new-tokens 48] [--runs 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
from pathlib import Path

from bench.lib.env import parser, wan_flags
from bench.lib.prompts import chat_ids
from bench.lib.stamp import report
from bench.lib.swarm import engine_counters
from bench.lib.timing import gaps, ms, percentile
from bench.lib.wan import SPANS, WanSwarm, address
from corolla.launch.local import client_config

DELAYERS = Path("/run/wan-netsim/delayer.pids")
PROMPT = "Tell me about the sea."


def cpu_seconds(pids: list[int], without: tuple[int, ...] = ()) -> float:
    """CPU time (user + system) of these processes and all their descendants, except the trees of
    `without` (a loopback client is the parent of the servers it started)."""
    import psutil

    excluded = set(without)
    for other in without:
        try:
            excluded |= {child.pid for child in psutil.Process(other).children(recursive=True)}
        except psutil.NoSuchProcess:
            pass
    total = 0.0
    for pid in pids:
        try:
            process = psutil.Process(pid)
            family = [process, *process.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
        family = [member for member in family if member.pid not in excluded]
        for member in family:
            try:
                times = member.cpu_times()
                total += times.user + times.system
            except psutil.NoSuchProcess:
                pass
    return total


def run_sessions(model, ids: list[int], count: int, new_tokens: int) -> tuple[float, list[float]]:
    """`count` sessions at once; (aggregate decode tokens/s, every per-token gap)."""
    barrier = threading.Barrier(count)
    stamps: list[list[float]] = [[] for _ in range(count)]

    def one(i: int) -> None:
        barrier.wait()
        for _ in model.generate_stream(ids, max_new_tokens=new_tokens, ignore_eos=True):
            stamps[i].append(time.perf_counter())

    threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    start, end = min(s[0] for s in stamps), max(s[-1] for s in stamps)
    return sum(len(s) - 1 for s in stamps) / (end - start), [gap for s in stamps for gap in gaps(s)]


def measure(config, counts: list[int], new_tokens: int, runs: int, groups: dict[str, list[int]]) -> dict:
    import torch

    from corolla.client.model import DistributedModelForCausalLM

    torch.set_num_threads(1)
    others = tuple(pid for pids in groups.values() for pid in pids)
    groups = {**groups, "client": [os.getpid()]}
    with DistributedModelForCausalLM.from_pretrained("smollm2", config=config) as model:
        ids = chat_ids(model.tokenizer, PROMPT)
        run_sessions(model, ids, max(counts), 8)  # warm-up: connections, caches
        results = {}
        for count in counts:
            rates, between, cpu, wall = [], [], dict.fromkeys(groups, 0.0), 0.0
            passes = engine_counters(model)
            head = (model.head_batcher.num_batches, model.head_batcher.num_requests)
            for _ in range(runs):
                before = {
                    name: cpu_seconds(pids, others if name == "client" else ())
                    for name, pids in groups.items()
                }
                started = time.perf_counter()
                rate, run_gaps = run_sessions(model, ids, count, new_tokens)
                wall += time.perf_counter() - started
                for name, pids in groups.items():
                    cpu[name] += cpu_seconds(pids, others if name == "client" else ()) - before[name]
                rates.append(rate)
                between += run_gaps
            rows, num = (a - b for a, b in zip(engine_counters(model), passes, strict=True))
            results[str(count)] = {
                "tokens_per_s": round(statistics.median(rates), 2),
                "token_latency_p50_ms": ms(percentile(between, 50)),
                "token_latency_p90_ms": ms(percentile(between, 90)),
                "rows_per_pass": round(rows / max(num, 1), 2),
                "sessions_per_head_batch": round(
                    (model.head_batcher.num_requests - head[1])
                    / max(model.head_batcher.num_batches - head[0], 1),
                    2,
                ),
                "cpu_share_of_2_cores": {
                    name: round(seconds / (2 * wall), 3) for name, seconds in cpu.items()
                },
            }
    single = results[str(counts[0])]["tokens_per_s"]
    for count in counts[1:]:
        entry = results[str(count)]
        entry["vs_single_times_sessions"] = round(entry["tokens_per_s"] / (count * single), 2)
    return results


def main() -> None:
    flags = parser(__doc__, wan_flags())
    flags.add_argument("--sessions", type=int, default=8)
    flags.add_argument("--new-tokens", type=int, default=48)
    flags.add_argument("--runs", type=int, default=2)
    flags.add_argument("--no-loopback", action="store_true")
    flags.add_argument(
        "--server-args", default="", help="extra options for every server, e.g. '--max-batch-wait-ms 0'"
    )
    flags.add_argument("--groups", default="{}", help=argparse.SUPPRESS)
    args = flags.parse_args()
    counts = [1, args.sessions]
    if args.client:
        config = client_config(address(4), args.client, request_timeout=120)
        print(json.dumps(measure(config, counts, args.new_tokens, args.runs, json.loads(args.groups))))
        return
    results: dict = {"model": "SmolLM2-135M-Instruct", "servers": 3, "new_tokens": args.new_tokens}
    with WanSwarm(args.delay_ms, server_args=tuple(args.server_args.split())) as swarm:
        groups = {
            "servers": [p.popen.pid for p in swarm.peers[1:]],
            "dht": [swarm.peers[0].popen.pid],
            "emulator": [int(line.split()[0]) for line in DELAYERS.read_text().splitlines()],
        }
        client_args = ["--sessions", str(args.sessions), "--new-tokens", str(args.new_tokens)]
        client_args += ["--runs", str(args.runs), "--groups", json.dumps(groups)]
        results["wan"] = {"round_trip_ms": 2 * args.delay_ms, **swarm.run_client(__spec__.name, client_args)}
    if not args.no_loopback:
        from corolla.launch.local import LocalSwarm
        from corolla.models.source import resolve_model

        path = resolve_model("smollm2").path
        server_args = ["--num-threads", "1", *args.server_args.split()]
        with LocalSwarm(str(path), SPANS, server_args=server_args) as local:
            groups = {"servers": [s.popen.pid for s in local.servers], "dht": [local.dht.popen.pid]}
            config = local.client_config(request_timeout=120)
            results["loopback"] = measure(config, counts, args.new_tokens, args.runs, groups)
    report(__file__, results)


if __name__ == "__main__":
    main()
