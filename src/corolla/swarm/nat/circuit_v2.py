"""libp2p's circuit relay v2, the part corolla speaks itself: a reservation on a relay (the hop protocol's
RESERVE, https://github.com/libp2p/specs/blob/master/relay/circuit-v2.md) and relayed addresses in the
binary form the daemon reads.

Why not the daemon's autorelay (hivemind's `use_auto_relay`, measured with the bundled p2pd in
tests/nat_harness.py's namespaces): with discovered relays it reserves only once it knows 4 candidates,
or after 3 minutes; with static relays (`-trustedRelays`) it waits until *every* listed relay is a
candidate (one dead or unreachable entry: 3 minutes), never reserves again for an hour on a relay it
tried (a relay that restarts, or one found later, stays unused) and renews a reservation only near its
one-hour expiry, so a relay that drops its reservations (it does when libp2p's AutoNAT finds it public:
a second relay service replaces the first, which held them) leaves the server unreachable for most of
an hour. A reservation corolla asks for itself is made at once, renewed every few seconds (which also
keeps the connection to the relay alive through routers that forget idle flows) and tells the limits
the relay grants each relayed connection, which the server announces.

hivemind's Multiaddr writes a `/p2p/` part as a CIDv1 (its py-multiaddr heritage), which the daemon's
go-multiaddr refuses ("length greater than remaining number of bytes"): `Address.to_bytes` writes the
peer id as the raw multihash the daemon expects.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import varint
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import DecodeError
from hivemind.p2p import P2P, PeerID
from hivemind.utils.multiaddr import Multiaddr

HOP = "/libp2p/circuit/relay/0.2.0/hop"
CIRCUIT = "/p2p-circuit"
MAX_MESSAGE = 4096  # bytes: the spec's bound on a hop message
OK = 100  # the spec's Status.OK
PERMISSION_DENIED = 202
STATUS_NAMES = {
    200: "reservation refused",
    201: "resource limit exceeded",
    PERMISSION_DENIED: "permission denied",
}
P2P_CODE = 421  # the multiaddr code of /p2p/


def _hop_message_class() -> type:
    """The spec's HopMessage (with Peer, Reservation and Limit), built from its schema at import."""
    field = descriptor_pb2.FieldDescriptorProto
    schema = descriptor_pb2.FileDescriptorProto(name="corolla_circuit_v2.proto", package="corolla.circuit")
    schema.syntax = "proto2"

    def message(name: str, fields: list[tuple[str, int, str | None]], repeated: tuple[str, ...] = ()):
        added = schema.message_type.add(name=name)
        for number, (field_name, kind, type_name) in enumerate(fields, 1):
            label = field.LABEL_REPEATED if field_name in repeated else field.LABEL_OPTIONAL
            entry = added.field.add(name=field_name, number=number, type=kind, label=label)
            if type_name:
                entry.type_name = f".corolla.circuit.{type_name}"
        return added

    hop = message(
        "HopMessage",
        [
            ("type", field.TYPE_ENUM, "HopMessage.Type"),
            ("peer", field.TYPE_MESSAGE, "Peer"),
            ("reservation", field.TYPE_MESSAGE, "Reservation"),
            ("limit", field.TYPE_MESSAGE, "Limit"),
            ("status", field.TYPE_UINT32, None),  # an enum in the spec: read as its number
        ],
    )
    kinds = hop.enum_type.add(name="Type")
    for number, name in enumerate(("RESERVE", "CONNECT", "STATUS")):
        kinds.value.add(name=name, number=number)
    message("Peer", [("id", field.TYPE_BYTES, None), ("addrs", field.TYPE_BYTES, None)], ("addrs",))
    reservation = [("expire", field.TYPE_UINT64, None), ("addrs", field.TYPE_BYTES, None)]
    message("Reservation", [*reservation, ("voucher", field.TYPE_BYTES, None)], ("addrs",))
    message("Limit", [("duration", field.TYPE_UINT32, None), ("data", field.TYPE_UINT64, None)])
    pool = descriptor_pool.DescriptorPool()
    pool.Add(schema)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("corolla.circuit.HopMessage"))


HopMessage = _hop_message_class()


