"""The swarm's DHT, as client and server both use it: start a peer, store and read signed records (the
blocks' records: swarm/records/block_records.py).

hivemind's DHT runs its node in a child process; functions passed to `dht.run_coroutine` execute there,
so they are module-level (picklable) and return plain data. Every peer has an RSA identity (its own file,
or a new one per run) whose key signs the records it writes; its node refuses records signed in another
peer's name, or (a private swarm) by peers not allowed (swarm/records/record_checks.py). Every record read
back is validated again here: unsigned ones are ignored, the rest read into typed records
(`ServerStatus.from_dict`); what is refused is counted by reason (`tally`), never trusted.
"""

from __future__ import annotations

import logging
import os
import signal
import tempfile
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from hivemind.dht import DHT, DHTNode
from hivemind.p2p import P2PDaemonError
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from corolla.config import SwarmConfig
from corolla.errors import StartFailed
from corolla.swarm.nat import dial_back
from corolla.swarm.nat.reachability import p2p_options, relays_for_others
from corolla.swarm.nat.relay_service import (
    expected,
    keep_own_limits,
    limit_relaying,
    refuse_relaying,
    relay_limit_flags,
)
from corolla.swarm.p2p import p2p_io
from corolla.swarm.p2p.addresses import check_listen_port, explain_start_failure
from corolla.swarm.p2p.daemons import identity_taken, watch_parent
from corolla.swarm.p2p.identity import load_identity, owned_subkey, peer_id_of_identity, record_owner
from corolla.swarm.records.record_checks import OwnerCheck, record_validators, rejected_counts
from corolla.wire.records import ServerStatus

logger = logging.getLogger(__name__)

MODELS_KEY = "corolla.models"  # subkey = a server's (signed), value = {"dht_prefix": ..., "num_blocks": N}
MAX_MODEL_BLOCKS = 1024
# a client's DHT node returns once an initial peer answered and this long has passed, and looks for the
# nodes nearest to it in the background (hivemind waits up to 3 s for those: for every node in its
# initial peers' routing tables that no longer answers, a server gone or restarted behind NAT)
CLIENT_BOOTSTRAP_S = 0.1
# every read of corolla's wants the latest records (`read_records`), so hivemind's caches never end one
# early: they only cost bytes, a copy of each value found sent to a node near its key (cache_nearest) and,
# for a key a peer stores under after reading it (a server's blocks' keys), a re-read of the whole key at
# every store (cache_on_store): sim/dht.py prices both
CACHING = {"cache_locally": False, "cache_on_store": False, "cache_nearest": 0}


def start_dht(config: SwarmConfig, identity_checked: bool = False, unconfirmed: bool = False) -> PeerDHT:
    """Start a DHT peer (its own process plus a libp2p daemon) and wait until it is ready: `spawn_dht`, then
    its `ready()`."""
    return spawn_dht(config, identity_checked, unconfirmed).ready()


def spawn_dht(config: SwarmConfig, identity_checked: bool = False, unconfirmed: bool = False) -> Spawning:
    """Fork a DHT peer's process, which starts its libp2p daemon and joins; `ready()` waits for that.

    One that relays for others has its relay's limits checked (swarm/nat/relay_service.py). Every peer but a
    client answers other peers' dial-back requests (swarm/nat/dial_back.py). `identity_checked`: a restart
    of a peer that checked its identity was free (it may still look taken to the others for a while).
    `unconfirmed`: its DHT node stays out of others' routing tables (as a client's) until
    swarm/nat/joining.py's `publish`."""
    p2p_io.install()
    check_listen_port(config.host, config.port)
    # a peer behind NAT must not hold records others need (swarm/nat/reachability.py)
    client_mode = config.client_mode or config.reachability == "behind-nat"
    # an unconfirmed one only looks like a client to the DHT: its daemon is a public peer's
    daemon_mode = {"dht_mode": "server"} if unconfirmed and not client_mode else {}
    identity = ExitStack()  # a temporary identity's folder stays until the daemon has read it
    path, fresh = identity.enter_context(_identity_file(config.identity_path))
    try:
        with _explained_failure(config):
            key = load_identity(path)
            validators = record_validators(key, config.allowed_peers)
            if not fresh and config.initial_peers and not identity_checked:  # hivemind's ignores nat_port_map
                _check_identity_free(path, config)
            dht = PeerDHT(
                key,
                validators,
                initial_peers=list(config.initial_peers) or None,
                start=False,
                client_mode=client_mode or unconfirmed,
                host_maddrs=config.host_maddrs,
                announce_maddrs=config.announce_maddrs,
                identity_path=str(path),
                check_if_identity_free=False,  # checked above
                nat_port_map=config.use_nat_port_map,
                num_workers=4,
                **CACHING,
                bootstrap_timeout=CLIENT_BOOTSTRAP_S if config.client_mode else None,
                relay_flags=relay_limit_flags(config),
                relay_limits=expected(config) if relays_for_others(config) else None,
                **p2p_options(config),
                **daemon_mode,
            )
            dht.run_in_background(await_ready=False)
    except BaseException:
        identity.close()
        raise
    return Spawning(dht, config, identity)


