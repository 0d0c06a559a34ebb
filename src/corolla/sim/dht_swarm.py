"""The swarm's DHT keys over simulated nodes (sim/dht_nodes.py): who holds each key, and the operations
corolla runs on them (a store of a record, a read of the latest values) through hivemind's own
`traverse_dht`, with DHTNode's defaults, corolla's 4 workers and its caching (swarm/dht.py CACHING). For
sim/dht.py, which prices what corolla's peers do."""

from __future__ import annotations

import heapq
from collections import Counter

from hivemind.dht.routing import DHTID
from hivemind.dht.traverse import traverse_dht

from corolla.sim.dht_nodes import BUCKET_SIZE, NODE_DEFAULTS, Nodes
from corolla.sim.dht_wire import Wire
from corolla.swarm.dht import CACHING, MODELS_KEY

NUM_REPLICAS = NODE_DEFAULTS["num_replicas"].default  # nodes that store each record
CACHE_NEAREST = CACHING["cache_nearest"]  # after a read, nodes that get the whole value (none: corolla's)
CHUNK_SIZE = NODE_DEFAULTS["chunk_size"].default
NUM_WORKERS = 4  # corolla's start_dht


class DhtSwarm:
    """The swarm's keys over its nodes: who holds each key, and the DHT operations corolla runs."""

    def __init__(self, servers: int, seed: int, wire: Wire, bounded_reads: bool = False, kinds: int = 1):
        self.nodes = Nodes(servers, seed, wire, kinds)  # `kinds`: of traffic, counted apart
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
        itself among them, without a message) store it (corolla's nodes keep no cache to re-read)."""
        models = keys == [self.models_key]
        nearest, _, _ = await self.lookup(server, keys, len(keys), int(len(keys) ** 0.5))
        for key in keys:
            for node in sorted([*nearest[key], server], key=key.xor_distance)[:NUM_REPLICAS]:
                self.holders[key].add(node)
                self.stored[key].add(node)
                if node != server:
                    self.nodes.rpc(server, node, self.nodes.wire.store(models))

    async def read(self, reader: DHTID, keys: list[DHTID]) -> None:
        """get_many_by_id of the latest values (or at bounded_reads' staleness); then the value found is
        cached on CACHE_NEAREST of the nearest nodes that did not give it (none: swarm/dht.py CACHING),
        unless the reader has it as new (it holds the key)."""
        per_call = min(int(len(keys) ** 0.5), CHUNK_SIZE)
        nearest, answered, hops = await self.lookup(reader, keys, NUM_WORKERS, per_call, self.bounded_reads)
        for key in keys:
            self.stats["keys_read"] += 1
            self.stats["hops"] += hops.get(nearest[key][0], 0) + 1
            truly = [node for node in self.nearest[key] if node != reader][:NUM_REPLICAS]
            self.stats["exact"] += nearest[key][:NUM_REPLICAS] == truly
            if not answered[key] or reader in self.holders[key]:
                continue
            for node in [node for node in nearest[key] if node != answered[key][0]][:CACHE_NEAREST]:
                self.holders[key].add(node)
                sizes = self.nodes.wire.store(False, self.value_bytes(key), not self.nodes.is_server(reader))
                self.nodes.rpc(reader, node, sizes)
