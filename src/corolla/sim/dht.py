"""What corolla's DHT costs each peer, and how that grows with the swarm: hivemind's own Kademlia code
(`RoutingTable`, `traverse_dht`) run in one process under asyncio, without sockets or a clock.

The traffic is corolla's (swarm/records/block_records.py, the records' tree of swarm/records/record_cells.py,
settled in memory by its own rules: sim/record_tree.py): every announce period each server stores its signed
record at its level (level 0: under each of its block keys; deeper: in its one cell; `store_many`), and
MODEL_LISTERS of them under MODELS_KEY; each server walks its own path once an announce period
(server/upkeep/link_monitor.py) and once a balance period (server/upkeep/rebalancer.py), a level's keys in
one get_many, each level afresh with record_cells.read_chance (else it reuses its last read of it:
block_records.KeptPath); a client reads the tree as far as CLIENT_CELLS allow (a client that stays re-reads
every refresh_period: count each re-read as a session). Lookups get the arguments DHTNode.store_many and
get_many_by_id give `traverse_dht`, with DHTNode's defaults, corolla's 4 workers and its caching (none:
swarm/dht.py CACHING; sim/dht_swarm.py); reads want the latest value (sufficient_expiration_time=inf):
they visit the beam, and every copy in it is sent. `bounded_reads` models reads at a bounded staleness
instead (not corolla's: a read that ends at the first copy trusts one peer not to leave records out): a
read ends at the first node storing the records.

Assumed: every server is a reachable DHT node that stays up, whose table is in Kademlia's steady state
(each bucket holds min(k, nodes in its range), met at random: sim/dht_nodes.py); a client (client mode)
has such a table, and no node adds it. Every node that holds a key holds its whole dictionary (a record
from each server stored there). A request from a node that does not fit its full bucket makes the callee
ping the bucket's oldest node, which does the same with its pinger (hivemind's update_routing_table): these
pings are counted apart. Approximated: answers come at once (workers interleave as asyncio schedules them;
a real node has at most k pings in flight per bucket, which may cut the chains of pings short); spans
start at the least covered block; servers all announce the same throughput (the block keys keep the
smallest peer ids); records have the size of one real one (sim/dht_wire.py); a reply over hivemind's
message limit counts as sent, though a real one fails; a level's read counts read_chance times over
instead of a random share of walks reading it. Not modelled: churn, joins, table refreshes.
Sampled: `samples` operations of each kind (by random servers; reads also by new clients; servers' walks
stratified over the tree's cells: `_server_walks`; every announcement at level 0: `_announces`), scaled
to their rate per minute. What an operation costs the server that starts it is shared out evenly (each
server starts as many), so the largest cost is that of the peers serving others.
"""

from __future__ import annotations

import asyncio
import functools
import random
from dataclasses import fields

import numpy as np
from hivemind.dht.routing import DHTID
from hivemind.p2p.p2p_daemon_bindings.control import DEFAULT_MAX_MSG_SIZE

from corolla.config import ServerConfig
from corolla.sim.dht_nodes import BITS
from corolla.sim.dht_swarm import DhtSwarm
from corolla.sim.dht_wire import PREFIX, Wire
from corolla.sim.record_tree import RecordTree, seen
from corolla.swarm.records.model_listing import MODEL_LISTERS
from corolla.swarm.records.record_cells import CLIENT_CELLS, Walk, cell_key, read_chance

BALANCE_PERIOD = next(f.default for f in fields(ServerConfig) if f.name == "balance_period")
KINDS = ("announce", "models", "server_root_reads", "server_reads", "client_reads")