@contextmanager
def _explained_failure(config: SwarmConfig) -> Iterator[None]:
    """The libp2p daemon's failure to start, told as what to change (a port in use, an unreachable peer)."""
    try:
        yield
    except P2PDaemonError as e:
        raise explain_start_failure(e, config.host, config.port, config.initial_peers) from None


class Spawning:
    """A DHT peer whose process is starting. Forking copies the locks other threads hold at that moment:
    a fork while another thread loads weights left the child waiting forever on one of torch's, so a
    caller with other work forks first (`spawn_dht`), works, then waits (`ready`)."""

    def __init__(self, dht: PeerDHT, config: SwarmConfig, identity: ExitStack):
        self.dht = dht
        self.config = config
        self._identity = identity

    def ready(self) -> PeerDHT:
        config = self.config
        with self._identity, _explained_failure(config):
            self.dht.wait_until_ready()
        if not config.client_mode:
            self.dht.run_coroutine(dial_back.serve)
            if not config.relay:
                self.dht.run_coroutine(refuse_relaying)
        return self.dht


def _check_identity_free(path: Path, config: SwarmConfig) -> None:
    taken = identity_taken(path, config.initial_peers, config.host_maddrs, config.use_nat_port_map)
    if taken:
        raise StartFailed(f"the identity in {path} is in use by another peer of this swarm now")


@contextmanager
def _identity_file(path: str | None) -> Iterator[tuple[Path, bool]]:
    """(the identity file, whether it is new): the given one, or a new key in a private folder that is
    removed once the daemon has read it."""
    if path is not None:
        yield Path(path), not Path(path).exists()
        return
    with tempfile.TemporaryDirectory(prefix="corolla-identity-") as folder:
        yield Path(folder) / "identity.key", True


class PeerDHT(DHT):
    """hivemind's DHT, whose child process does not keep the signal handlers of the process it forked from.

    A forked child inherits its parent's Python handlers and asyncio's wakeup fd: the child of a server or
    of `corolla dht` then caught the SIGTERM that `timeout` or systemd send to the whole process group,
    wrote it into the parent's event loop (a second signal there: no drain) and never exited, not even on
    DHT.shutdown()'s SIGTERM, so the parent hung at exit joining it. SIGTERM and SIGHUP end the child
    (its libp2p daemon exits with it); SIGINT stays ignored (hivemind's choice), the parent stops it.
    A parent that dies without stopping it (kill -9) takes it and its daemon along (swarm/p2p/daemons.py).

    A peer's relay limits reach its daemon from the child (swarm/nat/relay_service.py `limit_relaying`).
    It also holds the peer's identity key (`subkey`: what its records are signed under) and its node's
    record checks, whose counters `rejected_records` reads from the child.
    """

    def __init__(
        self,
        key: RSAPrivateKey,
        validators: list,
        relay_flags: dict | None = None,
        relay_limits: tuple[int, int] | None = None,
        **kwargs,
    ):
        self.parent_pid = os.getpid()  # the child ends itself when this process is gone (kill -9)
        self.relay_flags = relay_flags or {}  # the daemon's relay limits (swarm/nat/relay_service.py)
        self.relay_limits = relay_limits  # those its relay must grant (None: it relays for nobody)
        self.identity = key
        self.owner_check = next(v for v in validators if isinstance(v, OwnerCheck))
        super().__init__(record_validators=validators, **kwargs)

    @property
    def subkey(self) -> str:
        """The subkey of this peer's records: its peer id and the public key they are signed with."""
        return owned_subkey(peer_id_of_identity(self.identity), self.identity)

    def run(self) -> None:
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        watch_parent(self.parent_pid)
        if self.relay_flags:
            limit_relaying(self.relay_flags)
        if self.relay_limits is not None:
            keep_own_limits(self.relay_limits)
        super().run()


