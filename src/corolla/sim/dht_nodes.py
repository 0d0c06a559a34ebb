"""The simulated DHT's nodes (sim/dht.py): their ids, their routing tables (hivemind's RoutingTable, in
Kademlia's steady state) and what each one sends and receives. A request and its response update both
sides' tables as hivemind's DHTProtocol does, with the pings that sets off. Servers are DHT nodes;
a client (client mode) has a table of its own, but sends no node id, so nobody adds it.
"""

from __future__ import annotations

import bisect
import inspect
import random
from collections import Counter

import numpy as np
from hivemind.dht.node import DHTNode
from hivemind.dht.routing import DHTID, RoutingTable

from corolla.sim.dht_wire import Wire

NODE_DEFAULTS = inspect.signature(DHTNode.create).parameters
BUCKET_SIZE = NODE_DEFAULTS["bucket_size"].default  # k, and the beam of every lookup
DEPTH_MODULO = NODE_DEFAULTS["depth_modulo"].default
BITS = DHTID.HASH_NBYTES * 8
MAX_CHAIN = 100_000  # pings one contact may set off (a bound for safety: chains end long before)


class Nodes:
    """`servers` DHT nodes with random ids; counts by kind of traffic (`kind`: the one simulated now)."""

    def __init__(self, servers: int, seed: int, wire: Wire, kinds: int):
        rng = random.Random(seed)
        self.seed = seed
        self.wire = wire
        self.ids = sorted(DHTID(rng.getrandbits(BITS)) for _ in range(servers))
        self.index = {node: i for i, node in enumerate(self.ids)}
        self.tables: dict[DHTID, RoutingTable] = {}
        self.answers: dict[DHTID, dict] = {}  # a table's get_nearest_neighbors, while its buckets stay
        self.counts = np.zeros((kinds, 4, servers))  # [kind, (messages, sent, received, pings), server]
        self.clients = np.zeros((kinds, 4))  # the same, summed over clients
        self.own = np.zeros((kinds, 4))  # the same, of the servers that started the operations
        self.kind = 0
        # how many times the operation simulated now counts (a read made by some walks only)
        self.weight = 1.0
        self.initiator: DHTID | None = None  # the server whose operation is simulated now
        self.rpcs: Counter[int] = Counter()  # requests by kind, pings apart
        self.pings = 0
        self.largest = 0  # bytes of the largest message

    def is_server(self, node: DHTID) -> bool:
        return node in self.index

    def table(self, node: DHTID) -> RoutingTable:
        """`node`'s table in steady state: each bucket holds min(k, nodes in its range), met at random,
        added by hivemind's own add_or_update_node (so its buckets split as a real node's do)."""
        if node in self.tables:
            return self.tables[node]
        table = self.tables[node] = RoutingTable(node, BUCKET_SIZE, DEPTH_MODULO)
        rng = random.Random(int(node) ^ self.seed)
        region = (0, len(self.ids))  # the ids sharing the first `depth` bits with the node, sorted
        depth = 0
        while region[1] - region[0] > BUCKET_SIZE and depth < BITS:
            depth += DEPTH_MODULO
            width = 1 << (BITS - depth)
            base = node >> (BITS - depth + DEPTH_MODULO) << (BITS - depth + DEPTH_MODULO)
            for start in range(base, base + (width << DEPTH_MODULO), width):  # this depth's buckets
                a = bisect.bisect_left(self.ids, start, *region)
                b = bisect.bisect_left(self.ids, start + width, *region)
                if start <= node < start + width:
                    own = (a, b)
                else:
                    self._fill(table, rng.sample(range(a, b), min(b - a, BUCKET_SIZE)))
            region = own
        self._fill(table, range(*region))
        return table

    def _fill(self, table: RoutingTable, indices) -> None:
        for node in (self.ids[i] for i in indices):
            if node != table.node_id:
                table.add_or_update_node(node, node)  # its "peer id": the node id itself

    def neighbors(self, node: DHTID, key: DHTID, exclude: DHTID) -> list[DHTID]:
        """`node`'s k nearest to `key` but `exclude`: get_nearest_neighbors(key, k, exclude) takes the
        k + 1 nearest and drops `exclude`; remembered until the table's buckets change."""
        answers = self.answers.setdefault(node, {})
        if key not in answers:
            answers[key] = [n for n, _ in self.table(node).get_nearest_neighbors(key, BUCKET_SIZE + 1)]
        return [n for n in answers[key] if n != exclude][:BUCKET_SIZE]

    def rpc(self, caller: DHTID, callee: DHTID, sizes: tuple[int, int]) -> None:
        """One request of `sizes[0]` bytes and its response; both sides update their tables."""
        self._count(caller, *sizes)
        self._count(callee, *reversed(sizes))
        self.largest = max(self.largest, *sizes)
        self.rpcs[self.kind] += self.weight
        if self.is_server(caller):  # rpc_find / rpc_store: the callee's update (rpc_ping)
            self._meet(callee, caller)
        self._meet(caller, callee)

    def _count(self, node: DHTID, sent: int, received: int, pings: int = 0) -> None:
        i = self.index.get(node)
        if node == self.initiator:  # every server starts as many: their cost is shared out evenly
            row = self.own[self.kind]
        else:
            row = self.clients[self.kind] if i is None else self.counts[self.kind, :, i]
        row += np.multiply((2, sent, received, pings), self.weight)

    def _meet(self, owner: DHTID, other: DHTID) -> None:
        """update_routing_table: a node that does not fit its full bucket makes the owner ping the
        bucket's oldest node, which meets its pinger in turn (rpc_ping)."""
        pending = [(owner, other)]
        for _ in range(MAX_CHAIN):
            if not pending:
                return
            owner, other = pending.pop()
            table = self.table(owner)
            known = other in table
            stale = table.add_or_update_node(other, other)
            if stale is None:
                if not known:  # a bucket had room: its members changed
                    self.answers.pop(owner, None)
                continue
            self._count(owner, *self.wire.ping, pings=2)
            self._count(stale[0], *reversed(self.wire.ping), pings=2)
            self.pings += 1
            table.add_or_update_node(*stale)  # it answered: back to its bucket's tail
            if self.is_server(owner):
                pending.append((stale[0], owner))
