"""The DHT cost simulation (corolla.sim.dht): hivemind's own lookups over simulated routing tables find
the nodes truly nearest to a key, in a number of requests that grows far slower than the swarm; message
sizes match the protobufs hivemind would send; the records' tree keeps a cell's value and a walk's read
bounded as the swarm grows; a seed gives the same numbers again."""

from __future__ import annotations

import asyncio

import pytest
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DictionaryDHTValue
from hivemind.proto import dht_pb2
from hivemind.utils import MSGPackSerializer, get_dht_time

from corolla.sim.dht import _wire, dht_traffic
from corolla.sim.dht_nodes import BUCKET_SIZE
from corolla.sim.dht_swarm import NUM_REPLICAS, DhtSwarm
from corolla.sim.dht_wire import PREFIX
from corolla.swarm.records.record_cells import CELL_SERVERS
from corolla.wire.records import block_key

KEYS = [DHTID.generate(source=block_key(PREFIX, block)) for block in range(8)]


@pytest.fixture(scope="module")
def wire():
    return _wire()


def swarm_of(servers: int, wire, servers_per_key: int = 10) -> DhtSwarm:
    swarm = DhtSwarm(servers, 0, wire)
    for key in KEYS:
        swarm.add_key(key, servers_per_key)
    return swarm


def test_lookups_reach_the_nodes_nearest_to_each_key(wire):
    swarm = swarm_of(200, wire)
    reader = swarm.nodes.ids[17]
    nearest, answered, _ = asyncio.run(swarm.lookup(reader, KEYS, 4, 2))
    for key in KEYS:
        others = [node for node in swarm.nodes.ids if node != reader]
        truly = sorted(others, key=key.xor_distance)[:BUCKET_SIZE]
        assert nearest[key] == truly
        # the key's NUM_REPLICAS nearest store it, and each of them answered once, with its value
        assert sorted(answered[key]) == sorted(swarm.holders[key] - {reader})
        assert len(swarm.holders[key]) == NUM_REPLICAS


def test_requests_per_lookup_grow_far_slower_than_the_swarm(wire):
    rpcs = {}
    for servers in (100, 1000):
        swarm = swarm_of(servers, wire)
        asyncio.run(swarm.read(swarm.nodes.ids[0], KEYS))
        rpcs[servers] = sum(swarm.nodes.rpcs.values())
        assert swarm.stats["exact"] == len(KEYS)  # every read found the key's true nearest nodes
    assert rpcs[100] < rpcs[1000] < 3 * rpcs[100]


def test_a_read_at_a_bounded_staleness_takes_one_copy_where_the_latest_takes_every_one(wire):
    """A read of the latest value (corolla's) visits the key's whole beam and receives the value from every
    node storing it; one at a bounded staleness (bench/swarm/dht.py --bounded-reads) ends at the first
    (requests already in flight to others still bring theirs)."""
    copies, received = {}, {}
    for bounded in (False, True):
        swarm = swarm_of(1000, wire)
        reader = swarm.nodes.ids[3]
        _, answered, _ = asyncio.run(swarm.lookup(reader, KEYS, 4, 2, bounded=bounded))
        assert all(answered[key] and answered[key][0] in swarm.stored[key] for key in KEYS)
        copies[bounded] = sum(len(answered[key]) for key in KEYS)
        received[bounded] = swarm.nodes.counts[0, 2, 3]  # bytes the reader received
    assert copies[False] == NUM_REPLICAS * len(KEYS) and copies[True] < copies[False] / 2
    assert received[True] < received[False] / 2


