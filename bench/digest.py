"""The cost of a step's digest (wire/digest.py) on the decode path, for SmolLM2's hidden size.

Every decode step is digested once by the client per hop (to check the reply) and once by each server
(to recognise the pushed copy's twin): blake2b over the hidden states [B, 1, 576] as they travel (float32,
lossless). Prints the median time per digest for batch sizes 1..16, next to the serialization of the same
tensor (which every step pays anyway).

    python bench/digest.py [--hidden 576] [--repeats 2000]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from corolla.wire import tensors as wire_tensors
from corolla.wire.digest import step_digest


def median_us(work, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        work()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--repeats", type=int, default=2000)
    args = parser.parse_args()
    print(f"{'batch':>5} {'bytes':>7} {'digest µs':>10} {'serialize µs':>13}")
    for batch in (1, 2, 4, 8, 16):
        hidden = torch.randn(batch, 1, args.hidden)
        tensors = [wire_tensors.serialize(hidden)]
        digest = median_us(lambda tensors=tensors: step_digest(tensors), args.repeats)
        serialize = median_us(lambda hidden=hidden: wire_tensors.serialize(hidden), args.repeats)
        print(f"{batch:>5} {len(tensors[0].buffer):>7} {digest:>10.1f} {serialize:>13.1f}")


if __name__ == "__main__":
    main()
