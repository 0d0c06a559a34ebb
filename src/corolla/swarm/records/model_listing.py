"""Which servers of a model list it under the models key (swarm/dht.py MODELS_KEY): a fixed few, so that
the key's value stays small however large the swarm. With every server listing its model the value grew
with the swarm, past hivemind's 4 MiB message limit at 10,000 servers (corolla sim: sim/dht.py)."""

from __future__ import annotations

import hashlib
from collections.abc import Collection

MODEL_LISTERS = 32


def lists_model(peer_id: str, dht_prefix: str, servers: Collection[str]) -> bool:
    """Whether this server is one of the MODEL_LISTERS servers of its model that list it: those whose hash
    of (prefix, peer id) is lowest among the `servers` it last read (so servers reading about the same
    swarm decide alike, and no coordination is needed); every server while it knows too few."""
    known = set(servers) | {peer_id}
    if len(known) <= MODEL_LISTERS:
        return True

    def rank(peer: str) -> bytes:
        return hashlib.sha256(f"{dht_prefix}/{peer}".encode()).digest()

    mine = rank(peer_id)
    return sum(rank(peer) < mine for peer in known) < MODEL_LISTERS