def test_message_sizes_are_those_of_hivemind_protobufs(wire):
    dictionary = MSGPackSerializer.loads(MSGPackSerializer.dumps(_dictionary(wire, 3)))
    value = MSGPackSerializer.dumps(dictionary)
    assert wire.value(3, False) == len(value)
    node = dht_pb2.NodeInfo(node_id=bytes(20))
    result = dht_pb2.FindResult(
        type=dht_pb2.FOUND_DICTIONARY, value=value, expiration_time=get_dht_time(),
        nearest_node_ids=[bytes(20)] * BUCKET_SIZE, nearest_peer_ids=[wire.peer] * BUCKET_SIZE,
    )  # fmt: skip
    empty = dht_pb2.FindResult(nearest_node_ids=[bytes(20)] * 3, nearest_peer_ids=[wire.peer] * 3)
    response = dht_pb2.FindResponse(results=[result, empty], peer=node)
    request = dht_pb2.FindRequest(keys=[bytes(20)] * 2, peer=node)
    assert wire.find(2, False, [(len(value), BUCKET_SIZE), (0, 3)]) == (
        request.ByteSize(),
        response.ByteSize(),
    )
    cache = dht_pb2.StoreRequest(
        keys=[bytes(20)], subkeys=[DHTProtocol.IS_DICTIONARY], values=[value],
        expiration_time=[get_dht_time()], in_cache=[True], peer=dht_pb2.NodeInfo(),
    )  # fmt: skip
    assert wire.store(False, len(value), client=True)[0] == cache.ByteSize()


def _dictionary(wire, entries: int):
    dictionary = DictionaryDHTValue()
    for i in range(entries):
        dictionary.store(f"{i:07d}{wire.subkey[7:]}", wire.records[0], get_dht_time() + 60)
    return dictionary


def test_a_cells_value_stays_bounded_while_the_swarm_grows(wire):
    small = dht_traffic(60, num_blocks=8, blocks_per_server=2, samples=2)  # 15 servers a block
    large = dht_traffic(600, num_blocks=8, blocks_per_server=2, samples=2)  # 150
    assert small["records_tree"]["deepest_level"] == 0  # one key a block, read whole
    assert small["records_tree"]["server_read"]["servers_seen"] == 60
    assert large["records_tree"]["deepest_level"] >= 2
    assert large["value_bytes_per_block_key"]["max"] <= wire.value(2 * CELL_SERVERS + 4, False)
    assert large["records_tree"]["server_read"]["servers_seen"] < 0.8 * 600  # a walk reads a sample
    assert large["records_tree"]["server_read"]["keys"] <= 8 + large["records_tree"]["deepest_level"]
    growth = large["per_peer_per_minute"]["bytes"]["mean"] / small["per_peer_per_minute"]["bytes"]["mean"]
    assert growth < 4  # ten times the servers (a key a block: about ten times the bytes)
    # the nodes that hold cells serve every read of them: the busiest peer holds some
    assert large["per_peer_per_minute"]["bytes"]["max"] > 2 * large["per_peer_per_minute"]["bytes"]["mean"]
    assert large["hottest_peer_holds_keys"] > 0


def test_the_same_seed_gives_the_same_numbers():
    first = dht_traffic(60, num_blocks=8, blocks_per_server=3, samples=2, seed=3)
    assert dht_traffic(60, num_blocks=8, blocks_per_server=3, samples=2, seed=3) == first
    assert dht_traffic(60, num_blocks=8, blocks_per_server=3, samples=2, seed=4) != first


def test_the_busiest_peers_reads_do_not_grow_with_the_swarm():
    """Servers' walks read each level of their path at read_chance (block_records.KeptPath), so the peers
    nearest to a key of the tree serve as many reads in a swarm of 800 as of 100 (reading every key at every
    walk, they served 8 times as many)."""
    busiest = {}
    for servers in (100, 800):
        kinds = dht_traffic(servers, num_blocks=8, blocks_per_server=2, samples=4)["per_peer_per_minute"]
        busiest[servers] = {
            kind: kinds["bytes_by_kind"][kind]["max"] for kind in ("server_root_reads", "server_reads")
        }
    assert busiest[800]["server_root_reads"] < 1.5 * busiest[100]["server_root_reads"]
    assert busiest[800]["server_reads"] < 1.5 * busiest[100]["server_root_reads"]  # the deeper cells' too
