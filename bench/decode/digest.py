"""The cost of a step's digest (wire/digest.py) on the decode path, for SmolLM2's hidden size.

Every decode step is digested once by the client per hop (to check the reply) and once by each server
(to recognise the pushed copy's twin): blake2b over the hidden states [B, 1, 576] as they travel (float32,
lossless). Prints the median time per digest for batch sizes 1..16, next to the serialization of the same
tensor (which every step pays anyway): a table on stderr, the JSON on stdout.

    python -m bench.decode.digest [--hidden 576] [--repeats 2000]
"""

from __future__ import annotations

import statistics
import sys

import torch

from bench.lib.env import parser
from bench.lib.stamp import report
from bench.lib.timing import durations
from corolla.wire import tensors as wire_tensors
from corolla.wire.digest import step_digest


def median_us(work, repeats: int) -> float:
    return round(statistics.median(durations(work, repeats)) * 1e6, 1)


def main() -> None:
    flags = parser(__doc__)
    flags.add_argument("--hidden", type=int, default=576)
    flags.add_argument("--repeats", type=int, default=2000)
    args = flags.parse_args()
    print(f"{'batch':>5} {'bytes':>7} {'digest µs':>10} {'serialize µs':>13}", file=sys.stderr)
    rows = []
    for batch in (1, 2, 4, 8, 16):
        hidden = torch.randn(batch, 1, args.hidden)
        tensors = [wire_tensors.serialize(hidden)]
        digest = median_us(lambda tensors=tensors: step_digest(tensors), args.repeats)
        serialize = median_us(lambda hidden=hidden: wire_tensors.serialize(hidden), args.repeats)
        size = len(tensors[0].buffer)
        print(f"{batch:>5} {size:>7} {digest:>10.1f} {serialize:>13.1f}", file=sys.stderr)
        rows.append({"batch": batch, "bytes": size, "digest_us": digest, "serialize_us": serialize})
    report(__file__, {"hidden": args.hidden, "repeats": args.repeats, "batches": rows})


if __name__ == "__main__":
    main()
