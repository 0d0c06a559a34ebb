"""Aggregate throughput and per-token latency with many concurrent sessions, batched versus unbatched.

Starts a local 3-server SmolLM2 swarm twice: once with the servers' engines batching freely, once with
each engine limited to one sequence row per pass (`--max-batch-rows 1`). Against each, runs 1, 4, 16 and
32 concurrent sessions (asyncio tasks of one client), each generating 64 new tokens greedily from its own
prompt, and reports aggregate tokens/s and p50/p95 per-token latency (the time between a session's
consecutive tokens; the first token, which includes the prefill, is not counted). Prints JSON with the
ratios the issue sets targets for (at 16 sessions: >= 4x the unbatched throughput, >= 6x the
single-session throughput, p50 latency <= 4x the single-session latency).

    python -m bench.decode.throughput [--levels 1 4 16 32] [--new-tokens 64]
"""

from __future__ import annotations

import statistics

import torch

from bench.lib.env import parser
from bench.lib.prompts import topic_prompts
from bench.lib.stamp import report
from bench.lib.swarm import concurrent, smollm2_swarm
from bench.lib.timing import gaps, ms, percentile
from corolla.client.model import DistributedModelForCausalLM


def run_level(model: DistributedModelForCausalLM, inputs: list[list[int]], new_tokens: int) -> dict:
    """All sessions at once, as asyncio tasks on the client's event loop (as an HTTP front door runs them)."""
    sessions = concurrent(model, inputs, new_tokens)
    between = [gap for times in sessions.stamps for gap in gaps(times, skip=1)]
    return {
        "sessions": len(inputs),
        "aggregate_tokens_per_s": round(sum(len(t) for t in sessions.stamps) / sessions.elapsed, 2),
        "p50_token_latency_ms": ms(statistics.median(between)),
        "p95_token_latency_ms": ms(percentile(between, 95)),
        "wall_s": round(sessions.elapsed, 2),
    }


def run_swarm(server_args: list[str], levels: list[int], new_tokens: int) -> list[dict]:
    with smollm2_swarm(server_args=server_args) as (_, model):
        all_inputs = topic_prompts(model.tokenizer, max(levels))
        run_level(model, all_inputs[:2], 4)  # warm up connections
        return [run_level(model, all_inputs[:level], new_tokens) for level in levels]


def main() -> None:
    flags = parser(__doc__)
    flags.add_argument("--levels", type=int, nargs="+", default=[1, 4, 16, 32])
    flags.add_argument("--new-tokens", type=int, default=64)
    args = flags.parse_args()
    torch.set_num_threads(1)
    batched = run_swarm([], args.levels, args.new_tokens)
    unbatched = run_swarm(["--max-batch-rows", "1"], args.levels, args.new_tokens)
    by_level = {row["sessions"]: (row, base) for row, base in zip(batched, unbatched, strict=True)}
    single = by_level[min(by_level)][0]
    ratios = {
        level: {
            "throughput_vs_unbatched": round(
                row["aggregate_tokens_per_s"] / base["aggregate_tokens_per_s"], 2
            ),
            "throughput_vs_single_session": round(
                row["aggregate_tokens_per_s"] / single["aggregate_tokens_per_s"], 2
            ),
            "p50_latency_vs_single_session": round(
                row["p50_token_latency_ms"] / single["p50_token_latency_ms"], 2
            ),
        }
        for level, (row, base) in by_level.items()
    }
    result = {
        "model": "SmolLM2-135M-Instruct",
        "servers": 3,
        "new_tokens": args.new_tokens,
        "batched": batched,
        "unbatched": unbatched,
        "ratios": ratios,
    }
    if 16 in ratios:
        r = ratios[16]
        result["targets_at_16_sessions"] = {
            "throughput_vs_unbatched>=4": r["throughput_vs_unbatched"] >= 4,
            "throughput_vs_single_session>=6": r["throughput_vs_single_session"] >= 6,
            "p50_latency_vs_single_session<=4": r["p50_latency_vs_single_session"] <= 4,
        }
    report(__file__, result)


if __name__ == "__main__":
    main()
