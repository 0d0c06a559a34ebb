"""Calibrates the swarm simulator's compute cost: one engine pass over one Llama-3-70B-shaped block.

Saves a random-weight, one-block Llama model with Llama 3 70B's block shapes (hidden 8192, MLP 28672, 64
query and 8 key/value heads of 128) to a temporary folder, loads it as a corolla Span (float32 on the CPU,
as a CPU server runs it) and times whole `Engine.step()` calls: decode passes of 1-32 sessions decoding
one token each over 128 tokens of context, and prefill passes of one session with a 32-256 token chunk
(the median of several passes per point, taken in rounds over all points after a warm-up round). Fits
`seconds = fixed_s + per_token_s * tokens` (tokens in the pass) by least squares, measures this CPU's
roofline (memory read bandwidth, float32 matmul throughput) and how close the pass comes to it (a lone
decode row's pass against reading the weights; the prefill passes' seconds per token against the matmul
throughput): the simulator (sim/compute.py) prices GPU classes from their published bandwidth and TFLOPS
with these efficiencies. Prints JSON (kept, stamped, in bench/results/); `--write` also writes
src/corolla/sim/calibration.json. Takes
about 3 minutes and 6 GB of memory; other load on the cores skews it (it says how much there was).

    python -m bench.swarm.sim_calibrate [--write] [--passes 7]
"""

from __future__ import annotations

import datetime
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from bench.lib.checkpoints import save_random
from bench.lib.env import ROOT, parser
from bench.lib.stamp import report
from bench.lib.timing import durations
from corolla.config import EngineConfig
from corolla.engine.engine import Engine
from corolla.engine.sequence import StepWork
from corolla.models.span import Span

OUTPUT = ROOT / "src" / "corolla" / "sim" / "calibration.json"
SHAPE = {
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 128,
}
CONTEXT = 128  # tokens already in each decoding session's cache
DECODE_ROWS = (1, 2, 4, 8, 16, 32)
PREFILL_CHUNKS = (32, 64, 128, 256)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def save_block(folder: str) -> None:
    """A one-block Llama with Llama 3 70B's block shapes and random bfloat16 weights (the vocabulary is
    small: it does not touch the block)."""
    from transformers import LlamaConfig

    config = LlamaConfig(
        **SHAPE,
        num_hidden_layers=1,
        vocab_size=1024,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        eos_token_id=None,
        bos_token_id=None,
    )
    save_random(config, folder)


@dataclass
class Point:
    """One measured point: a pass of `tokens` tokens, queued by `add_work` on `engine`."""

    kind: str  # "decode" | "prefill"
    tokens: int
    engine: Engine
    add_work: Callable[[], None]
    times: list[float] = field(default_factory=list)


def new_engine(span: Span) -> Engine:
    config = EngineConfig(max_cache_tokens=8192, page_size=16, max_batch_tokens=512, max_batch_rows=64)
    return Engine(span, config)


def decode_points(span: Span) -> list[Point]:
    """Passes of R sessions decoding one token each at position CONTEXT (rolled back there every pass, so
    the context stays CONTEXT tokens); the sessions' contexts are prefilled here."""
    engine = new_engine(span)
    hidden = span.config.hidden_size
    blocks = (span.start, span.end)
    sessions = [engine.open_session(f"d{i}", blocks, 1, 4096) for i in range(max(DECODE_ROWS))]
    for session in sessions:
        engine.add_step(StepWork(session, torch.randn(1, CONTEXT, hidden), 0))
    while engine.has_work():
        engine.step()

    def decode(rows: int) -> Callable[[], None]:
        def add_work() -> None:
            for session in sessions[:rows]:
                engine.add_step(StepWork(session, torch.randn(1, 1, hidden), CONTEXT))

        return add_work

    return [Point("decode", rows, engine, decode(rows)) for rows in DECODE_ROWS]


def prefill_points(span: Span) -> list[Point]:
    """Passes of one session prefilling a chunk from position 0 (rolled back to 0 every pass)."""
    engine = new_engine(span)
    hidden = span.config.hidden_size
    session = engine.open_session("p", (span.start, span.end), 1, 4096)

    def prefill(chunk: int) -> Callable[[], None]:
        return lambda: engine.add_step(StepWork(session, torch.randn(1, chunk, hidden), 0))

    return [Point("prefill", chunk, engine, prefill(chunk)) for chunk in PREFILL_CHUNKS]


