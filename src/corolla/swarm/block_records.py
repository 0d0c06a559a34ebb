"""The servers' records under the model's block keys: announced by each server for every block it hosts,
read back by clients (routing), servers (links, placement) and `corolla status`.

The records of a block fill a tree of DHT keys (swarm/record_cells.py), so that no key, and no read,
grows with the swarm: a reader walks one path down it (its own position or a random one) and gets a
sample of every block's servers, each standing for `weight(level)` servers; `corolla status` walks every
path. With at most record_cells.READ_ON servers per block the tree is one level and every read is whole.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from functools import partial

from hivemind.dht import DHT
from hivemind.utils import get_dht_time

from corolla.errors import InvalidRequest
from corolla.swarm.dht import PeerDHT, RemoteSpan, read_records, signer_of, store_records
from corolla.swarm.record_cells import Walk, cell_key, cell_of, position, weight
from corolla.wire.records import ServerState, ServerStatus

logger = logging.getLogger(__name__)

Placed = tuple[int, int, float]  # a server's start, end and throughput (server/placement.py)


@dataclass
class SwarmRead:
    """A walk's servers (spans of those announcing one of the wanted states) and the walk itself."""

    spans: list[RemoteSpan]
    walk: Walk


async def announce(
    dht: PeerDHT,
    dht_prefix: str,
    record: ServerStatus,
    expiration: float,
    also: Iterable[int] = (),
    level: int = 0,
    where: int = 0,
) -> bool:
    """Store `record`, signed, under the cell at `level` on the path `where` (the server's position) of
    every block of its span (and of the blocks `also`: a server that moves overwrites its records for the
    blocks it leaves); returns whether every store succeeded."""
    indices = sorted(set(range(record.start, record.end)) | set(also))
    keys = [cell_key(dht_prefix, i, level, cell_of(where, level)) for i in indices]
    store = partial(store_records, keys=keys, subkey=dht.subkey, value=record.to_dict(), ttl=expiration)
    return await dht.run_coroutine(store, return_future=True)


async def read_swarm(
    dht: DHT,
    dht_prefix: str,
    num_blocks: int,
    where: int | None,
    states: Collection[ServerState] = (ServerState.ONLINE,),
    tally: Counter | None = None,
) -> SwarmRead:
    """Every server found down the path `where` (None: every path) that announced one of `states`, with
    its announced span.

    A server counts only for the blocks under which its record was actually found, so a stale or lying
    announcement cannot claim blocks it never stored. Unsigned and malformed records are counted in
    `tally` (by reason) and skipped.
    """
    tally = Counter() if tally is None else tally
    walk = Walk(dht_prefix, num_blocks, where)
    blocks_by_peer: dict[str, set[int]] = {}
    records: dict[str, tuple[ServerStatus, int]] = {}
    while not walk.done:
        keys = walk.keys()
        found = await dht.run_coroutine(partial(read_records, keys=list(keys)), return_future=True)
        peers: dict[tuple[int, int], list[str]] = {}
        for key, (cell, block) in keys.items():
            for peer_id, record in _valid(found.get(key, {}), key, tally):
                peers.setdefault((cell, block), []).append(peer_id)
                if record.state in states and record.start <= block < record.end:
                    blocks_by_peer.setdefault(peer_id, set()).add(block)
                    records.setdefault(peer_id, (record, walk.level))
        walk.add(peers)
    spans = [
        _contiguous_span(peer_id, sorted(blocks), *records[peer_id])
        for peer_id, blocks in blocks_by_peer.items()
    ]
    return SwarmRead(spans, walk)


async def find_spans(
    dht: DHT,
    dht_prefix: str,
    num_blocks: int,
    states: Collection[ServerState] = (ServerState.ONLINE,),
    tally: Counter | None = None,
    where: int | None = None,
) -> list[RemoteSpan]:
    """The servers `read_swarm` finds (every path unless `where` names one)."""
    return (await read_swarm(dht, dht_prefix, num_blocks, where, states, tally)).spans


def placed(read: SwarmRead) -> dict[str, Placed]:
    """Every ONLINE server's span by peer id, weighted by its throughput (1.0 when it announced none)
    times the servers it stands for (a walk down one path): what placement, rebalancing and link
    measurements read. A server that missed renewing its records (wire/records.py STALE_PERIODS) is left
    out: it is most likely gone."""
    now = get_dht_time()
    return {
        s.peer_id: (
            s.start,
            s.end,
            (s.info.throughput or 1.0) * weight(s.level if read.walk.where is not None else 0),
        )
        for s in read.spans
        if not s.info.stale(now)
    }


async def placed_servers(dht: DHT, dht_prefix: str, num_blocks: int, me: str) -> dict[str, Placed]:
    """`placed` of a walk down the server `me`'s own path."""
    return placed(await read_swarm(dht, dht_prefix, num_blocks, position(me)))


def _valid(found: dict[str, object], key: str, tally: Counter) -> Iterable[tuple[str, ServerStatus]]:
    for subkey, raw in found.items():
        if (peer_id := signer_of(subkey, tally)) is None:
            continue
        try:
            yield peer_id, ServerStatus.from_dict(raw)
        except InvalidRequest as e:
            tally["malformed"] += 1
            logger.debug("Skipping a malformed record of %s under %s: %s", peer_id, key, e)


def _contiguous_span(peer_id: str, blocks: Sequence[int], record: ServerStatus, level: int) -> RemoteSpan:
    # the longest run of consecutive found blocks starting from the first one
    end = blocks[0] + 1
    for index in blocks[1:]:
        if index != end:
            break
        end += 1
    return RemoteSpan(peer_id, blocks[0], end, record, level)
