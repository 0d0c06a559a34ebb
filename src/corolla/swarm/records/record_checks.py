"""What a peer's DHT node accepts: signed records bound to their owner, and (private swarms) allowed peers.

hivemind's DHT runs every record it is asked to store, and every record a peer returns to a read, through
its validators. corolla gives each node two:

- `SignatureCheck`: hivemind's `RSASignatureValidator`. A record whose subkey names an owner key
  (`[owner:ssh-rsa ...]`) must carry that key's signature over key, subkey, value and expiration: only
  the owner can write, overwrite or expire it. It also signs this peer's own records.
- `OwnerCheck`: such a record's subkey must start with the peer id of that very key (swarm/p2p/identity.py),
  so a peer cannot sign records in another peer's name; in a private swarm the owner must be one of the
  allowed peers, and records without an owner are refused altogether.

Both count what they refuse (`RecordChecks.rejected`, read from the node's process by `rejected_counts`).
What passes is then read into typed records by the reader (`ServerStatus.from_dict`); records without
an owner are ignored there (a public swarm's nodes store them, nobody uses them).
"""

from __future__ import annotations

import logging
from collections import Counter

from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils.crypto import RSAPrivateKey

from corolla.swarm.p2p.identity import record_owner

logger = logging.getLogger(__name__)


class OwnerCheck(RecordValidatorBase):
    def __init__(self, allowed_peers: frozenset[str] | None = None):
        self.allowed_peers = allowed_peers
        self.rejected: Counter[str] = Counter()  # reason -> records refused (in the DHT node's process)

    def validate(self, record: DHTRecord) -> bool:
        subkey = None
        if record.subkey not in DHTProtocol.RESERVED_SUBKEYS:
            try:
                subkey = DHTProtocol.serializer.loads(record.subkey)
            except Exception:  # msgpack's errors on a garbled subkey
                return self._reject("malformed subkey")
        if not (isinstance(subkey, str) and "[owner:" in subkey):
            return self._reject("unsigned, private swarm") if self.allowed_peers is not None else True
        owner = record_owner(subkey)
        if owner is None:
            return self._reject("signed in another peer's name")
        if self.allowed_peers is not None and owner not in self.allowed_peers:
            return self._reject("owner not allowed")
        return True

    def _reject(self, reason: str) -> bool:
        self.rejected[reason] += 1
        logger.debug("Refusing a DHT record: %s", reason)
        return False


class SignatureCheck(RSASignatureValidator):
    """hivemind's signature validator, counting the records whose signature does not verify."""

    def __init__(self, private_key: RSAPrivateKey, owners: OwnerCheck):
        super().__init__(private_key)
        self.owners = owners

    def validate(self, record: DHTRecord) -> bool:
        if super().validate(record):
            return True
        self.owners.rejected["bad signature"] += 1
        return False


def record_validators(private_key: RSAPrivateKey, allowed_peers: frozenset[str] | None) -> list:
    owners = OwnerCheck(allowed_peers)
    return [SignatureCheck(private_key, owners), owners]


async def rejected_counts(dht: object, node: object) -> dict[str, int]:
    """(Run in the DHT's process through dht.run_coroutine.) Records its node refused, by reason."""
    owners = getattr(dht, "owner_check", None)
    return dict(owners.rejected) if owners is not None else {}
