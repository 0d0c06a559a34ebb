"""Which blocks a server should host, and when moving would help the swarm.

Coverage of a block is the total throughput of the servers hosting it (a count when throughputs are
unknown); its replicas, the number of servers hosting it. A new server takes the window that leaves the
swarm best, compared weakest block first: first by replicas up to REPLICAS (it fills holes, then gives a
second server to blocks that have one, so that one crash leaves no hole), then by coverage (it thickens
the thinnest part). A running server moves only when that gives some block a replica it lacks without
taking one from another, or raises the swarm's weakest coverage by a clear margin, so servers do not
chase each other.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable

from corolla.errors import InvalidRequest
from corolla.models.model_config import ModelConfig

# (start, end, throughput) of a server, and, where it stands for more than itself (a walk down one path of
# the records' tree: swarm/records/block_records.py `placed`), how many servers it stands for
Placed = tuple[int, int, float] | tuple[int, int, float, float]

MOVE_MARGIN = 0.2  # a move must raise the weakest coverage by 20% (or give a block a replica it lacks)
REPLICAS = 2  # servers per block placement reaches everywhere (where capacity allows) before throughput
WATCHED_REPLICAS = 3  # servers of blocks with at most this many are pinged, not trusted (weakest_holders)


def coverage(spans: Iterable[Placed], total: int) -> list[float]:
    """The total throughput hosting each block."""
    counts = [0.0] * total
    for start, end, weight, *_ in spans:
        for index in range(max(start, 0), min(end, total)):
            counts[index] += weight
    return counts


def replicas(spans: Iterable[Placed], total: int) -> list[float]:
    """The number of servers hosting each block (each record counted for the servers it stands for)."""
    return coverage(((p[0], p[1], _stands_for(p)) for p in spans), total)


def weakest_holders(servers: dict[str, Placed], total: int, most: int) -> list[str]:
    """While some block has at most WATCHED_REPLICAS servers: up to `most` servers (peer ids) holding the
    blocks with the fewest, fewest first (ties: smaller peer id). A silent crash of those could leave a
    block bare, and their records outlive them by more than an announce period: a server pings them
    rather than trust the records."""
    held = replicas(servers.values(), total)
    if not held or min(held) > WATCHED_REPLICAS:
        return []
    least = {
        peer: min(held[max(p[0], 0) : min(p[1], total)], default=math.inf) for peer, p in servers.items()
    }
    return sorted(least, key=lambda peer: (least[peer], peer))[:most]


def _stands_for(placed: Placed) -> float:
    return placed[3] if len(placed) > 3 else 1.0


def _with(base: list[float], start: int, end: int, weight: float) -> list[float]:
    return [c + weight if start <= i < end else c for i, c in enumerate(base)]


def _rank(base: list[float], held: list[float], window: tuple[int, int], weight: float) -> tuple[list, list]:
    """How good the swarm is with a server of `weight` on `window`: each block's replicas up to REPLICAS,
    then each block's coverage, weakest first (compared as tuples: holes, then single replicas, then
    throughput)."""
    start, end = window
    counts = sorted(min(h, REPLICAS) for h in _with(held, start, end, 1.0))
    return counts, sorted(_with(base, start, end, weight))


def windows(
    num_blocks: int, total: int, forbidden_cuts: frozenset[int] = frozenset()
) -> list[tuple[int, int]]:
    """The spans a server of `num_blocks` blocks may take: every start, ending as late as it may without
    cutting a group of layers that share keys and values (models/kv_sharing.py: then it holds fewer)."""
    found = []
    for start in range(total - num_blocks + 1):
        if start in forbidden_cuts:
            continue
        ends = [end for end in range(start + num_blocks, start, -1) if end not in forbidden_cuts]
        if ends:
            found.append((start, ends[0]))
    if not found:
        raise InvalidRequest(
            f"no span of {num_blocks} blocks or fewer keeps the model's layers that share keys and values "
            f"together (it may not start or end at blocks {sorted(forbidden_cuts)}); give it more memory"
        )
    return found


def choose_blocks(
    others: Iterable[Placed],
    num_blocks: int,
    total: int,
    weight: float = 1.0,
    forbidden_cuts: frozenset[int] = frozenset(),
) -> tuple[int, int]:
    """The window of at most `num_blocks` blocks that leaves the swarm best (weakest blocks first: their
    replicas up to REPLICAS, then their coverage)."""
    others = list(others)
    return choose_window(
        coverage(others, total), replicas(others, total), num_blocks, total, weight, forbidden_cuts
    )


def choose_window(
    base: list[float],
    held: list[float],
    num_blocks: int,
    total: int,
    weight: float,
    forbidden_cuts: frozenset[int] = frozenset(),
) -> tuple[int, int]:
    """`choose_blocks` given the others' coverage and replicas (corolla.sim keeps them as servers come
    and go)."""
    return max(
        windows(num_blocks, total, forbidden_cuts),
        key=lambda window: (*_rank(base, held, window, weight), -window[0]),
    )


def better_blocks(
    others: Iterable[Placed],
    current: tuple[int, int],
    total: int,
    weight: float,
    forbidden_cuts: frozenset[int] = frozenset(),
) -> tuple[int, int] | None:
    """Where this server should move, if moving gives a block a replica it lacks (up to REPLICAS) without
    taking one from another (one move may fill one of several holes: corolla sim found swarms that two
    holes froze), or raises the weakest coverage by a clear margin."""
    others = list(others)
    return _better_move(
        coverage(others, total), replicas(others, total), current, total, weight, forbidden_cuts
    )


def _better_move(
    base: list[float],
    held: list[float],
    current: tuple[int, int],
    total: int,
    weight: float,
    forbidden_cuts: frozenset[int],
) -> tuple[int, int] | None:
    """`better_blocks` given the others' coverage and replicas."""
    now = _rank(base, held, current, weight)
    target = choose_window(base, held, current[1] - current[0], total, weight, forbidden_cuts)
    after = _rank(base, held, target, weight)
    thicker = after[0] > now[0]  # fewer holes, or as few and fewer single replicas
    if target != current and (thicker or min(after[1]) > min(now[1]) * (1 + MOVE_MARGIN)):
        return target
    return None


