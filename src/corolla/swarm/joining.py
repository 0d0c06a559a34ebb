"""A server joining the swarm: its DHT peer started, and how other peers reach it settled.

With `--public` or `--behind-nat` the owner said; otherwise the server asks its initial peers to dial it
back (swarm/dial_back.py). When some peer reached it, it is served directly. When every peer that
answered failed, it sits behind NAT or a firewall: its DHT peer restarts as with `--behind-nat` (relay
reservations, a DHT client). When nobody answered (a swarm of older peers, or no initial peers) nothing
changes and the server says it could not check.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace
from functools import partial

from hivemind.dht import DHT, DHTNode
from hivemind.p2p import P2P

from corolla.config import RELAY_LIMITS, SwarmConfig
from corolla.swarm import dial_back
from corolla.swarm.dht import PeerDHT, start_dht
from corolla.swarm.reachability import RELAYED

logger = logging.getLogger(__name__)

MAX_ASKED = 3  # initial peers asked to dial back


def join(config: SwarmConfig) -> tuple[PeerDHT, SwarmConfig, str]:
    """The started DHT peer, the swarm settings it runs with, and whether other peers dialed it back
    ("direct" or "" when not checked: behind NAT it runs with reachability "behind-nat")."""
    dht = start_dht(config)
    if config.reachability != "auto":
        return dht, config, ""
    kind, line = dht.run_coroutine(partial(_check_in_child, initial_peers=tuple(config.initial_peers)))
    if line:
        logger.info(line)
    if kind != "unreachable":
        return dht, config, kind
    dht.shutdown()
    unlimited = dict.fromkeys(RELAY_LIMITS)  # it relays for nobody now
    config = replace(config, reachability="behind-nat", **unlimited)
    return start_dht(config, identity_checked=True), config, ""


async def _check_in_child(dht: DHT, node: DHTNode, initial_peers: Sequence[str]) -> tuple[str, str]:
    return await checked(node.p2p, initial_peers)  # in the DHT's process, on its daemon


async def checked(p2p: P2P, initial_peers: Sequence[str]) -> tuple[str, str]:
    """(direct | unreachable | "", a line saying so) from the dial-back answers of up to MAX_ASKED
    initial peers, at this peer's listening ports."""
    peers = list(dict.fromkeys(a.rsplit("/p2p/", 1)[1] for a in initial_peers if "/p2p/" in a))
    peers = peers[:MAX_ASKED]
    if not peers:
        return "", ""
    listening = [str(m) for m in await p2p.get_visible_maddrs() if RELAYED not in str(m)]
    ports = sorted({int(m.split("/tcp/")[1].split("/")[0]) for m in listening if "/tcp/" in m})
    answers = await dial_back.ask(p2p, peers, ports)
    if not answers:
        return "", (
            f"Could not check whether other peers can dial this one: none of {len(peers)} initial peer(s) "
            "answered a dial-back request (run with --public or --behind-nat to say)"
        )
    dialed = sorted({address for answer in answers for address in answer.dialed})
    if dialed:
        return "direct", f"{len(answers)} peer(s) dialed this one back at {', '.join(dialed)}"
    tried = sorted({address for answer in answers for address in answer.tried})
    return "unreachable", (
        f"Not reachable directly: {len(answers)} peer(s) could not dial this one back at "
        f"{', '.join(tried)} (behind NAT or a firewall); taking relay reservations as with --behind-nat"
    )
