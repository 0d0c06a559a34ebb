"""Identities and the records they sign: peer ids from keys, owner checks, allow lists, node validators."""

from __future__ import annotations

import dataclasses

import pytest
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import CompositeValidator, DHTRecord
from hivemind.p2p import PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils import MSGPackSerializer

from corolla.errors import InvalidRequest
from corolla.swarm.p2p.identity import (
    load_identity,
    owned_subkey,
    peer_id_of_identity,
    read_allowed_peers,
    record_owner,
)
from corolla.swarm.records.record_checks import record_validators


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    """Two peers' identity files and keys: the honest server's and a forger's."""
    folder = tmp_path_factory.mktemp("identities")
    return {name: (folder / name, load_identity(folder / name)) for name in ("server", "forger")}


def test_a_new_identity_file_gives_the_daemons_peer_id(keys):
    path, key = keys["server"]
    assert path.exists()
    assert peer_id_of_identity(key) == PeerID.from_identity(path.read_bytes()).to_base58()
    assert peer_id_of_identity(load_identity(path)) == peer_id_of_identity(key)  # read back, same id


def test_an_identity_of_another_key_type_is_refused_by_name(tmp_path):
    path = tmp_path / "ed25519.key"
    path.write_bytes(
        crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.Ed25519, data=b"x" * 64).SerializeToString()
    )
    with pytest.raises(InvalidRequest, match="holds a Ed25519 key"):
        load_identity(path)
    (tmp_path / "garbage.key").write_bytes(b"\xff\x00 not a key")
    with pytest.raises(InvalidRequest, match="not a libp2p private key file"):
        load_identity(tmp_path / "garbage.key")


def test_a_subkey_names_its_owner_only_with_the_owners_own_key(keys):
    server, forger = keys["server"][1], keys["forger"][1]
    server_id = peer_id_of_identity(server)
    assert record_owner(owned_subkey(server_id, server)) == server_id
    assert record_owner(owned_subkey(server_id, forger)) is None  # the forger's key in the server's name
    assert record_owner(server_id) is None  # unsigned
    assert record_owner(owned_subkey(server_id, server).replace("AAAA", "AAAB", 1)) is None  # garbled key
    assert record_owner(7) is None


def test_allowed_peers_files(tmp_path, keys):
    ids = [peer_id_of_identity(key) for _, key in keys.values()]
    good = tmp_path / "peers.txt"
    good.write_text(f"# the swarm\n{ids[0]}  # server\n\n{ids[1]}\n")
    assert read_allowed_peers(good) == frozenset(ids)
    bad = tmp_path / "bad.txt"
    bad.write_text(f"{ids[0]}\nnot-a-peer-id\n")
    with pytest.raises(InvalidRequest, match=r"line 2: 'not-a-peer-id' is not a peer id"):
        read_allowed_peers(bad)
    empty = tmp_path / "empty.txt"
    empty.write_text("# nobody\n")
    with pytest.raises(InvalidRequest, match="lists no peer id"):
        read_allowed_peers(empty)


def signed(validator: CompositeValidator, subkey: str, value: dict, expiration: float = 1e10) -> DHTRecord:
    """A record as a DHT node stores it: serialized, signed by whichever key the validator holds."""
    record = DHTRecord(
        DHTID.generate(source="model.0").to_bytes(),
        DHTProtocol.serializer.dumps(subkey),
        MSGPackSerializer.dumps(value),
        expiration,
    )
    return dataclasses.replace(record, value=validator.sign_value(record))


def node(key, allowed=None):
    validators = record_validators(key, allowed)
    return CompositeValidator(validators), validators[1]


def test_nodes_take_records_only_from_their_owners(keys):
    server, forger = keys["server"][1], keys["forger"][1]
    server_id, forger_id = peer_id_of_identity(server), peer_id_of_identity(forger)
    server_node, _ = node(server)
    forger_node, _ = node(forger)
    honest_node, checks = node(keys["server"][1])  # any node's view: validation needs no private key
    record = signed(server_node, owned_subkey(server_id, server), {"start": 0})
    assert honest_node.validate(record)
    # the forger rewrites the server's record (same subkey): the signature no longer matches
    signature = record.value[len(MSGPackSerializer.dumps({"start": 0})) :]
    overwritten = dataclasses.replace(record, value=MSGPackSerializer.dumps({"start": 5}) + signature)
    assert not honest_node.validate(overwritten)
    # ... or signs, with its own key, a record in the server's name
    assert not honest_node.validate(signed(forger_node, owned_subkey(server_id, forger), {"start": 0}))
    # its own records are fine: a record alone does not make a server (clients ping before routing)
    assert honest_node.validate(signed(forger_node, owned_subkey(forger_id, forger), {"start": 0}))
    # unsigned records are stored (a public swarm's readers ignore them)
    assert honest_node.validate(signed(forger_node, server_id, {"start": 0}))
    assert checks.rejected == {"bad signature": 1, "signed in another peer's name": 1}


def test_a_private_swarms_nodes_take_only_allowed_owners(keys):
    server, forger = keys["server"][1], keys["forger"][1]
    server_id, forger_id = peer_id_of_identity(server), peer_id_of_identity(forger)
    private, checks = node(server, frozenset({server_id}))
    forger_node, _ = node(forger)
    assert private.validate(signed(private, owned_subkey(server_id, server), {"start": 0}))
    assert not private.validate(signed(forger_node, owned_subkey(forger_id, forger), {"start": 0}))
    assert not private.validate(signed(forger_node, server_id, {"start": 0}))
    assert checks.rejected == {"owner not allowed": 1, "unsigned, private swarm": 1}
