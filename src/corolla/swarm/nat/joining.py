"""A server joining the swarm: its DHT peer started, and how other peers reach it settled.

With `--behind-nat` the owner said; otherwise the server starts as a public peer (one that relays for
peers behind NAT: swarm/nat/relay_service.py) and asks its initial peers to dial it back
(swarm/nat/dial_back.py), its DHT node meanwhile out of the others' routing tables. When some peer reached
it, its node joins those tables (`publish`) and it is served directly as it is. When every peer that
answered failed, it sits behind NAT or a firewall: its DHT peer restarts as with `--behind-nat`
(reservations on relays, a DHT client). When nobody answered (a swarm of older peers, or no initial
peers) it is published all the same and says it could not check. A server started with `--public` is
checked too, and says so in one line when nobody could dial it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import partial

from hivemind.dht import DHT, DHTNode
from hivemind.p2p import P2P
from hivemind.proto import dht_pb2
from hivemind.utils.auth import AuthRole, AuthRPCWrapper

from corolla.config import RELAY_LIMITS, SwarmConfig
from corolla.swarm.dht import PeerDHT, start_dht
from corolla.swarm.nat import dial_back
from corolla.swarm.nat.reachability import RELAYED, on_loopback

logger = logging.getLogger(__name__)

MAX_ASKED = 3  # initial peers asked to dial back


@dataclass(frozen=True)
class Check:
    """What the peers asked to dial this one back found."""

    asked: int
    answered: int = 0
    reached: int = 0  # peers that reached it
    dialed: tuple[str, ...] = ()  # addresses where they did
    tried: tuple[str, ...] = ()

    @property
    def failed(self) -> str:
        return f"{self.answered} peer(s) could not dial this one back at {', '.join(self.tried)}"

    @property
    def succeeded(self) -> str:
        return f"{self.reached} peer(s) dialed this one back at {', '.join(self.dialed)}"

    @property
    def kind(self) -> str:
        """direct | unreachable | "" (nobody answered)."""
        return "direct" if self.dialed else "unreachable" if self.answered else ""


def join(config: SwarmConfig) -> tuple[PeerDHT, SwarmConfig, str]:
    """The started DHT peer, the swarm settings it runs with, and whether other peers dialed it back
    ("direct" or "" when not checked: behind NAT it runs with reachability "behind-nat").

    Until the check says it is not behind NAT, the DHT node of a server left to find out keeps out of
    the others' routing tables: else, once restarted behind NAT, it would stay there unreachable, and every
    peer that bootstraps or reads through them would wait for it (each time up to hivemind's 3 s)."""
    if config.reachability == "behind-nat" or config.client_mode:
        return start_dht(config), config, ""
    if on_loopback(config):  # every peer that can reach it at all can: nothing to ask (a dial-back slowed
        return start_dht(config), config, "direct"  # past its timeout on a loaded host would strand it)
    unconfirmed = config.reachability != "public"
    dht = start_dht(config, unconfirmed=unconfirmed)
    check = dht.run_coroutine(partial(_check_in_child, initial_peers=tuple(config.initial_peers)))
    if config.reachability == "public":
        if check.kind == "unreachable":
            advice = "forward that port to this machine, or drop --public"
            logger.warning(
                "Started with --public, but %s: peers will fail to reach it (%s)", check.failed, advice
            )
        return dht, config, check.kind
    _say(check)
    if check.kind != "unreachable":
        dht.run_coroutine(publish)
        return dht, config, check.kind
    dht.shutdown()
    unlimited = dict.fromkeys(RELAY_LIMITS)  # it relays for nobody now
    config = replace(config, reachability="behind-nat", **unlimited)
    return start_dht(config, identity_checked=True), config, ""


def _say(check: Check) -> None:
    if check.kind == "direct":
        logger.info(check.succeeded)
    elif check.kind == "unreachable":
        logger.info(
            "Not reachable directly: %s (behind NAT or a firewall); taking relay reservations as with "
            "--behind-nat",
            check.failed,
        )
    elif check.asked:
        logger.info(
            "Could not check whether other peers can dial this one: none of %d initial peer(s) answered a "
            "dial-back request (run with --public or --behind-nat to say)",
            check.asked,
        )


async def publish(dht: DHT, node: DHTNode) -> None:
    """In the DHT's process of a peer started `unconfirmed` (swarm/dht.py): serve the DHT as a full node
    from now on and meet the nodes nearest to it, each of which adds it to its routing table. hivemind
    fixes a node's mode at start (a client sends no node id and registers no handlers): this does what its
    DHTProtocol.create does for a full node."""
    protocol = node.protocol
    if not protocol.client_mode:
        return
    protocol.client_mode = False
    protocol.node_info = dht_pb2.NodeInfo(node_id=node.node_id.to_bytes())
    servicer = AuthRPCWrapper(protocol, AuthRole.SERVICER, protocol.authorizer)
    await protocol.add_p2p_handlers(protocol.p2p, servicer)
    await node.find_nearest_nodes([node.node_id])


async def _check_in_child(dht: DHT, node: DHTNode, initial_peers: Sequence[str]) -> Check:
    return await checked(node.p2p, initial_peers)  # in the DHT's process, on its daemon


async def checked(p2p: P2P, initial_peers: Sequence[str]) -> Check:
    """What up to MAX_ASKED initial peers found when asked to dial this peer back at its listening ports."""
    peers = list(dict.fromkeys(a.rsplit("/p2p/", 1)[1] for a in initial_peers if "/p2p/" in a))
    return await ask_peers(p2p, peers[:MAX_ASKED])


async def ask_peers(p2p: P2P, peers: Sequence[str]) -> Check:
    """What `peers` (peer ids) found when asked to dial this peer back at its listening ports."""
    if not peers:
        return Check(0)
    listening = [str(m) for m in await p2p.get_visible_maddrs() if RELAYED not in str(m)]
    ports = sorted({int(m.split("/tcp/")[1].split("/")[0]) for m in listening if "/tcp/" in m})
    answers = await dial_back.ask(p2p, peers, ports)
    dialed = sorted({address for answer in answers for address in answer.dialed})
    tried = sorted({address for answer in answers for address in answer.tried})
    reached = sum(1 for answer in answers if answer.dialed)
    return Check(len(peers), len(answers), reached, tuple(dialed), tuple(tried))


async def confirm_public(dht: DHT, node: DHTNode) -> bool:
    """In a public peer's DHT process (`corolla dht`): ask up to MAX_ASKED peers connected to it directly to
    dial it back, and say what they found in one line; whether any answered (then it need not ask again)."""
    peers = [
        str(peer.peer_id)
        for peer in await node.p2p.list_peers()
        if any(RELAYED not in str(address) for address in peer.addrs)
    ]
    check = await ask_peers(node.p2p, peers[:MAX_ASKED])
    if check.kind == "unreachable":
        logger.warning(
            "This peer runs as public, but %s: peers joining through it or behind NAT cannot use it (run it "
            "on a machine with a public address, or forward its --port)",
            check.failed,
        )
    elif check.kind == "direct":
        logger.info(check.succeeded)
    return bool(check.answered)