def run_rounds(points: list[Point], rounds: int) -> None:
    """Times `Engine.step()` for every point once per round: rounds rather than one point after another,
    so that a burst of other load on the cores lands on one pass of each point, not on all of one's."""
    for number in range(rounds):
        for point in points:
            point.add_work()
            started = time.perf_counter()
            point.engine.step()
            point.times.append(time.perf_counter() - started)
            assert not point.engine.has_work(), "a pass left work queued: raise max_batch_tokens"
        log(f"round {number + 1}/{rounds}: {sum(p.times[-1] for p in points):.1f} s")


def medians(points: list[Point], warmup: int) -> list[dict]:
    """Each point's median pass, less the first `warmup` rounds."""
    found = []
    for point in points:
        seconds = statistics.median(point.times[warmup:])
        spread = (max(point.times[warmup:]) - min(point.times[warmup:])) / seconds
        log(f"{point.kind:7} {point.tokens:3d} tokens: {1000 * seconds:8.1f} ms (spread {spread:.0%})")
        found.append({"kind": point.kind, "tokens": point.tokens, "seconds": seconds})
    return found


def fit(points: list[dict]) -> tuple[float, float]:
    """Least squares `seconds = fixed + per_token * tokens` over all points; adds each point's relative
    residual (fit minus measured, over measured) as `fit_error`."""
    tokens = np.array([p["tokens"] for p in points], dtype=float)
    seconds = np.array([p["seconds"] for p in points])
    per_token, fixed = np.polyfit(tokens, seconds, 1)
    for point in points:
        predicted = fixed + per_token * point["tokens"]
        point["fit_error"] = round((predicted - point["seconds"]) / point["seconds"], 4)
        point["seconds"] = round(point["seconds"], 6)
    return float(fixed), float(per_token)


def memory_gbps(repeats: int = 5) -> float:
    """Read bandwidth: the median time to sum a 2 GiB float32 tensor (a decode pass reads its weights)."""
    data = torch.empty(2**29).normal_()
    seconds = statistics.median(durations(data.sum, repeats, warmup=1))
    return data.numel() * data.element_size() / seconds / 1e9


