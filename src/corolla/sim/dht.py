"""What corolla's DHT costs each peer, and how that grows with the swarm: hivemind's own Kademlia code
(`RoutingTable`, `traverse_dht`) run in one process under asyncio, without sockets or a clock.

The traffic is corolla's (swarm/records/block_records.py, the records' tree of swarm/records/record_cells.py,
settled in memory by its own rules: sim/record_tree.py): every announce period each server stores its signed
record at its level (level 0: under each of its block keys; deeper: in its one cell; `store_many`, and its
cache holds those keys, so hivemind's cache_on_store re-reads them at once), and MODEL_LISTERS of them
under MODELS_KEY; each server walks its own path once an announce period (server/upkeep/link_monitor.py) and
once a balance period (server/upkeep/rebalancer.py), a level's keys in one get_many; a client reads the tree
as far as CLIENT_CELLS allow (a client that stays re-reads every refresh_period: count each re-read as a
session). Lookups get the arguments DHTNode.store_many and get_many_by_id give `traverse_dht`, with DHTNode's
defaults and corolla's 4 workers; reads want the latest value (sufficient_expiration_time=inf): they
visit the beam, and every copy in it is sent. `bounded_reads` models reads at a bounded staleness instead
(not corolla's: a read that ends at the first copy trusts one peer not to leave records out): a read ends
at the first node storing the records (a copy cached elsewhere is counted as too old to end it: at worst),
and nodes keep no copy of their own reads or stores (cache_locally and cache_on_store off).

Assumed: every server is a reachable DHT node that stays up, whose table is in Kademlia's steady state
(each bucket holds min(k, nodes in its range), met at random: sim/dht_nodes.py); a client (client mode)
has such a table, and no node adds it. Every node that holds a key holds its whole dictionary (a record
from each server stored there); a read caches it (cache_nearest) from the first holder that answered.
A request from a node that does not fit its full bucket makes the callee ping the bucket's oldest node,
which does the same with its pinger (hivemind's update_routing_table): these pings are counted apart.
Approximated: answers come at once (workers interleave as asyncio schedules them; a real node has at
most k pings in flight per bucket, which may cut the chains of pings short); spans start at the least
covered block; servers all announce the same throughput (the block keys keep the smallest peer ids);
records have the size of one real one (sim/dht_wire.py); a reply over hivemind's message
limit counts as sent, though a real one fails. Not modelled: churn, joins, table refreshes.
Sampled: `samples` operations of each kind (by random servers; reads also by new clients), scaled to
their rate per minute. What an operation costs the server that starts it is shared out evenly (each
server starts as many), so the largest cost is that of the peers serving others.
"""

from __future__ import annotations

import asyncio
import functools
import heapq
import random
from collections import Counter
from dataclasses import fields

import numpy as np
from hivemind.dht.routing import DHTID
from hivemind.dht.traverse import traverse_dht
from hivemind.p2p.p2p_daemon_bindings.control import DEFAULT_MAX_MSG_SIZE

from corolla.config import ServerConfig
from corolla.sim.dht_nodes import BITS, BUCKET_SIZE, NODE_DEFAULTS, Nodes
from corolla.sim.dht_wire import PREFIX, Wire
from corolla.sim.record_tree import RecordTree, seen
from corolla.swarm.dht import MODELS_KEY
from corolla.swarm.records.model_listing import MODEL_LISTERS
from corolla.swarm.records.record_cells import CLIENT_CELLS, Walk, cell_key

NUM_REPLICAS = NODE_DEFAULTS["num_replicas"].default  # nodes that store each record
CACHE_NEAREST = NODE_DEFAULTS["cache_nearest"].default  # after a read, nodes that get the whole value
CHUNK_SIZE = NODE_DEFAULTS["chunk_size"].default
NUM_WORKERS = 4  # corolla's start_dht
BALANCE_PERIOD = next(f.default for f in fields(ServerConfig) if f.name == "balance_period")
KINDS = ("announce", "models", "server_reads", "client_reads")


