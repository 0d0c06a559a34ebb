"""A peer's identity: the libp2p RSA key behind its peer id, which also signs its DHT records.

hivemind's p2p daemon takes its identity from a file (a libp2p `PrivateKey` protobuf holding an RSA key,
written by `P2P.generate_identity`); the peer id is the hash of that key's public half. corolla reads the
same key to sign records with hivemind's `RSASignatureValidator`, whose records name their owner in the
subkey as `[owner:<ssh-rsa key>]`. A record's subkey here is `<peer id>[owner:<key>]`, so a reader checks
that the peer id is the key's own (`peer_id_of`): a record can be written only by the peer it names.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
from pathlib import Path

import multihash
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.p2p import P2P, PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils.crypto import RSAPrivateKey

from corolla.errors import InvalidRequest

OWNER_MARK = re.compile(r"^([1-9A-HJ-NP-Za-km-z]{32,64})\[owner:(ssh-rsa [A-Za-z0-9+/=]+)\]$")
MAX_ALLOWED_PEERS = 100_000


def load_identity(path: str | os.PathLike) -> RSAPrivateKey:
    """The RSA key of an identity file (created if missing, as hivemind's daemon would)."""
    path = Path(path)
    if not path.exists():
        P2P.generate_identity(str(path))
    try:
        key = crypto_pb2.PrivateKey.FromString(path.read_bytes())
    except Exception as e:  # protobuf's DecodeError, or an unreadable file
        raise InvalidRequest(f"identity {path} is not a libp2p private key file ({type(e).__name__})") from e
    if key.key_type != crypto_pb2.KeyType.RSA:
        raise InvalidRequest(
            f"identity {path} holds a {crypto_pb2.KeyType.Name(key.key_type)} key; corolla signs its DHT "
            "records with the peer's RSA key (delete the file to have a new one made)"
        )
    private = RSAPrivateKey.__new__(RSAPrivateKey)
    private.__setstate__({"_private_key": key.data})  # hivemind's own (pickling) path from DER bytes
    return private


def peer_id_of(ssh_public_key: bytes) -> str:
    """The libp2p peer id (base58) of an RSA public key in OpenSSH form, as the daemon derives it."""
    public = serialization.load_ssh_public_key(ssh_public_key)
    if not isinstance(public, rsa.RSAPublicKey):
        raise ValueError("not an RSA key")
    der = public.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
    digest = multihash.encode(hashlib.sha256(encoded).digest(), multihash.coerce_code("sha2-256"))
    return PeerID(digest).to_base58()


def peer_id_of_identity(key: RSAPrivateKey) -> str:
    return peer_id_of(key.get_public_key().to_bytes())


def owned_subkey(peer_id: str, key: RSAPrivateKey) -> str:
    """The subkey of a record signed by `key`: the owner's peer id and public key."""
    return f"{peer_id}[owner:{key.get_public_key().to_bytes().decode()}]"


@functools.lru_cache(maxsize=4096)
def record_owner(subkey: object) -> str | None:
    """The peer id a signed record's subkey names, if it is the id of the key it names; else None."""
    if not isinstance(subkey, str) or (match := OWNER_MARK.match(subkey)) is None:
        return None
    try:
        return match.group(1) if peer_id_of(match.group(2).encode()) == match.group(1) else None
    except ValueError:  # not a parseable RSA key
        return None


def read_allowed_peers(path: str | os.PathLike) -> frozenset[str]:
    """The peer ids of a private swarm: one base58 id per line; blank lines and `#` comments skipped."""
    peers = set()
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        try:
            PeerID.from_base58(text)
            if not OWNER_MARK.match(f"{text}[owner:ssh-rsa A]"):
                raise ValueError("not a base58 peer id")
        except ValueError as e:
            raise InvalidRequest(f"allowed peers {path}, line {number}: {text!r} is not a peer id") from e
        peers.add(text)
        if len(peers) > MAX_ALLOWED_PEERS:
            raise InvalidRequest(f"allowed peers {path} lists more than {MAX_ALLOWED_PEERS} peers")
    if not peers:
        raise InvalidRequest(f"allowed peers {path} lists no peer id")
    return frozenset(peers)