def visible_addresses(dht: DHT) -> list[str]:
    return [str(addr) for addr in dht.get_visible_maddrs()]


@dataclass(frozen=True, slots=True)
class RemoteSpan:
    """A server seen in the DHT, with the blocks it announces."""

    peer_id: str
    start: int
    end: int
    info: ServerStatus
    level: int = 0  # the level of the records' tree it was found at (swarm/records/record_cells.py)

    @property
    def length(self) -> int:
        return self.end - self.start


async def announce_model(dht: PeerDHT, dht_prefix: str, num_blocks: int, expiration: float) -> bool:
    """List the model under MODELS_KEY, so that tools (`corolla status`) find it without being told (by a
    few of its servers: swarm/records/model_listing.py)."""
    value = {"dht_prefix": dht_prefix, "num_blocks": num_blocks}
    store = partial(store_records, keys=[MODELS_KEY], subkey=dht.subkey, value=value, ttl=expiration)
    return await dht.run_coroutine(store, return_future=True)


async def find_models(dht: DHT, tally: Counter | None = None) -> dict[str, dict[str, int]]:
    """The models servers have announced recently: DHT prefix -> {peer id of the signer: number of
    blocks it claims}. Claims, not facts: any peer can sign one (swarm/records/overview.py's
    `confirmed_models` keeps those of servers that answer)."""
    found = await dht.run_coroutine(partial(read_records, keys=[MODELS_KEY]), return_future=True)
    tally = Counter() if tally is None else tally
    models: dict[str, dict[str, int]] = {}
    for subkey, value in found.get(MODELS_KEY, {}).items():
        if (peer_id := signer_of(subkey, tally)) is None:
            continue
        value = value if isinstance(value, dict) else {}
        prefix = value.get("dht_prefix")
        blocks = value.get("num_blocks")
        if (
            isinstance(prefix, str)
            and 0 < len(prefix) <= 256
            and isinstance(blocks, int)
            and not isinstance(blocks, bool)
            and 0 < blocks <= MAX_MODEL_BLOCKS
        ):
            models.setdefault(prefix, {})[peer_id] = blocks
        else:
            tally["malformed"] += 1
    return dict(sorted(models.items()))


def signer_of(subkey: str, tally: Counter) -> str | None:
    """The peer that signed a record (its node checked the signature), or None: counted and ignored."""
    owner = record_owner(subkey)
    if owner is None:
        tally["unsigned"] += 1
    return owner


async def rejected_records(dht: DHT) -> dict[str, int]:
    """Records this peer's DHT node refused (bad signatures, another peer's name, not allowed), by reason."""
    return await dht.run_coroutine(rejected_counts, return_future=True)


async def store_records(
    dht: DHT, node: DHTNode, keys: list[str], subkey: str, value: dict, ttl: float
) -> bool:
    expiration = get_dht_time() + ttl
    result = await node.store_many(
        keys, [value] * len(keys), expiration, subkeys=[subkey] * len(keys), num_workers=len(keys)
    )
    return all(result.values())


async def read_records(dht: DHT, node: DHTNode, keys: list[str]) -> dict[str, dict[str, object]]:
    found = await node.get_many(keys, sufficient_expiration_time=float("inf"))
    result: dict[str, dict[str, object]] = {}
    for key, entry in found.items():
        if entry is None or not isinstance(entry.value, dict):
            continue
        result[key] = {str(subkey): item.value for subkey, item in entry.value.items()}
    return result
