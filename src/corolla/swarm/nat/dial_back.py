"""Whether other peers can dial this one: a few peers are asked to dial it back (no central service).

Every peer that holds a DHT node (servers, `corolla dht`) answers `DIAL_BACK`: it opens a new TCP
connection to the asking peer and checks that a libp2p listener answers there (the multistream header
every libp2p TCP listener sends first). It dials only the address the asker's live connection comes from
(the IP its router shows) at no more than MAX_PORTS ports the asker names, at most MAX_PER_HOST times a
minute per address and MAX_DIALS at once, so nobody can make it dial an address of their choosing or flood
one. A peer whose connection arrives through a relay has no address to dial: the answer says so.

libp2p's AutoNAT does the same inside the daemon, but hivemind's daemon neither reports what it found nor
lets a peer change its DHT mode after start; asking in corolla's own RPC gives an answer the server can
act on at start (swarm/nat/joining.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from hivemind.dht import DHT, DHTNode
from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.proto import runtime_pb2

from corolla.errors import InvalidRequest
from corolla.wire.fields import pack, unpack

logger = logging.getLogger(__name__)

DIAL_BACK = "corolla.dial_back"
MAX_PORTS = 4
MAX_HOSTS = 2  # addresses of one asker dialed (an IPv4 and an IPv6 one, say)
MAX_PER_HOST = 4  # requests per minute from one address
MAX_DIALS = 8  # dials in flight at one answering peer
DIAL_TIMEOUT = 3.0
ASK_TIMEOUT = 10.0
LIBP2P_HEADER = b"\x13/multistream/1.0.0\n"  # what a libp2p TCP listener sends on accepting


@dataclass(frozen=True, slots=True)
class Answer:
    """One peer's answer: the addresses it dialed and those where a libp2p listener answered."""

    tried: tuple[str, ...] = ()
    dialed: tuple[str, ...] = ()
    refused: str | None = None  # why it did not dial (no direct connection, too many requests)

    def to_bytes(self) -> bytes:
        return pack({"tried": list(self.tried), "dialed": list(self.dialed), "refused": self.refused})

    @classmethod
    def from_bytes(cls, raw: bytes) -> Answer:
        fields = unpack(raw, "dial-back answer")
        addresses = {}
        for name in ("tried", "dialed"):
            items = fields.list(name, max_items=MAX_PORTS * MAX_HOSTS)
            if not all(isinstance(item, str) and len(item) <= 128 for item in items):
                raise fields.error(name, "must hold addresses (strings of at most 128 characters)")
            addresses[name] = tuple(items)
        return cls(addresses["tried"], addresses["dialed"], fields.str("refused", max_chars=256))


def read_ports(raw: bytes) -> tuple[int, ...]:
    """The ports a request names (1..65535, at most MAX_PORTS)."""
    fields = unpack(raw, "dial-back request")
    ports = fields.list("ports", max_items=MAX_PORTS)
    if not ports or not all(isinstance(p, int) and not isinstance(p, bool) and 0 < p < 65536 for p in ports):
        raise fields.error("ports", f"must be 1 to {MAX_PORTS} ports in 1..65535")
    return tuple(dict.fromkeys(ports))


def direct_hosts(addresses: Sequence[object]) -> list[str]:
    """The IPs of a peer's live direct connections (relayed ones have none), from their multiaddrs."""
    hosts = []
    for address in map(str, addresses):
        parts = address.split("/")
        if "p2p-circuit" not in parts and len(parts) > 2 and parts[1] in ("ip4", "ip6"):
            hosts.append(parts[2])
    return list(dict.fromkeys(hosts))[:MAX_HOSTS]


async def dial(host: str, port: int) -> bool:
    """Whether a new TCP connection to host:port reaches a libp2p listener."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), DIAL_TIMEOUT)
    except (OSError, asyncio.TimeoutError):
        return False
    try:
        header = await asyncio.wait_for(reader.readexactly(len(LIBP2P_HEADER)), DIAL_TIMEOUT)
        return header == LIBP2P_HEADER
    except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError):
        return False
    finally:
        writer.close()


def maddr(host: str, port: int) -> str:
    return f"/{'ip6' if ':' in host else 'ip4'}/{host}/tcp/{port}"


class DialBackService:
    """Answers DIAL_BACK on a peer's P2P, within its limits."""

    def __init__(self, p2p: P2P, clock=time.monotonic):
        self.p2p = p2p
        self.clock = clock
        self.recent: dict[str, deque[float]] = {}  # address -> times of its recent requests
        self.dials = asyncio.Semaphore(MAX_DIALS)

    async def register(self) -> None:
        await self.p2p.add_protobuf_handler(DIAL_BACK, self.rpc_dial_back, runtime_pb2.ExpertRequest)

    async def rpc_dial_back(
        self, request: runtime_pb2.ExpertRequest, context: P2PContext
    ) -> runtime_pb2.ExpertResponse:
        return runtime_pb2.ExpertResponse(metadata=(await self.answer(request.metadata, context)).to_bytes())

    async def answer(self, raw: bytes, context: P2PContext) -> Answer:
        try:
            ports = read_ports(raw)
        except InvalidRequest as e:
            return Answer(refused=str(e))
        connected = [peer for peer in await self.p2p.list_peers() if peer.peer_id == context.remote_id]
        hosts = direct_hosts(connected[0].addrs) if connected else []
        if not hosts:
            return Answer(refused="no direct connection from the asking peer (relayed?): nothing to dial")
        if not all(self._admit(host) for host in hosts) or self.dials.locked():
            limit = f"at most {MAX_PER_HOST} a minute per address"
            return Answer(refused=f"too many dial-back requests ({limit})")
        targets = [(host, port) for host in hosts for port in ports]
        async with self.dials:
            results = await asyncio.gather(*(dial(host, port) for host, port in targets))
        tried = tuple(maddr(*target) for target in targets)
        return Answer(tried, tuple(address for address, ok in zip(tried, results, strict=True) if ok))

    def _admit(self, host: str) -> bool:
        now = self.clock()
        for address in list(self.recent):  # forget addresses quiet for a minute
            if now - self.recent[address][-1] > 60:
                del self.recent[address]
        times = self.recent.setdefault(host, deque(maxlen=MAX_PER_HOST))
        if len(times) == MAX_PER_HOST and now - times[0] < 60:
            return False
        times.append(now)
        return True


async def serve(dht: DHT, node: DHTNode) -> None:
    """Answer DIAL_BACK on a DHT peer's daemon (run in its DHT process: `dht.run_coroutine(serve)`)."""
    await DialBackService(node.p2p).register()


async def ask(p2p: P2P, peer_ids: Sequence[str], ports: Sequence[int]) -> list[Answer]:
    """The answers of `peer_ids` (each asked once, at once) to dial this peer back at `ports`; a peer that
    fails, refuses or sends a malformed answer gives none."""
    request = runtime_pb2.ExpertRequest(metadata=pack({"ports": list(ports)[:MAX_PORTS]}))

    async def one(peer_id: str) -> Answer | None:
        try:
            call = p2p.call_protobuf_handler(
                PeerID.from_base58(peer_id), DIAL_BACK, request, runtime_pb2.ExpertResponse
            )
            answer = Answer.from_bytes((await asyncio.wait_for(call, ASK_TIMEOUT)).metadata)
        except Exception as e:  # any peer may fail or lie: its answer is left out
            logger.debug("No dial-back answer from ...%s: %s: %s", peer_id[-6:], type(e).__name__, e)
            return None
        return None if answer.refused else answer

    return [answer for answer in await asyncio.gather(*map(one, peer_ids)) if answer is not None]
