"""Which blocks a server should host, and when moving would help the swarm.

Coverage of a block is the total throughput of the servers hosting it (a count when throughputs are
unknown). A new server takes the window that leaves the swarm's coverage best, compared weakest block
first: it fills holes, then thickens the thinnest part. A running server moves only when that would
raise the swarm's weakest coverage by a clear margin, so servers do not chase each other.
"""

from __future__ import annotations

from collections.abc import Iterable

from corolla.models.config import ModelConfig

Placed = tuple[int, int, float]  # (start, end, throughput) of a server

MOVE_MARGIN = 0.2  # a move must raise the weakest coverage by 20% (or fill a hole)


def coverage(spans: Iterable[Placed], total: int) -> list[float]:
    """The total throughput hosting each block."""
    counts = [0.0] * total
    for start, end, weight in spans:
        for index in range(max(start, 0), min(end, total)):
            counts[index] += weight
    return counts


def _with(base: list[float], start: int, num_blocks: int, weight: float) -> list[float]:
    return [c + weight if start <= i < start + num_blocks else c for i, c in enumerate(base)]


def choose_blocks(
    others: Iterable[Placed], num_blocks: int, total: int, weight: float = 1.0
) -> tuple[int, int]:
    """The window of `num_blocks` blocks that leaves the swarm's coverage best (weakest blocks first)."""
    base = coverage(others, total)
    best = max(
        range(total - num_blocks + 1),
        key=lambda start: (sorted(_with(base, start, num_blocks, weight)), -start),
    )
    return best, best + num_blocks


def better_blocks(
    others: Iterable[Placed], current: tuple[int, int], total: int, weight: float
) -> tuple[int, int] | None:
    """Where this server should move, if moving raises the weakest coverage by a clear margin."""
    others = list(others)
    num_blocks = current[1] - current[0]
    base = coverage(others, total)
    now = min(_with(base, current[0], num_blocks, weight))
    target = choose_blocks(others, num_blocks, total, weight)
    after = min(_with(base, target[0], num_blocks, weight))
    if target != current and (after > now * (1 + MOVE_MARGIN) or (now == 0 < after)):
        return target
    return None


def my_move(servers: dict[str, Placed], me: str, total: int) -> tuple[int, int] | None:
    """Where I should move, if a move helps and I am the one to make it.

    Every server evaluates every server's best move from the same view of the swarm and only the one whose
    move helps most (ties: the smallest peer id) makes it, so two servers never rush into the same hole.
    """
    candidates = []
    for peer_id, (start, end, weight) in servers.items():
        others = [placed for other, placed in servers.items() if other != peer_id]
        target = better_blocks(others, (start, end), total, weight)
        if target is not None:
            after = sorted(_with(coverage(others, total), target[0], end - start, weight))
            candidates.append((after, peer_id, target))
    if not candidates:
        return None
    best = max(candidates, key=lambda c: (c[0], [-ord(ch) for ch in c[1]]))
    return best[2] if best[1] == me else None


def block_bytes(model: ModelConfig, dtype_bytes: int) -> int:
    """Weights of one block (the largest, for models whose blocks differ), counted on the family's own
    layer classes built with meta tensors (no memory)."""
    from corolla.models.config import ATTENTION_NAME
    from corolla.models.loading import decoder_of, empty_model

    _, decoder = decoder_of(empty_model(model, ATTENTION_NAME))
    return max(sum(p.numel() for p in layer.parameters()) for layer in decoder.layers) * dtype_bytes


# bytes per weight of a quantized block, scales and zero points included (models/quantize.py)
QUANTIZED_WEIGHT_BYTES = {"int8": 1.02, "int4": 0.57}


def blocks_for_budget(
    model: ModelConfig, dtype_bytes: int, budget: int, cache_tokens: int, quantize: str | None = None
) -> int:
    """How many blocks fit in `budget` bytes, each with its weights (quantized or in the dtype) and
    `cache_tokens` of attention cache (in the dtype)."""
    weights = block_bytes(model, 1) * QUANTIZED_WEIGHT_BYTES.get(quantize or "", dtype_bytes)
    per_block = int(weights) + cache_tokens * model.kv_bytes_per_token_per_block(dtype_bytes)
    return max(0, min(model.num_hidden_layers, budget // per_block))
