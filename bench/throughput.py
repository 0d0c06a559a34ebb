"""Aggregate throughput and per-token latency with many concurrent sessions, batched versus unbatched.

Starts a local 3-server SmolLM2 swarm twice: once with the servers' engines batching freely, once with
each engine limited to one sequence row per pass (`--max-batch-rows 1`). Against each, runs 1, 4, 16 and
32 concurrent sessions (asyncio tasks of one client), each generating 64 new tokens greedily from its own
prompt, and reports aggregate tokens/s and p50/p95 per-token latency (the time between a session's
consecutive tokens; the first token, which includes the prefill, is not counted). Prints JSON with the
ratios the issue sets targets for (at 16 sessions: >= 4x the unbatched throughput, >= 6x the
single-session throughput, p50 latency <= 4x the single-session latency).

    python bench/throughput.py [--levels 1 4 16 32] [--new-tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from corolla.client.model import DistributedModelForCausalLM
from corolla.launch.local import LocalSwarm, even_spans
from stamp import report  # bench/stamp.py: stamped into bench/results/

TOPICS = [
    "the sea",
    "a mountain",
    "a city at night",
    "an old library",
    "a robot",
    "the moon",
    "a garden",
    "a train journey",
    "winter",
    "a lighthouse",
    "a market",
    "the desert",
    "a violin",
    "a storm",
    "a friendship",
    "a forest",
]


def prompts(model: DistributedModelForCausalLM, count: int) -> list[list[int]]:
    result = []
    for i in range(count):
        question = f"Write a few sentences about {TOPICS[i % len(TOPICS)]}" + "." * (1 + i // len(TOPICS))
        text = model.tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
        )
        result.append(model.tokenizer(text, add_special_tokens=False).input_ids)
    return result


def run_level(model: DistributedModelForCausalLM, inputs: list[list[int]], new_tokens: int) -> dict:
    """All sessions at once, as asyncio tasks on the client's event loop (as an HTTP front door runs them)."""
    stamps: list[list[float]] = [[] for _ in inputs]

    async def session(index: int) -> None:
        async for _ in model.agenerate(inputs[index], max_new_tokens=new_tokens, ignore_eos=True):
            stamps[index].append(time.perf_counter())

    async def all_sessions() -> float:
        started = time.perf_counter()
        await asyncio.gather(*(session(i) for i in range(len(inputs))))
        return time.perf_counter() - started

    elapsed = model.runtime.run(all_sessions())
    gaps = sorted(b - a for times in stamps for a, b in zip(times[1:], times[2:], strict=False))
    return {
        "sessions": len(inputs),
        "aggregate_tokens_per_s": round(sum(len(t) for t in stamps) / elapsed, 2),
        "p50_token_latency_ms": round(1000 * statistics.median(gaps), 1),
        "p95_token_latency_ms": round(1000 * gaps[int(0.95 * (len(gaps) - 1))], 1),
        "wall_s": round(elapsed, 2),
    }


def run_swarm(server_args: list[str], levels: list[int], new_tokens: int) -> list[dict]:
    with (
        LocalSwarm("smollm2", even_spans(30, 3), num_threads=1, server_args=server_args) as swarm,
        DistributedModelForCausalLM.from_pretrained("smollm2", config=swarm.client_config()) as model,
    ):
        all_inputs = prompts(model, max(levels))
        run_level(model, all_inputs[:2], 4)  # warm up connections
        return [run_level(model, all_inputs[:level], new_tokens) for level in levels]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 4, 16, 32])
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
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
