"""Where a server's records live in the DHT, so that what a peer reads stays bounded however large the
swarm grows (a key holding every server of a block grows with the swarm, and so does every read of it).

The records form a tree. Level 0 is the blocks' keys themselves (`block_key`): a server there stores its
record under each block it hosts, and such a record counts for the blocks it was found under. Level
d >= 1 has 2**d cells, keyed `<prefix>.cells.<d>.<cell>`, each holding whole records (a server's span
is the one its signed record announces); a server's cell at level d is the top d bits of its position (a
hash of its peer id). A server is at one level.

Reading (`Walk`): a reader takes a path (a position: a server its own) and reads every block's key; if
some block's key held READ_ON records or more, the cell on its path at level 1, and one level deeper for
as long as the last cell held DEEP_READ_ON or more. With at most READ_ON servers a block the tree is
level 0 alone and every reader reads every record, as before the tree existed. A walk reads num_blocks
keys and then one key per level: about log2(servers / DEEP_SERVERS) of them. A client reads every path
level by level as far as CLIENT_CELLS cells allow (the whole tree of a swarm of about a thousand
servers), then one random path on; `corolla status` reads the whole tree. A server's own walks read each
level afresh with `read_chance` only (block_records.KeptPath), so no key's reads grow with the swarm.

Writing (`choose_level`): the blocks' keys keep the fastest servers, the ones every reader should see:
a server goes there when it is among the CELL_SERVERS fastest (by announced throughput, bounded by its
device's: swarm/policy/plausible.py) under each of its blocks' keys, and leaves when it falls behind
2 x CELL_SERVERS under one of them, so a faster newcomer displaces the slowest. A record of implausible
speed (a liar's) counts as faster than no one, and a key holding such records has room for
HONEST_PER_DOUBTED honest servers per liar (`Walk.room`). The others enter the shallowest cell with
room (fewer than DEEP_SERVERS others) that a reader on their own path reaches, and stay while readers
still reach it. Cells are kept
between DEEP_READ_ON and 2 x DEEP_SERVERS at random, so that servers do not move in herds: a cell
overfull past that (servers that entered at once) sheds servers, each leaving with the share that brings
it back in expectation; a shallower cell with fewer than DEEP_READ_ON (its servers gone) is filled from
below, each server under it coming up with the share that fills it in expectation.

A server found at level d stands for 2**d servers on average (`weight`; every reader sees all of level
0): the walk's records, so weighted, estimate every block's throughput without reading every record
(placement's view), without bias since a server's cell is a hash of its peer id.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from corolla.wire.records import block_key

CELL_SERVERS = 32  # a server enters level 0 when fewer of them are faster under each of its blocks' keys
HONEST_PER_DOUBTED = 4  # under a key holding doubted records, room for this many honest ones per doubted one
READ_ON = CELL_SERVERS // 2  # a reader reads level 1 when some block's key held this many
DEEP_SERVERS = 64  # a server enters a deeper cell holding fewer other servers than this
DEEP_READ_ON = DEEP_SERVERS // 2  # a reader goes one level deeper while its last cell held this many
CLIENT_CELLS = 32  # a client reads this many cells at most: the tree's first 4 levels whole
MAX_LEVEL = 40  # 2**40 cells: far past any swarm
POSITION_BITS = 64
KEY_READERS = 64  # servers' walks that read a key of the tree afresh each period, however large the swarm
WHOLE = -1  # the block of a deeper cell's key: it holds whole records

Key = tuple[int, int]  # (cell, block) at a level: level 0's keys are (0, block), deeper ones (cell, WHOLE)


def position(peer_id: str) -> int:
    """A server's place in the tree: the top bits of a hash of its peer id (or of any string: a reader's)."""
    digest = hashlib.sha256(peer_id.encode()).digest()
    return int.from_bytes(digest[: POSITION_BITS // 8], "big")


def cell_of(where: int, level: int) -> int:
    return where >> (POSITION_BITS - level) if level else 0


def cell_key(dht_prefix: str, level: int, cell: int, block: int = WHOLE) -> str:
    """Level 0: `block`'s key; deeper: the key of cell number `cell` (cell_of a position)."""
    return block_key(dht_prefix, block) if level == 0 else f"{dht_prefix}.cells.{level}.{cell}"