class DhtSwarm:
    """The swarm's keys over its nodes: who holds each key, and the DHT operations corolla runs."""

    def __init__(self, servers: int, seed: int, wire: Wire, bounded_reads: bool = False):
        self.nodes = Nodes(servers, seed, wire, len(KINDS))
        self.bounded_reads = bounded_reads
        self.entries: dict[DHTID, int] = {}  # servers under each key
        self.holders: dict[DHTID, set[DHTID]] = {}  # nodes that hold each key's dictionary
        self.stored: dict[DHTID, set[DHTID]] = {}  # of them, those the records are stored on (kept renewed)
        self.nearest: dict[DHTID, list[DHTID]] = {}  # each key's truly nearest nodes
        self.models_key = DHTID.generate(source=MODELS_KEY)
        self.stats: Counter[str] = Counter()

    def add_key(self, key: DHTID, entries: int) -> None:
        self.entries[key] = entries
        self.nearest[key] = heapq.nsmallest(NUM_REPLICAS + 1, self.nodes.ids, key=lambda node: node ^ key)
        self.holders[key] = set(self.nearest[key][:NUM_REPLICAS]) if entries else set()
        self.stored[key] = set(self.holders[key])

    def ids(self, keys: list[str]) -> list[DHTID]:
        """The DHT ids of `keys` (cells nobody stored in are empty keys)."""
        ids = [DHTID.generate(source=key) for key in keys]
        for key in ids:
            if key not in self.entries:
                self.add_key(key, 0)
        return ids

    def value_bytes(self, key: DHTID) -> int:
        return self.nodes.wire.value(self.entries[key], key == self.models_key)

    async def lookup(
        self, caller: DHTID, keys: list[DHTID], num_workers: int, per_call: int, bounded: bool = False
    ):
        """traverse_dht as DHTNode calls it, from the caller's k nearest to each key. A find answers
        from the callee's table, with the key's whole value if it holds it; a `bounded` read ends at the
        first node storing the records. Returns each key's beam, the holders that answered it (in order)
        and each node's hops (requests before it was known)."""
        nodes = self.nodes
        client = not nodes.is_server(caller)
        exclude = DHTID(0) if client else caller  # rpc_find leaves out the requester's (empty) id
        hops: dict[DHTID, int] = {}
        for key in keys:
            hops.update(dict.fromkeys(nodes.neighbors(caller, key, caller), 0))
        initial = list(hops)
        answered: dict[DHTID, list[DHTID]] = {key: [] for key in keys}

        async def get_neighbors(peer: DHTID, queries: list[DHTID]) -> dict:
            answers = {}
            results = []
            for key in queries:
                near = nodes.neighbors(peer, key, exclude)
                for node in near:
                    hops.setdefault(node, hops[peer] + 1)
                held = peer in self.holders[key]
                if held:
                    answered[key].append(peer)
                results.append((self.value_bytes(key) if held else 0, len(near)))
                # the latest value is wanted: never stop early (bounded: at a node storing the records)
                answers[key] = (tuple(near), bounded and peer in self.stored[key])
            nodes.rpc(caller, peer, nodes.wire.find(len(queries), client, results))
            return answers

        visited = {key: {caller} for key in keys}
        args = (keys, initial, BUCKET_SIZE, num_workers, per_call, get_neighbors)
        nearest, _ = await traverse_dht(*args, visited_nodes=visited)
        return nearest, answered, hops

    async def announce(self, server: DHTID, keys: list[DHTID]) -> None:
        """store_many of one record under `keys`: each key's NUM_REPLICAS nearest found (the server
        itself among them, without a message) store it; then cache_on_store's re-read of block keys."""
        models = keys == [self.models_key]
        nearest, _, _ = await self.lookup(server, keys, len(keys), int(len(keys) ** 0.5))
        for key in keys:
            for node in sorted([*nearest[key], server], key=key.xor_distance)[:NUM_REPLICAS]:
                self.holders[key].add(node)
                self.stored[key].add(node)
                if node != server:
                    self.nodes.rpc(server, node, self.nodes.wire.store(models))
        # its cache holds its block keys (it reads them every period): cache_on_store re-reads them now
        if not models and not self.bounded_reads:
            await self.read(server, keys, refresh=True)

    async def read(self, reader: DHTID, keys: list[DHTID], refresh: bool = False) -> None:
        """get_many_by_id of the latest values (or at bounded_reads' staleness); then the value found is
        cached (cache_nearest) on the nearest nodes that did not give it, unless the reader has it as new
        (it holds the key)."""
        per_call = min(int(len(keys) ** 0.5), CHUNK_SIZE)
        bounded = self.bounded_reads and not refresh
        nearest, answered, hops = await self.lookup(reader, keys, NUM_WORKERS, per_call, bounded)
        for key in keys:
            self.stats["keys_read"] += 1
            self.stats["hops"] += hops.get(nearest[key][0], 0) + 1
            truly = [node for node in self.nearest[key] if node != reader][:NUM_REPLICAS]
            self.stats["exact"] += nearest[key][:NUM_REPLICAS] == truly
            if refresh or not answered[key] or reader in self.holders[key]:
                continue
            for node in [node for node in nearest[key] if node != answered[key][0]][:CACHE_NEAREST]:
                self.holders[key].add(node)
                sizes = self.nodes.wire.store(False, self.value_bytes(key), not self.nodes.is_server(reader))
                self.nodes.rpc(reader, node, sizes)


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
    swarm = DhtSwarm(servers, seed, _wire(), bounded_reads)
    spans = _spans(servers, num_blocks, blocks_per_server, rng)
    tree = RecordTree.settled(PREFIX, num_blocks, spans, rounds=1, rng=rng)
    for key, peers in tree.cells.items():
        swarm.add_key(DHTID.generate(source=key), len(peers))
    listers = min(servers, MODEL_LISTERS)  # the servers that list the model (swarm/records/model_listing.py)
    swarm.add_key(swarm.models_key, listers)
    server_reads_per_minute = 60 / announce_period + 60 / BALANCE_PERIOD
    announces = servers * 60 / announce_period
    listings = listers * 60 / announce_period
    rates = np.array([announces, listings, servers * server_reads_per_minute, sessions_per_minute])
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
    announcement in its cells, its listing of the model, its walk down its own path (links and
    rebalancing), a new client's walk down a random path (a level's keys in one get_many each)."""
    nodes = swarm.nodes
    for _ in range(samples):
        server = rng.randrange(len(nodes.ids))
        nodes.initiator = nodes.ids[server]
        nodes.kind = KINDS.index("announce")
        await swarm.announce(nodes.initiator, swarm.ids(tree.keys_of(f"peer{server}")))
        nodes.kind = KINDS.index("models")
        await swarm.announce(nodes.initiator, [swarm.models_key])
        nodes.kind = KINDS.index("server_reads")
        reader = rng.randrange(len(nodes.ids))
        nodes.initiator = nodes.ids[reader]
        await _walk(swarm, tree.walk(tree.places[f"peer{reader}"].where), nodes.initiator, "server")
        nodes.kind = KINDS.index("client_reads")
        await _walk(swarm, tree.walk(None, CLIENT_CELLS, rng), DHTID(rng.getrandbits(BITS)), "client")


async def _walk(swarm: DhtSwarm, walk: Walk, reader: DHTID, who: str) -> None:
    """The reads of `walk`'s keys, a level at a time (one get_many each)."""
    swarm.stats[f"{who}_walks"] += 1
    swarm.stats[f"{who}_keys"] += sum(len(found) for found in walk.found)
    swarm.stats[f"{who}_servers"] += len(seen(walk))
    for level, found in enumerate(walk.found):
        keys = [cell_key(PREFIX, level, cell, block) for cell, block in found]
        await swarm.read(reader, swarm.ids(keys))


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
