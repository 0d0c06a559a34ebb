"""How long a server's pass over one block takes: `fixed + per_token x tokens` (tokens in the pass: one
per session decoding in its batch).

A class gives these seconds itself, or the hardware's published memory bandwidth and tensor throughput:
then the pass is priced from the roofline (reading the block's weights once; two operations per parameter
and token) and scaled by how close corolla's engine came to each part on this machine's CPU for a block of
Llama 3 70B's shapes (bench/swarm/sim_calibrate.py wrote sim/calibration.json: a lone decode row's pass read
the weights at 63% of the measured bandwidth, prefill passes ran at 94% of the matmul throughput). The
assumption: a GPU's engine is as close to its roofline as the CPU's; the sum (not the larger) of the two
parts makes big batches a little dearer than a roofline says.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

from corolla.sim.scenario import ServerClass

CALIBRATION = Path(__file__).parent / "calibration.json"


@dataclass(frozen=True)
class PassCost:
    fixed: float  # seconds of a pass over one block, whatever its batch
    per_token: float  # seconds each token of the pass adds

    def seconds(self, tokens: int) -> float:
        return self.fixed + self.per_token * tokens


@functools.cache
def calibration() -> dict:
    return json.loads(CALIBRATION.read_text())


def pass_cost(kind: ServerClass) -> PassCost:
    if kind.seconds_per_block is not None:
        return PassCost(kind.seconds_per_block, kind.seconds_per_token)
    found = calibration()
    params = found["block"]["params"]
    weights = params * kind.bytes_per_param
    fixed = weights / (kind.memory_gbps * 1e9) / found["memory_efficiency"]
    per_token = 2 * params / (kind.tflops * 1e12) / found["compute_efficiency"]
    return PassCost(fixed, per_token)


def cache_tokens(kind: ServerClass, blocks: int, kv_bytes_per_token: int) -> int | None:
    """Tokens of attention cache a server of `kind` holds for its `blocks` (None: no limit)."""
    if kind.cache_gib is None:
        return None
    return int(kind.cache_gib * 2**30 // (kv_bytes_per_token * blocks))