def keys_at(dht_prefix: str, level: int, where: int, blocks: Iterable[int]) -> list[str]:
    """The keys a server at `level` on the path `where` stores its record under."""
    if level == 0:
        return [cell_key(dht_prefix, 0, 0, block) for block in blocks]
    return [cell_key(dht_prefix, level, cell_of(where, level))]


def weight(level: int) -> float:
    """How many servers, on average, one found at `level` stands for (on one path)."""
    return float(2**level)


def read_chance(level: int, servers: float) -> float:
    """How likely a server's walk down its own path reads its cell at `level` afresh in a swarm of about
    `servers` servers (otherwise it reuses its last read: block_records.KeptPath). About servers / 2**level
    servers' paths go through that cell, and every read of a key lands on the same few peers, the key's
    nearest in the DHT: KEY_READERS of them a period read it."""
    return min(1.0, KEY_READERS * 2**level / max(servers, 1.0))


def read_on(level: int) -> int:
    return READ_ON if level == 0 else DEEP_READ_ON


@dataclass
class Walk:
    """A read of `num_blocks` blocks down the path `where` (None: down every path, the whole tree, or
    as much of it as `budget` cells allow, level by level, then one random path on): `keys()` to read
    next, `add()` what was found there (peer ids per key), until `done`."""

    dht_prefix: str
    num_blocks: int
    where: int | None
    budget: int | None = None  # every path: the most cells to read, then one random path on (None: all)
    level: int = 0
    cells: list[int] = field(default_factory=lambda: [0])  # the cells to read at `level`
    found: list[dict[Key, list[str]]] = field(default_factory=list)  # per level read
    speeds: dict[str, float] = field(default_factory=dict)  # the throughput each server found announces
    doubted: set[str] = field(default_factory=set)  # servers whose speed is implausible (policy/plausible.py)
    rng: random.Random | None = None  # what draws the random path (None: Python's; the simulator seeds one)

    @property
    def one_path(self) -> bool:
        """Whether this walk went down one path from the start (its servers stand for 2**level each)."""
        return self.where is not None and self.budget is None

    def keys(self) -> dict[str, Key]:
        if self.level == 0:
            return {cell_key(self.dht_prefix, 0, 0, b): (0, b) for b in range(self.num_blocks)}
        return {cell_key(self.dht_prefix, self.level, cell): (cell, WHOLE) for cell in self.cells}

    def add(
        self,
        peers: Mapping[Key, Sequence[str]],
        speeds: Mapping[str, float] | None = None,
        doubted: Iterable[str] = (),
    ) -> None:
        """The peer ids found under the keys `keys()` named (and their announced throughputs: the
        blocks' keys keep the fastest; `doubted`: those whose announced speed is implausible)."""
        self.found.append({key: list(ids) for key, ids in peers.items()})
        self.speeds.update(speeds or {})
        self.doubted.update(doubted)
        crowded = sorted({cell for (cell, _), ids in peers.items() if len(ids) >= read_on(self.level)})
        self.level += 1
        children = [child for cell in crowded for child in (2 * cell, 2 * cell + 1)]
        if self.where is None and self.budget is not None and len(children) > self.budget and crowded:
            # the budget cannot read this level whole: on down a random path through a crowded cell
            bits = POSITION_BITS - self.level + 1
            rng = self.rng or random
            self.where = rng.choice(crowded) << bits | rng.getrandbits(bits)
        if self.where is not None:
            self.cells = [cell_of(self.where, self.level)] if crowded else []
        else:
            self.cells = children
        if self.budget is not None:
            self.budget -= len(self.cells)

    @property
    def done(self) -> bool:
        return not self.cells or self.level > MAX_LEVEL

    def counts(self, blocks: Sequence[int], me: str) -> list[list[int]]:
        """Per level read on this walk's path, the servers other than `me`: level 0 under each of
        `blocks`, deeper in the cell."""
        counts = [[len(set(self.found[0].get((0, b), ())) - {me}) for b in blocks]] if self.found else []
        for level in range(1, len(self.found)):
            counts.append([len(self._cell(level, me))])
        return counts

    def faster(self, blocks: Sequence[int], me: str, mine: float) -> list[int]:
        """For each of `blocks`: the servers under its key faster than `me` (announcing more throughput
        than `mine`; the same: a smaller peer id), none whose announced speed is implausible."""
        if not self.found:
            return [0] * len(blocks)

        def ahead(peer: str) -> bool:
            return peer not in self.doubted and (-self.speeds.get(peer, 0.0), peer) < (-mine, me)

        return [sum(ahead(peer) for peer in set(self.found[0].get((0, b), ())) - {me}) for b in blocks]

    def room(self, blocks: Sequence[int]) -> int:
        """How many faster servers a server may have under its blocks' keys and enter level 0: CELL_SERVERS,
        or HONEST_PER_DOUBTED per doubted record under the most doubted of its keys (liars write themselves
        there as they like: honest servers keep the larger share of what every reader reads)."""
        if not self.found or not self.doubted:
            return CELL_SERVERS
        doubted = max((len(self.doubted & set(self.found[0].get((0, b), ()))) for b in blocks), default=0)
        return max(CELL_SERVERS, HONEST_PER_DOUBTED * doubted)

    def _cell(self, level: int, me: str) -> set[str]:
        return set(self.found[level].get((cell_of(self.where or 0, level), WHOLE), ())) - {me}


