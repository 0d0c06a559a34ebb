"""Where a server's records live in the DHT, so that what a peer reads stays bounded however large the
swarm grows (a key holding every server of a block grows with the swarm, and so does every read of it).

A block's records fill the cells of a binary tree. Level 0 is the block's key itself (`block_key`); level
d has 2**d cells, keyed `<block key>.<d>.<cell>`. A server's cell at level d is the top d bits of its
position (a hash of its peer id): the same path down the tree for every block it hosts, so a reader that
sees it under one of its blocks sees it under all of them.

Reading (`Walk`): a reader takes a path (a position: its own, or a random one) and reads level 0 of every
block, then the cells on its path one level deeper, for as long as some block's cell at the last level
read held READ_ON records or more. With at most that many servers per block the tree is level 0 alone
and every reader reads every record, as before cells existed.

Writing (`choose_level`): a server announces at one level for all its blocks. It enters at the shallowest
level, among those a reader on its own path reaches, where each of its blocks' cells holds fewer than
CELL_SERVERS other servers, and stays there while readers still reach it. Cells are kept between
READ_ON and 2 x CELL_SERVERS at random, so that servers do not move in herds: a cell overfull past
2 x CELL_SERVERS (servers that entered at once) sheds servers, each leaving with the share that brings
it back to that size in expectation; a shallower cell of one of a server's blocks with fewer than
READ_ON (its servers gone) is filled from below, each server under it coming up with the share that
fills it in expectation.

A server found at level d stands for 2**d servers on average (`weight`): the walk's records, so
weighted, estimate every block's throughput without reading every record (placement's view).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from corolla.wire.records import block_key

CELL_SERVERS = 32  # a writer enters a cell with fewer other servers than this
READ_ON = CELL_SERVERS // 2  # a reader goes one level deeper while some cell held this many
MAX_LEVEL = 20  # 2**20 cells per block: far past any swarm
POSITION_BITS = 64


def position(peer_id: str) -> int:
    """A server's place in the tree: the top bits of a hash of its peer id (or of any string: a reader's)."""
    digest = hashlib.sha256(peer_id.encode()).digest()
    return int.from_bytes(digest[: POSITION_BITS // 8], "big")


def random_position(rng: random.Random | None = None) -> int:
    return (rng or random).getrandbits(POSITION_BITS)


def cell_of(where: int, level: int) -> int:
    return where >> (POSITION_BITS - level) if level else 0


def cell_key(dht_prefix: str, block: int, level: int, cell: int) -> str:
    """The key of `block`'s cell number `cell` at `level` (cell_of a position)."""
    key = block_key(dht_prefix, block)
    return key if level == 0 else f"{key}.{level}.{cell}"


def weight(level: int) -> float:
    """How many servers, on average, one found at `level` stands for (on one path)."""
    return float(2**level)


Cell = tuple[int, int]  # (cell, block) at a level


@dataclass
class Walk:
    """A read of `num_blocks` blocks down the path `where` (None: down every path, the whole tree):
    `keys()` to read next, `add()` what was found there (peer ids per key), until `done`."""

    dht_prefix: str
    num_blocks: int
    where: int | None
    level: int = 0
    cells: list[int] = field(default_factory=lambda: [0])  # the cells to read at `level`
    found: list[dict[Cell, list[str]]] = field(default_factory=list)  # per level read

    def keys(self) -> dict[str, Cell]:
        return {
            cell_key(self.dht_prefix, block, self.level, cell): (cell, block)
            for cell in self.cells
            for block in range(self.num_blocks)
        }

    def add(self, peers: Mapping[Cell, Sequence[str]]) -> None:
        """The peer ids found in the cells `keys()` named."""
        self.found.append({cell: list(ids) for cell, ids in peers.items()})
        crowded = sorted({cell for (cell, _), ids in peers.items() if len(ids) >= READ_ON})
        self.level += 1
        if self.where is not None:
            self.cells = [cell_of(self.where, self.level)] if crowded else []
        else:
            self.cells = [child for cell in crowded for child in (2 * cell, 2 * cell + 1)]

    @property
    def done(self) -> bool:
        return not self.cells or self.level > MAX_LEVEL

    def counts(self, blocks: Iterable[int], me: str) -> list[list[int]]:
        """Per level read on this walk's path, per block of `blocks`: the servers other than `me` in
        its cell."""
        blocks = list(blocks)
        counts = []
        for level, found in enumerate(self.found):
            cell = cell_of(self.where or 0, level)
            counts.append([len(set(found.get((cell, b), ())) - {me}) for b in blocks])
        return counts


def choose_level(
    others: Sequence[Sequence[int]], current: int | None, rng: random.Random | None = None
) -> int:
    """The level to announce at, from a walk down this server's own path: `others[d][i]` is the number
    of other servers in the cell of its i-th block at level d (Walk.counts), for every level a reader
    reaches; `current` is the level it announced at last (None: not yet)."""
    rng = rng or random
    reached = len(others)  # a reader on this path reads levels 0 .. reached - 1
    if reached == 0:
        return 0
    if current is None or current >= reached:
        return _first_with_room(others, start=0)
    crowd = max(others[current], default=0)
    if crowd >= 2 * CELL_SERVERS and rng.random() >= 2 * CELL_SERVERS / (crowd + 1):
        return _first_with_room(others, start=current + 1)
    for level in range(current):
        if rng.random() < _move_up(others, level, current):
            return level
    return current


def _move_up(others: Sequence[Sequence[int]], level: int, current: int) -> float:
    """How likely a server at `current` should come up to `level`: a cell of one of its blocks there
    holds fewer than READ_ON others, and none holds 2 x CELL_SERVERS (the servers below that cell,
    2**(d - level) cells' worth at each level d, fill it to READ_ON in expectation)."""
    if max(others[level], default=0) >= 2 * CELL_SERVERS:
        return 0.0  # another of its blocks' cells there could not take it
    i = min(range(len(others[level])), key=lambda i: others[level][i])
    room = READ_ON - others[level][i]
    if room <= 0:
        return 0.0
    below = sum((others[d][i] + (d == current)) * 2 ** (d - level) for d in range(level + 1, len(others)))
    return min(1.0, room / max(1, below))


def _first_with_room(others: Sequence[Sequence[int]], start: int) -> int:
    for level in range(start, len(others)):
        if max(others[level], default=0) < CELL_SERVERS:
            return level
    return len(others) - 1  # the deepest level a reader reaches: its cells are the emptiest there are


@dataclass
class Place:
    """A server's place in the tree: its position (from its peer id) and the level it announces at
    (None until its first walk down its own path)."""

    where: int
    level: int | None = None

    def update(self, walk: Walk, blocks: Iterable[int], me: str, rng: random.Random | None = None) -> int:
        """The level to announce at now, after `walk` (down this server's own path)."""
        self.level = choose_level(walk.counts(blocks, me), self.level, rng)
        return self.level
