"""How fast this machine runs a block: measured at start, cached for an hour per machine and model shape.

The figure announced on the DHT as `throughput` (placement weighs it; once the server has served, clients
route by the pace of its own passes: server/hosting/pace.py) is blocks per second for one decode step of one
sequence (with a 128-token context), measured through the engine itself (its scheduler, paged cache and
packed pass), so it is the cost the server will really have; with it, how much slower a step of BATCH_ROWS
sequences is per sequence (`batch_growth`: clients price the sessions already on a server with it; corolla
sim found a constant guess of 25% per session, a CPU's, sent a flash crowd's sessions from H100s that
batch almost for free onto home GPUs). Clients use them to estimate a chain's step time before they have
timed the server themselves, and servers use it to weigh the swarm's coverage when they choose blocks.
Measuring takes a second or two, so the result is cached in the corolla cache folder, keyed by everything
that changes it, for MAX_AGE: a figure taken on a busy machine (servers starting at once) does not stand
forever. Servers starting together on one machine measure one at a time (a file lock beside the cache): the
first measures a shape and the others read its figure, instead of each measuring it while the others do.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import statistics
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from filelock import FileLock, Timeout

from corolla.config import EngineConfig
from corolla.engine.engine import Engine
from corolla.engine.sequence import StepWork
from corolla.engine.states import state_pages
from corolla.models.devices import device_info
from corolla.models.source import cache_dir
from corolla.models.span import Span
from corolla.utils import cpu_name

logger = logging.getLogger(__name__)

CONTEXT = 128
STEPS = 16
BATCH_ROWS = 8  # the batch whose step is timed against one sequence's
MAX_AGE = 3600.0  # seconds a cached measurement stands for
LOCK_WAIT = 120.0  # seconds a server waits for another's measurement before measuring beside it


@dataclass(frozen=True)
class Speed:
    blocks_per_s: float  # blocks per second for one decode step of one sequence
    batch_growth: float  # how much slower a decode step is per more sequence in the batch


def measure_speed(span: Span, use_cache: bool = True) -> Speed:
    """This machine's speed for this model's blocks: one sequence's decode steps, and how they slow as
    the batch grows (a step of BATCH_ROWS sequences against one's)."""
    key = _cache_key(span)
    path = cache_dir() / "throughput.json"
    with _one_at_a_time(path):
        cached = _read(path)  # no other server writes it while this one holds the lock
        entry = cached.get(key)
        if use_cache and entry is not None and time.time() - entry["measured_at"] < MAX_AGE:
            return Speed(float(entry["blocks_per_s"]), float(entry["batch_growth"]))
        one = _step_seconds(span, 1)
        batch = _step_seconds(span, BATCH_ROWS)
        speed = Speed((span.end - span.start) / one, max(batch / one - 1, 0.0) / (BATCH_ROWS - 1))
        cached[key] = {**asdict(speed), "measured_at": time.time()}
        try:
            path.write_text(json.dumps(cached, indent=1))
        except OSError:
            logger.warning("Could not cache the throughput measurement in %s", path)
    logger.info(
        "Measured %.1f blocks/s for one decode step, %.1f%% slower per more session in a batch "
        "(cached in %s)",
        speed.blocks_per_s,
        100 * speed.batch_growth,
        path,
    )
    return speed


@contextlib.contextmanager
def _one_at_a_time(path: Path) -> Iterator[None]:
    """Held while this process reads, measures and writes the cache at `path`: other servers on this
    machine wait (LOCK_WAIT at most: then, or where the cache's folder is not writable, it measures too)."""
    lock: FileLock | None = FileLock(path.with_suffix(".lock"), timeout=LOCK_WAIT)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock.acquire()
    except (OSError, Timeout):
        lock = None
        logger.warning("Measuring without waiting for other servers' measurements (%s)", path.parent)
    try:
        yield
    finally:
        if lock is not None:
            lock.release()


def measure_throughput(span: Span, use_cache: bool = True) -> float:
    """Blocks per second for one decode step of one sequence, on this machine, for this model's blocks."""
    return measure_speed(span, use_cache).blocks_per_s


def _step_seconds(span: Span, rows: int) -> float:
    """The median seconds of a decode step of `rows` sequences with CONTEXT tokens each, through the
    engine, after the prefill and warm-up. The median, like the pace of a server's passes
    (server/hosting/pace.py) and a client's timing of its steps, so that the three compare: the fastest step
    (tried in stop 47) made servers that had not served look 2-3x faster on a loaded machine than those
    clients had timed, and clients gave up reusing a prefix held on the timed ones. (Servers starting together
    on one machine measure a slow median: there, routing prefers servers that have served.) The cache holds
    every row at once, recurrent states included (a row short of pages would wait for them for ever)."""
    page = EngineConfig.page_size
    cache = rows * (CONTEXT + STEPS + page + state_pages(span, page) * page)
    config = EngineConfig(max_cache_tokens=cache, max_batch_tokens=CONTEXT * rows, max_batch_wait_ms=0)
    engine = Engine(span, config)
    sessions = [
        engine.open_session(f"speed{i}", (span.start, span.end), 1, CONTEXT + STEPS) for i in range(rows)
    ]
    times = []
    for step in range(STEPS + 1):
        length = CONTEXT if step == 0 else 1
        for session in sessions:
            hidden = span.config.wire.sample(1, length).to(span.dtype)
            engine.add_step(StepWork(session, hidden, session.position))
        started = time.perf_counter()
        while engine.has_work():
            engine.step()
        times.append(time.perf_counter() - started)
    for i in range(rows):
        engine.close_session(f"speed{i}")
    return statistics.median(times[3:])


def _cache_key(span: Span) -> str:
    config = span.config
    shape = (
        "engine",  # measured through the engine (earlier versions timed a block on its own)
        config.fingerprint(),  # the blocks' architecture and shapes
        str(span.dtype),
        span.precision,
        torch.get_num_threads(),
        str(span.device),
        device_info(span.device).name,
        torch.__version__,
        cpu_name(),
    )
    return hashlib.sha256(repr(shape).encode()).hexdigest()[:16]


def _read(path: Path) -> dict:
    """The cache's entries that are well-formed (anything else is measured again and overwritten)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}

    def valid(entry: object) -> bool:
        return isinstance(entry, dict) and all(
            isinstance(entry.get(k), (int, float)) and entry[k] >= 0
            for k in ("blocks_per_s", "batch_growth", "measured_at")
        )

    return {key: entry for key, entry in data.items() if valid(entry)}