def dht_traffic(
    servers: int,
    num_blocks: int = 80,
    blocks_per_server: float = 12.0,
    announce_period: float = 30.0,
    sessions_per_minute: float = 7.0,
    seed: int = 0,
    samples: int = 20,
    bounded_reads: bool = False,
) -> dict:
    """What the DHT costs each of `servers` servers per minute, mean and max over them: messages (a
    request and its response are two; pings also apart) and bytes sent plus received, in all and by
    kind of traffic. Also: requests per operation; hops per key read (requests in a row before the key's
    nearest node was first named); reads_exact (key reads whose NUM_REPLICAS nearest found are the
    true ones); one client read's cost; a block key's value bytes. Server reads are corolla's: one per
    announce period (links) and one per balance period (rebalancing). `bounded_reads`: see the module's
    docstring."""
    rng = random.Random(seed)
    swarm = DhtSwarm(servers, seed, _wire(), bounded_reads, len(KINDS))
    spans = _spans(servers, num_blocks, blocks_per_server, rng)
    tree = RecordTree.settled(PREFIX, num_blocks, spans, rounds=1, rng=rng)
    for key, peers in tree.cells.items():
        swarm.add_key(DHTID.generate(source=key), len(peers))
    listers = min(servers, MODEL_LISTERS)  # the servers that list the model (swarm/records/model_listing.py)
    swarm.add_key(swarm.models_key, listers)
    server_reads_per_minute = 60 / announce_period + 60 / BALANCE_PERIOD
    announces = servers * 60 / announce_period
    listings = listers * 60 / announce_period
    walks = servers * server_reads_per_minute
    rates = np.array([announces, listings, walks, walks, sessions_per_minute])
    asyncio.run(_simulate(swarm, tree, samples, rng))
    return _report(swarm, rates / samples, samples, tree)


@functools.cache
def _wire() -> Wire:
    return Wire()


def _spans(servers: int, num_blocks: int, blocks_per_server: float, rng: random.Random) -> list[range]:
    """Each server's blocks: 0.5-1.5 times the mean, starting at the least covered block."""
    coverage = np.zeros(num_blocks)
    spans = []
    for _ in range(servers):
        length = min(num_blocks, max(1, round(rng.uniform(0.5, 1.5) * blocks_per_server)))
        start = min(int(np.argmin(coverage)), num_blocks - length)
        coverage[start : start + length] += 1
        spans.append(range(start, start + length))
    return spans


async def _simulate(swarm: DhtSwarm, tree: RecordTree, samples: int, rng) -> None:
    """The sampled operations, interleaved so that routing tables change as they would: a server's
    listing of the model, a new client's walk down a random path (a level's keys in one get_many each);
    then the servers' announcements (`_announces`) and walks down their own paths (links and rebalancing)."""
    nodes = swarm.nodes
    for _ in range(samples):
        nodes.initiator = nodes.ids[rng.randrange(len(nodes.ids))]
        nodes.kind = KINDS.index("models")
        await swarm.announce(nodes.initiator, [swarm.models_key])
        nodes.kind = KINDS.index("client_reads")
        await _walk(swarm, tree.walk(None, CLIENT_CELLS, rng), DHTID(rng.getrandbits(BITS)), "client")
    await _announces(swarm, tree, samples, rng)
    await _server_walks(swarm, tree, samples)


async def _announces(swarm: DhtSwarm, tree: RecordTree, samples: int, rng) -> None:
    """Every announcement at level 0 (a store under each of a server's blocks' keys, whose lookup gets each
    key's whole value from every holder it asks: a few sampled ones would land on a few blocks' keys and
    make their nearest peers look far busier than they are), and `samples` of those deeper (one cell each),
    each counting for the servers it stands for."""
    nodes = swarm.nodes
    nodes.kind = KINDS.index("announce")
    servers = range(len(nodes.ids))
    top = [server for server in servers if not tree.places[f"peer{server}"].level]
    deep = [server for server in servers if tree.places[f"peer{server}"].level]
    sampled = rng.sample(deep, min(samples, len(deep)))
    for announcing, stands_for in ((top, 1.0), (sampled, len(deep) / max(len(sampled), 1))):
        nodes.weight = stands_for * samples / len(nodes.ids)  # of the `samples` the kind's rate is scaled by
        for server in announcing:
            nodes.initiator = nodes.ids[server]
            await swarm.announce(nodes.initiator, swarm.ids(tree.keys_of(f"peer{server}")))
    nodes.weight = 1.0