def matmul_tflops(size: int = 4096, repeats: int = 5) -> float:
    """Float32 throughput: the median time of a size x size matmul."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    seconds = statistics.median(durations(lambda: torch.matmul(a, b), repeats, warmup=1))
    return 2 * size**3 / seconds / 1e12


def roofline() -> tuple[float, float]:
    """Memory GB/s and matmul TFLOPS now; measured before and after the passes, so that one burst of other
    load (a busy core halves a two-thread measurement; on this VM the bandwidth also swung between about
    30 and 60 GB/s from minute to minute) does not decide them alone."""
    gbps, tflops = memory_gbps(), matmul_tflops()
    log(f"memory {gbps:.1f} GB/s, matmul {tflops:.3f} TFLOPS")
    return gbps, tflops


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def block_info(span: Span) -> tuple[dict, int]:
    """The block's description for the calibration, and its weights' bytes as loaded (float32)."""
    params = sum(p.numel() for p in span.parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in span.parameters())
    kv_heads, head_dim = SHAPE["num_key_value_heads"], SHAPE["head_dim"]
    block = {
        "shape": "Llama-3-70B",
        "hidden_size": SHAPE["hidden_size"],
        "intermediate_size": SHAPE["intermediate_size"],
        "heads": SHAPE["num_attention_heads"],
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "params": params,
        "kv_bytes_per_token_bf16": 2 * kv_heads * head_dim * 2,
    }
    return block, weight_bytes


def measure_passes(passes: int, warmup: int) -> tuple[dict, int, list[dict]]:
    folder = tempfile.mkdtemp(prefix="sim_calibrate_")
    try:
        log(f"saving a random one-block model to {folder}")
        save_block(folder)
        span = Span.load(folder, 0, 1)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    block, weight_bytes = block_info(span)
    with torch.inference_mode():
        points = decode_points(span) + prefill_points(span)
        before = cpu_seconds()
        run_rounds(points, warmup + passes)
        after = cpu_seconds()
        others = (after[0] - before[0]) - (after[1] - before[1])
    share = others / (sum(sum(p.times) for p in points) * torch.get_num_threads())
    log(f"{'warning: ' if share > 0.05 else ''}other processes took {share:.0%} of the cores meanwhile")
    return block, weight_bytes, medians(points, warmup)


def cpu_seconds() -> tuple[float, float]:
    """CPU seconds every process used since boot (busy time in /proc/stat), and those this one used."""
    ticks = [int(value) for value in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    busy = sum(ticks[i] for i in (0, 1, 2, 5, 6))  # user, nice, system, irq, softirq
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return busy / os.sysconf("SC_CLK_TCK"), usage.ru_utime + usage.ru_stime


def warn_if_busy() -> None:
    """Other processes on the cores skew every timing: say so before starting."""
    load = float(Path("/proc/loadavg").read_text().split()[0])
    if load > 0.5:
        log(f"warning: load average {load:.2f} before starting; timings are skewed if others run meanwhile")


def calibrate(passes: int, warmup: int) -> dict:
    threads = torch.get_num_threads()
    log(f"torch threads: {threads}")
    warn_if_busy()
    before = roofline()
    block, weight_bytes, points = measure_passes(passes, warmup)
    fixed, per_token = fit(points)
    after = roofline()
    # interference (other processes, the host's other tenants) only ever slows a measurement: the better
    gbps, tflops = (max(pair) for pair in zip(before, after, strict=True))
    one_row, slope = roofline_parts(points)
    log(f"1-row decode pass: {weight_bytes / one_row / 1e9:.1f} GB/s of weights read")
    return {
        "what": (
            "Median seconds of corolla's Engine.step() over one random-weight Llama-3-70B-shaped block "
            f"(float32, CPU, {threads} torch threads): decode passes of 1-32 sessions at {CONTEXT} tokens "
            "of context and one-session prefill chunks of 32-256 tokens, fit by least squares to "
            "fixed_s + per_token_s * tokens; memory_gbps: summing a 2 GiB float32 tensor, matmul_tflops: "
            "a float32 4096x4096 matmul, each the better of runs before and after "
            "(bench/swarm/sim_calibrate.py)."
        ),
        "measured_on": f"{datetime.date.today().isoformat()}, {cpu_model()}, {threads} torch threads",
        "block": block,
        "passes": points,
        "fixed_s": round(fixed, 6),
        "per_token_s": round(per_token, 7),
        "cpu": {"memory_gbps": round(gbps, 2), "matmul_tflops": round(tflops, 4)},
        "memory_efficiency": round(weight_bytes / (gbps * 1e9) / one_row, 4),
        "compute_efficiency": round(2 * block["params"] / (tflops * 1e12) / slope, 4),
    }


def roofline_parts(points: list[dict]) -> tuple[float, float]:
    """The pass's two roofline parts, for scaling to other hardware: a lone decode row's pass (reading the
    weights once, little compute) and the seconds per token of the prefill passes (compute-bound). The
    least-squares line over all passes prices this CPU's own passes, but its intercept is no weight read:
    on this CPU 2-4 decode rows cost about one lone row's pass each (float32 GEMV, then GEMM), which a GPU
    does not do."""
    one_row = next(p["seconds"] for p in points if p["kind"] == "decode" and p["tokens"] == 1)
    prefill = [p for p in points if p["kind"] == "prefill"]
    slope, _ = np.polyfit([p["tokens"] for p in prefill], [p["seconds"] for p in prefill], 1)
    return one_row, float(slope)


def main() -> None:
    flags = parser(__doc__)
    flags.add_argument("--write", action="store_true", help=f"also write {OUTPUT.name}")
    flags.add_argument("--passes", type=int, default=7, help="timed passes per point (default 7)")
    flags.add_argument("--warmup", type=int, default=1, help="untimed passes per point (default 1)")
    args = flags.parse_args()
    started = time.perf_counter()
    result = calibrate(args.passes, args.warmup)
    report(__file__, result)
    if args.write:
        OUTPUT.write_text(json.dumps(result, indent=2) + "\n")
        log(f"wrote {OUTPUT}")
    log(f"took {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