class ReservationFailed(ConnectionError):
    """A relay refused a reservation, answered garbage, or could not be reached."""


@dataclass(frozen=True, slots=True)
class Grant:
    """A reservation a relay granted: how to reach this peer through it, and the limits it puts on each
    connection it relays (None: none). Its expiry is not kept: reservations are renewed every few seconds."""

    relay: str  # its peer id
    addresses: tuple[str, ...]  # the relay's public addresses, each ending /p2p/RELAY (may be empty)
    time_limit: int | None  # seconds
    data_limit: int | None  # bytes each way

    def circuits(self, fallback: str | None = None) -> tuple[str, ...]:
        """This peer's relayed addresses through the relay (`/.../p2p/RELAY/p2p-circuit`); a relay that gave
        no public address (a test swarm on loopback) is reached at `fallback`, its address as dialed."""
        relay_addresses = self.addresses or ((f"{fallback}/p2p/{self.relay}",) if fallback else ())
        return tuple(f"{address}{CIRCUIT}" for address in relay_addresses)


async def reserve(p2p: P2P, relay: str, timeout: float) -> Grant:
    """Ask `relay` (a peer id) for a reservation, or renew ours; raises ReservationFailed."""

    async def ask() -> Grant:
        _, reader, writer = await p2p._client.stream_open(PeerID.from_base58(relay), (HOP,))
        try:
            body = HopMessage(type=0).SerializeToString()  # RESERVE
            writer.write(varint.encode(len(body)) + body)
            await writer.drain()
            return _grant(relay, await read_message(reader))
        finally:
            writer.close()

    try:
        return await asyncio.wait_for(ask(), timeout)
    except ReservationFailed:
        raise
    except (asyncio.TimeoutError, TimeoutError):
        raise ReservationFailed(f"no answer within {timeout:.0f}s") from None
    except Exception as e:  # the daemon could not dial it, the stream broke: the same to the caller
        raise ReservationFailed(f"{type(e).__name__}: {e}") from None


async def read_message(reader: asyncio.StreamReader):
    length = shift = 0
    while True:
        byte = (await reader.readexactly(1))[0]
        length |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            break
        if shift > 28:
            raise ReservationFailed("the relay's reply has a malformed length")
    if length > MAX_MESSAGE:
        raise ReservationFailed(f"the relay's reply is {length} bytes, over {MAX_MESSAGE}")
    try:
        return HopMessage.FromString(await reader.readexactly(length))
    except DecodeError as e:
        raise ReservationFailed(f"the relay's reply is not a hop message ({e})") from None


def _grant(relay: str, reply) -> Grant:
    if reply.status != OK:
        reason = STATUS_NAMES.get(reply.status, f"status {reply.status}")
        raise ReservationFailed(f"the relay refused: {reason}")
    addresses = []
    for raw in list(reply.reservation.addrs)[:8]:
        try:
            address = str(Multiaddr(raw))
        except Exception:  # a relay may send what it likes: unreadable addresses are left out
            continue
        if address.endswith(f"/p2p/{relay}") and CIRCUIT not in address and len(address) <= 200:
            addresses.append(address)
    limit = reply.limit if reply.HasField("limit") else None
    return Grant(
        relay,
        tuple(addresses),
        (limit.duration or None) if limit is not None else None,
        (limit.data or None) if limit is not None else None,
    )


class Address:
    """A multiaddress as the daemon reads it (hivemind's Multiaddr writes `/p2p/` parts another way)."""

    def __init__(self, text: str):
        self.text = text

    def to_bytes(self) -> bytes:
        parts = self.text.strip("/").split("/")
        out = bytearray()
        while parts:
            name = parts.pop(0)
            if name == "p2p":
                peer = PeerID.from_base58(parts.pop(0)).to_bytes()
                out += varint.encode(P2P_CODE) + varint.encode(len(peer)) + peer
            elif name == CIRCUIT.strip("/"):
                out += Multiaddr(CIRCUIT).to_bytes()
            else:
                out += Multiaddr(f"/{name}/{parts.pop(0)}").to_bytes()
        return bytes(out)

    def __str__(self) -> str:
        return self.text
