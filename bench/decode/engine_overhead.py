"""The engine's own cost per pass, next to the model's: scheduling, packing and Python bookkeeping.

Runs the engine in this process on SmolLM2 blocks 0:10 (one torch thread) with 1, 4, 16 and 32 sessions
decoding one token each per pass, and times each pass split into: the model forward over the packed
batch (paged attention included), the engine's bookkeeping around it (schedule, block allocation,
packing, postprocessing), and, for reference, the same batch through the blocks with a plain contiguous
cache. Prints JSON.

    python -m bench.decode.engine_overhead [--passes 30]
"""

from __future__ import annotations

import statistics
import time

import torch

from bench.lib.env import parser
from bench.lib.stamp import report
from corolla.config import EngineConfig
from corolla.engine.engine import Engine
from corolla.engine.sequence import StepWork
from corolla.models.contiguous import ContiguousCache
from corolla.models.source import resolve_model
from corolla.models.span import Span

PROMPT = 120  # tokens already in each session's cache


def engine_passes(span: Span, rows: int, passes: int) -> tuple[list[float], list[float]]:
    engine = Engine(span, EngineConfig(max_cache_tokens=65536, page_size=16, max_batch_tokens=4096))
    sessions = [engine.open_session(f"s{i}", (span.start, span.end), 1, 4096) for i in range(rows)]
    for session in sessions:
        engine.add_step(StepWork(session, torch.randn(1, PROMPT, span.config.hidden_size), 0))
    while engine.has_work():
        engine.step()
    forward_times: list[float] = []
    real_run = engine.runner.run

    def timed_run(chunks):
        started = time.perf_counter()
        outputs = real_run(chunks)
        forward_times.append(time.perf_counter() - started)
        return outputs

    engine.runner.run = timed_run
    totals = []
    for _ in range(passes + 3):
        for session in sessions:
            engine.add_step(StepWork(session, torch.randn(1, 1, span.config.hidden_size), session.position))
        started = time.perf_counter()
        engine.step()
        totals.append(time.perf_counter() - started)
    return totals[3:], forward_times[3:]


def contiguous_passes(span: Span, rows: int, passes: int) -> list[float]:
    config = span.config
    cache = ContiguousCache.for_span(span, rows, PROMPT + passes + 8)
    times = []
    with torch.inference_mode():
        span(torch.randn(rows, PROMPT, config.hidden_size), cache)
        cache.position = PROMPT
        for _ in range(passes + 3):
            started = time.perf_counter()
            span(torch.randn(rows, 1, config.hidden_size), cache, position=cache.position)
            times.append(time.perf_counter() - started)
            cache.position += 1
    return times[3:]


def main() -> None:
    flags = parser(__doc__)
    flags.add_argument("--passes", type=int, default=30)
    args = flags.parse_args()
    torch.set_num_threads(1)
    span = Span.load(resolve_model("smollm2").path, 0, 10)
    results = []
    for rows in (1, 4, 16, 32):
        totals, forwards = engine_passes(span, rows, args.passes)
        plain = contiguous_passes(span, rows, args.passes)
        total, forward = statistics.median(totals), statistics.median(forwards)
        results.append(
            {
                "rows": rows,
                "pass_ms": round(1000 * total, 2),
                "model_forward_ms": round(1000 * forward, 2),
                "engine_bookkeeping_ms": round(1000 * (total - forward), 2),
                "bookkeeping_fraction": round((total - forward) / total, 3),
                "contiguous_cache_forward_ms": round(1000 * statistics.median(plain), 2),
                "paged_vs_contiguous": round(forward / statistics.median(plain), 3),
            }
        )
    report(
        __file__,
        {
            "model": "SmolLM2-135M-Instruct",
            "blocks": "0:10",
            "torch_threads": 1,
            "context_tokens": PROMPT,
            "passes": results,
        },
    )


if __name__ == "__main__":
    main()