def my_move(
    servers: dict[str, Placed], me: str, total: int, forbidden_cuts: frozenset[int] = frozenset()
) -> tuple[int, int] | None:
    """Where I should move, if a move helps and I am the one to make it.

    Every server evaluates every server's best move from the same view of the swarm and only the one whose
    move helps most (ties: the smallest peer id) makes it, so two servers never rush into the same hole.
    While some block has no server, the moves that fill holes one after another are planned from that
    view at once (`planned_moves`), and each server in the plan makes its own: a wide hole left by a
    crash is filled in one round, not one server per balance period.
    """
    return moves(servers, total, forbidden_cuts).get(me)


def moves(
    servers: dict[str, Placed], total: int, forbidden_cuts: frozenset[int] = frozenset()
) -> dict[str, tuple[int, int]]:
    """The servers to move now, by peer id, and where (`my_move` for every server at once)."""
    if min(coverage(servers.values(), total)) <= 0:
        return planned_moves(servers, total, forbidden_cuts)
    best = best_move(servers, total, forbidden_cuts)
    return {} if best is None else {best[0]: best[1]}


def planned_moves(
    servers: dict[str, Placed], total: int, forbidden_cuts: frozenset[int] = frozenset()
) -> dict[str, tuple[int, int]]:
    """The moves that fill the swarm's holes one after another: each the best move (`best_move`) of a
    server not moved yet in the swarm the moves before it leave, while some block has no server."""
    swarm = dict(servers)
    plan: dict[str, tuple[int, int]] = {}
    while min(coverage(swarm.values(), total)) <= 0:
        move = best_move(swarm, total, forbidden_cuts, moved=plan.keys())
        if move is None:
            break
        peer, target = move
        plan[peer] = target
        swarm[peer] = (*target, *swarm[peer][2:])
    return plan


def best_move(
    servers: dict[str, Placed],
    total: int,
    forbidden_cuts: frozenset[int] = frozenset(),
    moved: Collection[str] = (),
) -> tuple[str, tuple[int, int]] | None:
    """The server whose move helps the swarm most (of those not in `moved`), and where it moves (None: no
    move helps). Each server's others' coverage is the whole swarm's less its own span, summed in peer-id
    order: every server computes the same floats from the same view, whatever order it read the records in."""
    ordered = sorted(servers.items())
    whole = coverage((placed for _, placed in ordered), total)
    held = replicas((placed for _, placed in ordered), total)
    reach = _weak_reach(whole, held)
    candidates = []
    for peer_id, placed in ordered:
        start, end, weight = placed[:3]
        if end - start < reach or peer_id in moved:
            continue  # no window of its length holds every weak block: its move cannot help enough
        others = _with(whole, start, end, -weight)
        others_held = _with(held, start, end, -_stands_for(placed))
        target = _better_move(others, others_held, (start, end), total, weight, forbidden_cuts)
        if target is not None:
            candidates.append((_rank(others, others_held, target, weight), peer_id, target))
    if not candidates:
        return None
    best = max(candidates, key=lambda c: (c[0], [-ord(ch) for ch in c[1]]))
    return best[1], best[2]


def _weak_reach(whole: list[float], held: list[float]) -> int:
    """How many blocks a window must span to hold every block whose coverage a move must raise for the
    weakest to grow by MOVE_MARGIN (0 while some block has fewer than REPLICAS servers: any move giving
    one a replica may do). A block outside the new window keeps its coverage or loses the mover's, so all
    of them must be inside. A hair under the margin, so rounding never rules out a server `_better_move`
    would accept."""
    low = min(whole)
    if low <= 0 or min(held) < REPLICAS:
        return 0
    weak = [i for i, c in enumerate(whole) if c < low * (1 + MOVE_MARGIN) * (1 - 1e-9)]
    return weak[-1] - weak[0] + 1 if weak else 0


def block_bytes(model: ModelConfig, dtype_bytes: int) -> int:
    """Weights of one block (the largest, for models whose blocks differ), counted on the family's own
    layer classes built with meta tensors (no memory)."""
    from corolla.models.loading import decoder_of, empty_model
    from corolla.models.model_config import ATTENTION_NAME

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
