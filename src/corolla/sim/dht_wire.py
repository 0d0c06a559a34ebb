"""The bytes of the messages hivemind's DHT sends (hivemind.proto.dht_pb2), for sim/dht.py: real protobuf
messages around one real signed record of each kind corolla stores (a busy server's ServerStatus under
a block key, a model's entry under MODELS_KEY), signed by an RSA-2048 identity as corolla's are, and
whole dictionaries built as hivemind's DictionaryDHTValue. Payloads only: libp2p's framing is left out.
"""

from __future__ import annotations

import functools
from dataclasses import replace

from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DictionaryDHTValue
from hivemind.dht.validation import DHTRecord
from hivemind.p2p import PeerID
from hivemind.proto import dht_pb2
from hivemind.utils import MSGPackSerializer, get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from corolla.swarm.p2p.identity import owned_subkey, peer_id_of_identity
from corolla.swarm.records.record_checks import record_validators
from corolla.version import __version__
from corolla.wire.records import ServerStatus, block_key

PREFIX = "Meta-Llama-3.1-405B-Instruct-hf"  # a dht_prefix of typical length
TTL = 75.0  # 2.5 announce periods
NODE_ID = DHTID.HASH_NBYTES


def _field(size: int) -> int:
    """Bytes of a length-delimited protobuf field: tag, varint length, payload."""
    return 1 + max(1, (size.bit_length() + 6) // 7) + size


class Wire:
    """Sizes of the DHT's messages: ping, find and store requests and their responses."""

    def __init__(self) -> None:
        key = RSAPrivateKey()
        peer_id = peer_id_of_identity(key)
        self.subkey = owned_subkey(peer_id, key)
        pings = tuple((peer_id, 0.0421) for _ in range(8))  # upkeep/link_monitor.py: MAX_LINKS round trips
        status = ServerStatus(
            0, 12, __version__, "bfloat16", 8192, 400_000, dht_prefix=PREFIX, model_fingerprint="f" * 16,
            max_batch_size=8, max_sessions_per_peer=16, max_passes_per_peer=64, cache_tokens_total=10**6,
            cache_bytes_per_token=262_144, num_sessions=3, queued_tokens=120, engine_passes=123_456,
            engine_rows=234_567, computed_tokens=9_876_543, throughput=12.34, precision="bfloat16",
            max_tree_tokens=64, encodings=("float16", "blockwise8"), next_pings=pings, device="cuda",
            device_name="NVIDIA GeForce RTX 4090", device_memory=25_757_220_864, reachability="direct",
        )  # fmt: skip
        status = replace(status, announced_at=get_dht_time(), announce_period=30.0)  # as the announcer does
        signer = record_validators(key, None)[0]
        model = {"dht_prefix": PREFIX, "num_blocks": 80}  # swarm/dht.py announce_model
        self.records = [self._sign(signer, value) for value in (status.to_dict(), model)]
        self.peer = PeerID.from_base58(peer_id).to_bytes()
        node = dht_pb2.NodeInfo(node_id=bytes(NODE_ID))
        self.node = {False: node, True: dht_pb2.NodeInfo()}  # by client mode: a client sends no node id
        self.ping = (
            dht_pb2.PingRequest(peer=node).ByteSize(),
            dht_pb2.PingResponse(peer=node, dht_time=get_dht_time()).ByteSize(),
        )
        self.stored = dht_pb2.StoreResponse(store_ok=[True], peer=node).ByteSize()

    def _sign(self, signer, value: dict) -> bytes:
        key = DHTID.generate(source=block_key(PREFIX, 0)).to_bytes()
        subkey = MSGPackSerializer.dumps(self.subkey)
        record = DHTRecord(key, subkey, MSGPackSerializer.dumps(value), get_dht_time() + TTL)
        return signer.sign_value(record)

    @functools.cache  # noqa: B019 (a Wire lives as long as the process: sim/dht.py keeps one)
    def value(self, entries: int, models: bool) -> int:
        """Bytes of a key's whole dictionary with `entries` servers' records, as a find returns it."""
        record = self.records[models]
        dictionary = DictionaryDHTValue()
        for i in range(entries):  # distinct subkeys of the real one's length
            dictionary.store(f"{i:07d}{self.subkey[7:]}", record, get_dht_time() + TTL)
        return len(MSGPackSerializer.dumps(dictionary))

    @functools.cache  # noqa: B019
    def _result(self, value: int, neighbors: int) -> int:
        found = dht_pb2.FOUND_DICTIONARY if value else dht_pb2.NOT_FOUND
        ids = {"nearest_node_ids": [bytes(NODE_ID)] * neighbors, "nearest_peer_ids": [self.peer] * neighbors}
        result = dht_pb2.FindResult(type=found, expiration_time=get_dht_time() if value else 0, **ids)
        return _field(result.ByteSize() + (_field(value) if value else 0))

    def find(self, keys: int, client: bool, results: list[tuple[int, int]]) -> tuple[int, int]:
        """(request, response) bytes of a find of `keys` keys; results: (value bytes, neighbors) each."""
        request = dht_pb2.FindRequest(keys=[bytes(NODE_ID)] * keys, peer=self.node[client]).ByteSize()
        return request, _field(self.node[False].ByteSize()) + sum(self._result(*r) for r in results)

    def store(self, models: bool, value: int = 0, client: bool = False) -> tuple[int, int]:
        """(request, response) bytes of a store of one signed record (an announce's), or of a whole
        dictionary of `value` bytes (a read's cache_nearest)."""
        subkey = DHTProtocol.IS_DICTIONARY if value else MSGPackSerializer.dumps(self.subkey)
        request = dht_pb2.StoreRequest(
            keys=[bytes(NODE_ID)], subkeys=[subkey], values=[b"" if value else self.records[models]],
            expiration_time=[get_dht_time()], in_cache=[value > 0], peer=self.node[client],
        )  # fmt: skip
        return request.ByteSize() + (_field(value) - _field(0) if value else 0), self.stored
