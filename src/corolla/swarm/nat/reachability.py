"""How other peers reach this one: directly, or through relays when it sits behind NAT.

`--public` says the machine can be dialed at its address (a public IP or a forwarded port): its daemon is
forced public and relays for peers behind NAT (swarm/nat/relay_service.py; `corolla dht` runs so unless told
otherwise). `--behind-nat` says it cannot: its daemon is forced private, its hivemind DHT node runs in
client mode (it must not hold records others need to fetch), and it holds reservations on relays that
corolla makes itself (swarm/nat/reservations.py; not the daemon's autorelay: swarm/nat/circuit_v2.py says
why). Without either, a server starts as a public one and asks its initial peers to dial it back; when none
can, it restarts as one behind NAT (swarm/nat/joining.py). `--no-relay` keeps a reachable peer from relaying
(swarm/nat/relay_service.py).
"""

from __future__ import annotations

import ipaddress

from hivemind.p2p import P2P

from corolla.config import SwarmConfig

RELAYED = "/p2p-circuit"


def p2p_options(config: SwarmConfig) -> dict:
    """The libp2p daemon's options for the peer's reachability (hivemind's P2P.create arguments): a peer
    not said to be behind NAT starts public (a server found behind NAT then restarts:
    swarm/nat/joining.py)."""
    if config.reachability == "behind-nat":
        return {"force_reachability": "private"}
    return {} if config.client_mode else {"force_reachability": "public"}


def relays_for_others(config: SwarmConfig) -> bool:
    """Whether this peer runs a relay with its own limits for peers behind NAT (checked at start): any but
    a client or one behind NAT, unless --no-relay, that listens beyond loopback (nobody behind NAT could
    use a relay there)."""
    not_behind = config.reachability != "behind-nat" and not config.client_mode
    return not_behind and config.relay and not on_loopback(config)


def on_loopback(config: SwarmConfig) -> bool:
    """Whether the peer is reached at a loopback address: only peers on its own host can reach it, and all
    of them can (no NAT between them, nothing to relay)."""
    try:
        return ipaddress.ip_address(config.announce_host or config.host).is_loopback
    except ValueError:
        return False


async def describe_direct(p2p: P2P, config: SwarmConfig, dialed_back: str) -> tuple[str, str]:
    """(direct, or "" when nobody said, and a line saying so) for a peer not behind NAT."""
    addresses = ", ".join(str(m) for m in await p2p.get_visible_maddrs() if RELAYED not in str(m))
    if config.reachability == "public" or dialed_back == "direct":
        relaying = " (and relays for peers behind NAT)" if relays_for_others(config) else ""
        return "direct", f"Reachable directly at {addresses}{relaying}"
    return "", (
        f"Listening at {addresses}; whether other peers can dial that was not checked: behind a home "
        "router without a forwarded port, run with --behind-nat (docs/operators.md: Running a server at home)"
    )
