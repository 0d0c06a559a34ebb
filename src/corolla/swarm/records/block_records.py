"""The servers' records: announced by each server for the blocks it hosts, read back by clients
(routing), servers (links, placement) and `corolla status`.

The records fill a tree of DHT keys (swarm/records/record_cells.py: the blocks' keys, then cells of whole
records), so that no key, and no read, grows with the swarm: a reader walks one path down it (its own
position or a random one) and gets a sample of every block's servers, each standing for `weight(level)`
servers; `corolla status` walks every path. With at most record_cells.READ_ON servers a block the tree is
the blocks' keys alone and every read is whole.
"""

from __future__ import annotations

import logging
import random
from collections import Counter
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial

from hivemind.dht import DHT
from hivemind.utils import get_dht_time

from corolla.errors import InvalidRequest
from corolla.swarm.dht import PeerDHT, RemoteSpan, read_records, signer_of, store_records
from corolla.swarm.nat.circuit_book import BOOK
from corolla.swarm.policy.plausible import announced_kinds, bounded, implausible, speed_bounds
from corolla.swarm.records.record_cells import WHOLE, Walk, keys_at, position, read_chance, weight
from corolla.wire.records import ServerState, ServerStatus

logger = logging.getLogger(__name__)

Placed = tuple[int, int, float]  # a server's start, end and throughput (swarm/policy/placement.py)


@dataclass
class SwarmRead:
    """A walk's servers (spans of those announcing one of the wanted states) and the walk itself."""

    spans: list[RemoteSpan]
    walk: Walk
    read_at: dict[int, float] = field(default_factory=dict)  # levels whose read was reused: when it was made


@dataclass
class KeptPath:
    """A server's last read of each level of its own path down the records' tree, which its walks (links,
    rebalancing) reuse in a large swarm: a cell at level d lies on the path of about servers / 2**d servers
    and every read of a key lands on the few peers nearest to it in the DHT, so each level is read afresh
    only with record_cells.read_chance of the swarm the last walk counted, and a key's reads do not grow
    with the swarm. The deepest cells (a few dozen servers' paths) are read at every walk."""

    levels: dict[int, tuple[frozenset[str], dict, float]] = field(default_factory=dict)  # keys, found, when
    servers: float = 1.0  # the swarm's size, as the last walk counted it
    rng: random.Random = field(default_factory=random.Random)

    def reused(self, level: int, keys: Iterable[str]) -> tuple[dict, float] | None:
        """What the keys of `level` held when last read, and when, if the walk reuses that read now."""
        kept = self.levels.get(level)
        if kept is None or kept[0] != frozenset(keys) or self.rng.random() < read_chance(level, self.servers):
            return None
        return kept[1], kept[2]

    def keep(self, level: int, keys: Iterable[str], found: dict) -> None:
        self.levels[level] = (frozenset(keys), found, get_dht_time())


async def announce(
    dht: PeerDHT,
    dht_prefix: str,
    record: ServerStatus,
    expiration: float,
    also: Iterable[int] = (),
    level: int = 0,
    where: int = 0,
) -> bool:
    """Store `record`, signed, at `level` of the records' tree for the server at `where` (its position):
    level 0, under every block key of its span (and of the blocks `also`: a server that moves overwrites
    its records for the blocks it leaves); deeper, in its cell. Returns whether every store succeeded."""
    indices = sorted(set(range(record.start, record.end)) | set(also))
    keys = keys_at(dht_prefix, level, where, indices)
    store = partial(store_records, keys=keys, subkey=dht.subkey, value=record.to_dict(), ttl=expiration)
    return await dht.run_coroutine(store, return_future=True)


async def read_swarm(
    dht: DHT,
    dht_prefix: str,
    num_blocks: int,
    where: int | None,
    states: Collection[ServerState] = (ServerState.ONLINE,),
    tally: Counter | None = None,
    budget: int | None = None,
    kept: KeptPath | None = None,
) -> SwarmRead:
    """Every server found down the path `where` (None: every path) that announced one of `states`, with
    its announced span; each level as `kept` (of the server's own path) keeps it, if given.

    A server found under block keys (level 0) counts only for the blocks under which its record was
    actually found, so a stale announcement cannot claim blocks it left; one found in a deeper cell,
    for the span its signed record announces (a move overwrites that one record). Unsigned and malformed
    records are counted in `tally` (by reason) and skipped.
    """
    tally = Counter() if tally is None else tally
    walk = Walk(dht_prefix, num_blocks, where, budget)
    sightings: dict[str, list[Sighting]] = {}
    read_at: dict[int, float] = {}
    while not walk.done:
        keys = walk.keys()
        if kept is not None and (reused := kept.reused(walk.level, keys)) is not None:
            found, read_at[walk.level] = reused
        else:
            found = await dht.run_coroutine(partial(read_records, keys=list(keys)), return_future=True)
            if kept is not None:
                kept.keep(walk.level, keys, found)
        peers: dict[tuple[int, int], list[str]] = {}
        for key, (cell, block) in keys.items():
            for peer_id, record in _valid(found.get(key, {}), key, tally):
                peers.setdefault((cell, block), []).append(peer_id)
                hosted = _hosted(record, block, num_blocks)
                sightings.setdefault(peer_id, []).append(Sighting(record, walk.level, hosted))
        records = {peer: seen[-1].record for peer, seen in sightings.items()}
        walk.add(peers, _believed(records), implausible(announced_kinds(records)))
    spans = [
        span for peer_id, seen in sightings.items() if (span := _span(peer_id, seen, states)) is not None
    ]
    for span in spans:  # behind NAT: reached through the relays its record names
        BOOK.learn(span.peer_id, span.info.relays)
    if kept is not None and walk.one_path:  # each server found stands for weight(level) servers
        kept.servers = sum(weight(span.level) for span in spans)
    return SwarmRead(spans, walk, read_at)