def choose_level(
    others: Sequence[Sequence[int]],
    current: int | None,
    faster: Sequence[int] | None = None,
    rng: random.Random | None = None,
    room: int = CELL_SERVERS,
) -> int:
    """The level to announce at, from a walk down this server's own path: `others` are Walk.counts for
    every level a reader reaches, `faster` Walk.faster (None: every other server under a block's key is
    faster); `current` is the level it announced at last (None: not yet).

    The blocks' keys keep the fastest servers: a server goes there when it is among the `room` (Walk.room:
    CELL_SERVERS where no record there is doubted) fastest under each of its blocks' keys, and leaves when
    it falls behind room + CELL_SERVERS under one of them. Deeper, it enters the shallowest cell with room
    that readers reach and stays while they still reach it."""
    rng = rng or random
    reached = len(others)  # a reader on this path reads levels 0 .. reached - 1
    ahead = max(others[0] if faster is None else faster, default=0) if reached else 0
    if ahead < room or (current == 0 and ahead < room + CELL_SERVERS):
        return 0
    if current is None or current == 0 or current >= reached:
        return _first_with_room(others, start=1)
    crowd = others[current][0]
    if crowd >= 2 * DEEP_SERVERS and rng.random() >= 2 * DEEP_SERVERS / (crowd + 1):
        return _first_with_room(others, start=current + 1)
    for level in range(1, current):
        if rng.random() < _move_up(others, level, current):
            return level
    return current


def _move_up(others: Sequence[Sequence[int]], level: int, current: int) -> float:
    """How likely a server in a cell at `current` should come up to its cell at `level`, which holds
    fewer than DEEP_READ_ON others: the servers below it (2**(d - level) cells' worth at each level d)
    fill it in expectation."""
    missing = DEEP_READ_ON - others[level][0]
    if missing <= 0:
        return 0.0
    below = sum((others[d][0] + (d == current)) * 2 ** (d - level) for d in range(level + 1, len(others)))
    return min(1.0, missing / max(1.0, below))


def _first_with_room(others: Sequence[Sequence[int]], start: int) -> int:
    for level in range(start, len(others)):
        if others[level][0] < DEEP_SERVERS:
            return level
    return max(start, len(others) - 1)  # the deepest a reader reaches: its cell is the emptiest there is


@dataclass
class Place:
    """A server's place in the tree: its position (from its peer id) and the level it announces at
    (None until its first walk down its own path)."""

    where: int
    level: int | None = None

    def update(
        self, walk: Walk, blocks: range, me: str, mine: float, rng: random.Random | None = None
    ) -> int:
        """The level to announce at now, after `walk` (down this server's own path), for a server of
        throughput `mine`."""
        faster = walk.faster(blocks, me, mine)
        self.level = choose_level(walk.counts(blocks, me), self.level, faster, rng, walk.room(blocks))
        return self.level

    def keys(self, dht_prefix: str, blocks: Iterable[int]) -> list[str]:
        return keys_at(dht_prefix, self.level or 0, self.where, blocks)
