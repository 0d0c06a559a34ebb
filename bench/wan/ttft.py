"""Time to first token of a long prompt, per wire encoding, and what each lossy encoding changes.

Used by bench/wan/speculative_wan.py: a 2,000-token prompt through the 3-server swarm, with the client's
`wire_encoding` lossless, float16 and blockwise8 (bench runs it with every host's upload capped), and the
greedy-token agreement of each lossy encoding with lossless over 64 tokens on the 8 benchmark prompts and
the long one (`matching_prefix`: tokens until the first difference; `same_position`: tokens equal at
their position).
"""

from __future__ import annotations

import statistics
import time

from bench.lib.prompts import COUNCIL, LIGHTHOUSE, SOURDOUGH, benchmark_prompts, chat_ids

ENCODINGS = ("lossless", "float16", "blockwise8")
LONG_PROMPT_TOKENS = 2000


def long_prompt(tokenizer) -> list[int]:
    """A chat prompt of exactly LONG_PROMPT_TOKENS tokens: a long report, then a request to summarise it."""
    text = " ".join([LIGHTHOUSE, SOURDOUGH, COUNCIL] * 20)
    ids = chat_ids(tokenizer, f"Here is a report.\n\n{text}", add_generation_prompt=False)
    tail = chat_ids(tokenizer, "Summarise the report in one sentence.")
    return ids[: LONG_PROMPT_TOKENS - len(tail)] + tail


def measure_ttft(models: dict, runs: int) -> dict:
    """models: encoding -> a model; the median time to first token of the long prompt, per encoding."""
    ids = long_prompt(next(iter(models.values())).tokenizer)
    times: dict[str, list[float]] = {name: [] for name in models}
    for round_ in range(runs + 1):  # round 0 warms up
        for name, model in models.items():
            started = time.perf_counter()
            next(model.generate_stream(ids, max_new_tokens=1))
            if round_:
                times[name].append(time.perf_counter() - started)
    lossless = statistics.median(times["lossless"])
    return {
        name: {
            "ttft_s": round(statistics.median(ts), 2),
            "vs_lossless": round(statistics.median(ts) / lossless, 2),
        }
        for name, ts in times.items()
    }


def measure_agreement(models: dict, new_tokens: int = 64) -> dict:
    """Greedy tokens of each lossy encoding against lossless over the benchmark prompts and the long one."""
    tokenizer = next(iter(models.values())).tokenizer
    prompts = [long_prompt(tokenizer), *(ids for _, ids in benchmark_prompts(tokenizer))]
    outputs = {
        name: [
            model.generate(ids, max_new_tokens=new_tokens, ignore_eos=True)[0, len(ids) :].tolist()
            for ids in prompts
        ]
        for name, model in models.items()
    }
    result = {}
    for name in models:
        if name == "lossless":
            continue
        prefix = same = 0
        for ours, theirs in zip(outputs[name], outputs["lossless"], strict=True):
            same += sum(a == b for a, b in zip(ours, theirs, strict=True))
            prefix += next(
                (i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b), len(ours)
            )
        total = new_tokens * len(prompts)
        result[name] = {"matching_prefix": f"{prefix}/{total}", "same_position": f"{same}/{total}"}
    return result