async def _server_walks(swarm: DhtSwarm, tree: RecordTree, samples: int) -> None:
    """Servers' walks down their own paths, stratified: a level's cells are all read alike, however many
    there are (a handful of random walks would land on a few deep cells and make their nearest peers look
    far busier than they are). The servers walking are spread evenly over the positions in bit-reversed
    order, so that the first 2**d of them go through every cell of level d once; level d's keys are read on
    max(2**d, `samples`) walks, each read counting for read_chance(d) times the walks it stands for."""
    nodes = swarm.nodes
    by_place = sorted(range(len(nodes.ids)), key=lambda server: tree.places[f"peer{server}"].where)
    deepest = max(place.level or 0 for place in tree.places.values())

    def reading(level: int) -> int:  # the walks that read `level`
        return max(1 << (samples - 1).bit_length(), 2**level)

    bits = reading(deepest).bit_length() - 1
    for k in range(2**bits):
        slot = int(f"{k:0{bits}b}"[::-1], 2) if bits else 0  # k's bits reversed
        reader = by_place[(2 * slot + 1) * len(by_place) // 2 ** (bits + 1)]
        nodes.initiator = nodes.ids[reader]
        walk = tree.walk(tree.places[f"peer{reader}"].where)
        weights = {  # each level's read counts read_chance times the walks it stands for
            level: read_chance(level, len(nodes.ids)) * samples / reading(level)
            for level in range(len(walk.found))
            if k < reading(level)
        }
        await _walk(swarm, walk, nodes.initiator, "server", weights)


async def _walk(
    swarm: DhtSwarm, walk: Walk, reader: DHTID, who: str, weights: dict[int, float] | None = None
) -> None:
    """The reads of `walk`'s keys, a level at a time (one get_many each): if `weights` are given (a
    server's walk: see _server_walks), of their levels only, each read counting that many times (a server
    reads each level afresh with read_chance, else it reuses its last read: block_records.KeptPath), its
    reads of the blocks' keys counted apart."""
    swarm.stats[f"{who}_walks"] += 1
    swarm.stats[f"{who}_keys"] += sum(len(found) for found in walk.found)
    swarm.stats[f"{who}_servers"] += len(seen(walk))
    nodes = swarm.nodes
    for level, found in enumerate(walk.found):
        if weights is not None:
            if level not in weights:
                continue
            nodes.kind = KINDS.index("server_reads" if level else "server_root_reads")
            nodes.weight = weights[level]
        keys = [cell_key(PREFIX, level, cell, block) for cell, block in found]
        await swarm.read(reader, swarm.ids(keys))
    nodes.weight = 1.0


def _report(swarm: DhtSwarm, scale: np.ndarray, samples: int, tree: RecordTree) -> dict:
    nodes = swarm.nodes
    counts = nodes.counts + nodes.own[:, :, None] / len(nodes.ids)  # the servers' own share, evenly
    per_minute = counts * scale[:, None, None]  # [kind, (messages, sent, received, pings), server]
    total = per_minute.sum(axis=0)
    traffic = total[1] + total[2]
    hottest = nodes.ids[int(np.argmax(traffic))]
    stats = swarm.stats
    values = [
        swarm.value_bytes(key) for key in swarm.entries if swarm.entries[key] and key != swarm.models_key
    ]

    def spread(row: np.ndarray) -> dict:
        return {"mean": round(float(row.mean()), 1), "max": round(float(row.max()), 1)}

    return {
        "servers": len(nodes.ids),
        "per_peer_per_minute": {
            "messages": spread(total[0]),
            "ping_messages": spread(total[3]),
            "bytes": spread(traffic),
            "bytes_sent": spread(total[1]),
            "bytes_by_kind": {k: spread(row[1] + row[2]) for k, row in zip(KINDS, per_minute, strict=True)},
        },
        "hottest_peer_holds_keys": sum(hottest in holders for holders in swarm.holders.values()),
        "rpcs_per_operation": {kind: round(nodes.rpcs[i] / samples, 1) for i, kind in enumerate(KINDS)},
        "pings_per_rpc": round(nodes.pings / sum(nodes.rpcs.values()), 2),
        "hops_per_key_read": round(stats["hops"] / stats["keys_read"], 2),
        "reads_exact": round(stats["exact"] / stats["keys_read"], 3),
        "client_per_read": {
            "messages": round(float(nodes.clients[-1][0]) / samples, 1),
            "bytes": round(float(nodes.clients[-1][1:3].sum()) / samples),
        },
        "value_bytes_per_block_key": {"mean": round(float(np.mean(values))), "max": max(values)},
        "records_tree": {
            "cells": len(values),
            "deepest_level": max(place.level for place in tree.places.values()),
            **{
                f"{who}_read": {
                    "keys": round(stats[f"{who}_keys"] / stats[f"{who}_walks"], 1),
                    "servers_seen": round(stats[f"{who}_servers"] / stats[f"{who}_walks"], 1),
                }
                for who in ("server", "client")
            },
        },
        "value_bytes_models_key": swarm.value_bytes(swarm.models_key),
        "largest_message_bytes": nodes.largest,
        "largest_over_limit": nodes.largest > DEFAULT_MAX_MSG_SIZE,
    }