async def find_spans(
    dht: DHT,
    dht_prefix: str,
    num_blocks: int,
    states: Collection[ServerState] = (ServerState.ONLINE,),
    tally: Counter | None = None,
    where: int | None = None,
    budget: int | None = None,
) -> list[RemoteSpan]:
    """The servers `read_swarm` finds (every path unless `where` names one; `budget`: see Walk)."""
    return (await read_swarm(dht, dht_prefix, num_blocks, where, states, tally, budget)).spans


def placed(read: SwarmRead) -> dict[str, Placed]:
    """Every ONLINE server's span by peer id, weighted by its throughput (1.0 when it announced none)
    times the servers it stands for (on a walk down one path; read whole, each stands for itself), and
    that number: what placement, rebalancing and link measurements read. A server that missed renewing its
    records (wire/records.py STALE_PERIODS) is left out: it is most likely gone (judged as of the read that
    found it, where the walk reused an older read of its level)."""
    now = get_dht_time()
    found = {}
    for s in read.spans:
        if not s.info.stale(read.read_at.get(s.level, now)):
            stands_for = weight(s.level if read.walk.one_path else 0)
            found[s.peer_id] = (s.start, s.end, (s.info.throughput or 1.0) * stands_for, stands_for)
    return found


async def placed_servers(
    dht: DHT, dht_prefix: str, num_blocks: int, me: str, kept: KeptPath | None = None
) -> dict[str, Placed]:
    """`placed` of a walk down the server `me`'s own path (its levels as `kept` keeps them)."""
    return placed(await read_swarm(dht, dht_prefix, num_blocks, position(me), kept=kept))


def _valid(found: dict[str, object], key: str, tally: Counter) -> Iterable[tuple[str, ServerStatus]]:
    for subkey, raw in found.items():
        if (peer_id := signer_of(subkey, tally)) is None:
            continue
        try:
            yield peer_id, ServerStatus.from_dict(raw)
        except InvalidRequest as e:
            tally["malformed"] += 1
            logger.debug("Skipping a malformed record of %s under %s: %s", peer_id, key, e)


@dataclass
class Sighting:
    """A server's record found under one key: the record, the level, the blocks it counts for there."""

    record: ServerStatus
    level: int
    hosted: range

    @property
    def announced(self) -> range:
        return range(self.record.start, self.record.end)


def _hosted(record: ServerStatus, block: int, num_blocks: int) -> range:
    """Level 0: the block it was found under; deeper (WHOLE): the span its signed record announces."""
    return range(record.start, min(record.end, num_blocks)) if block == WHOLE else range(block, block + 1)


def _span(peer_id: str, seen: list[Sighting], states: Collection[ServerState]) -> RemoteSpan | None:
    """The server's newest record, if it announces one of `states`, counted for the blocks under which
    a record of it was found that the newest one still announces (a server that moved or changed level
    leaves older records behind until they expire)."""
    newest = max(seen, key=lambda s: s.record.announced_at or 0.0)
    record = newest.record
    if record.state not in states:
        return None
    blocks = {b for s in seen for b in s.hosted if b in s.announced and b in newest.announced}
    return _contiguous_span(peer_id, sorted(blocks), record, newest.level) if blocks else None


def _contiguous_span(peer_id: str, blocks: Sequence[int], record: ServerStatus, level: int) -> RemoteSpan:
    # the longest run of consecutive found blocks starting from the first one
    end = blocks[0] + 1
    for index in blocks[1:]:
        if index != end:
            break
        end += 1
    return RemoteSpan(peer_id, blocks[0], end, record, level)


def _believed(records: dict[str, ServerStatus]) -> dict[str, float]:
    """The speeds the records announce, each bounded by its device's (swarm/policy/plausible.py)."""
    return bounded({peer: record.speed or 1.0 for peer, record in records.items()}, speed_bounds(records))
