"""How other peers reach this one: directly, or through a relay when it sits behind NAT.

A peer behind a home router cannot be dialed. With `--behind-nat` its libp2p daemon takes reservations
on relays (its `--initial-peers`, which must run with `--public`: libp2p starts a relay service only on
peers it believes public) and announces a relayed address (`.../p2p/RELAY/p2p-circuit/p2p/ME`) that
other peers' daemons find through libp2p's own DHT and dial; RPC streams then run through the relay.
Such a peer keeps its hivemind DHT node in client mode: it must not hold records others need to fetch.
libp2p looks for at least 4 relay candidates before it takes a reservation, or waits 3 minutes (its boot
delay): a server given fewer public initial peers is reachable only after that.

`--public` says the machine can be dialed at its address (a public IP or a forwarded port), which also
makes it a relay for others; a server found reachable becomes one too once libp2p's AutoNAT finds it
public (`--relay-time-limit` and the like limit both). Without either, a server asks its initial peers
to dial it back and runs as if behind NAT when none can (swarm/joining.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from hivemind.p2p import P2P

from corolla.config import SwarmConfig

logger = logging.getLogger(__name__)

RELAYED = "/p2p-circuit"
WATCH_PERIOD = 5.0  # seconds between looks at a server's relays


def p2p_options(config: SwarmConfig) -> dict:
    """The libp2p daemon's options for the peer's reachability (hivemind's P2P.create arguments)."""
    if config.reachability == "public":
        return {"force_reachability": "public"}
    if config.reachability == "behind-nat":
        relays = list(config.initial_peers)
        return {"force_reachability": "private", "use_auto_relay": True, "trusted_relays": relays}
    return {}


def relay_limit_flags(config: SwarmConfig) -> dict[str, Any]:
    """The libp2p daemon's flags for the limits of what this peer relays, when it does (those set)."""
    flags = {
        "relayTimeLimit": None if config.relay_time_limit is None else f"{config.relay_time_limit}s",
        "relayDataLimit": None if config.relay_data_limit_mib is None else config.relay_data_limit_mib << 20,
        "relayMaxCircuits": config.relay_circuits,
    }
    return {flag: value for flag, value in flags.items() if value is not None}


def limit_relaying(flags: dict[str, Any]) -> None:
    """In a DHT peer's child process, before it starts its daemon: pass `flags` to the daemon. hivemind's
    P2P.create has no argument for them; it reads the daemon flags of each DHT mode from this class
    table, which is changed in the child only."""
    P2P.DHT_MODE_MAPPING = {
        mode: {**mode_flags, **flags} for mode, mode_flags in P2P.DHT_MODE_MAPPING.items()
    }


async def relayed_addresses(p2p: P2P) -> list[str]:
    """The relayed addresses this peer announces now (none: no relay holds a reservation for it)."""
    return [str(maddr) for maddr in await p2p.get_visible_maddrs(latest=True) if RELAYED in str(maddr)]


async def describe(p2p: P2P, config: SwarmConfig, dialed_back: str, timeout: float) -> tuple[str, str]:
    """(how other peers reach this one: direct | relayed | unreachable, or "" when nobody said, and a line
    saying so) — behind NAT, after waiting up to `timeout` seconds for a relay to take a reservation.
    `dialed_back`: "direct" when peers dialed this one back (swarm/joining.py)."""
    if config.reachability != "behind-nat":
        addresses = ", ".join(str(m) for m in await p2p.get_visible_maddrs())
        if config.reachability == "public" or dialed_back == "direct":
            return "direct", f"Reachable directly at {addresses}"
        return "", (
            f"Listening at {addresses}; whether other peers can dial that was not checked: behind a home "
            "router without a forwarded port, run with --behind-nat (README: Running a server at home)"
        )
    deadline = time.monotonic() + timeout
    relayed = await relayed_addresses(p2p)
    while not relayed and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
        relayed = await relayed_addresses(p2p)
    if relayed:
        relays = relays_of(relayed)
        return (
            "relayed",
            f"Behind NAT, reachable through {len(relays)} relay(s) ({', '.join(relays)}): {relayed[0]}",
        )
    return "unreachable", (
        f"Behind NAT and no relay took a reservation within {timeout:.0f}s: no client can reach this "
        "server. Give --initial-peers that run with --public (libp2p waits up to 3 minutes when it knows "
        "fewer than 4), or forward a TCP port to this machine and run with --port PORT --announce-host "
        "YOUR_PUBLIC_IP --public"
    )


def relays_of(addresses: list[str]) -> list[str]:
    """The peer ids of the relays in relayed addresses."""
    return sorted({address.split(RELAYED)[0].rsplit("/p2p/", 1)[-1] for address in addresses})


class RelayWatch:
    """Behind NAT, says when the relays holding this peer's reservations change (one died, libp2p took
    another) and keeps `status.reachability` true: relayed, or unreachable while no relay holds one."""

    def __init__(self, p2p: P2P, status: Any):
        self.p2p = p2p
        self.status = status  # a server's StatusBoard: what `corolla status` shows
        self.relays: list[str] | None = None

    @staticmethod
    def period() -> float:
        return WATCH_PERIOD

    async def check(self) -> None:
        relays = relays_of(await relayed_addresses(self.p2p))
        if self.relays is not None and relays != self.relays:
            gone = ", ".join(sorted(set(self.relays) - set(relays))) or "none"
            if relays:
                logger.info("Relays changed (gone: %s); reachable through %s", gone, ", ".join(relays))
            else:
                logger.warning(
                    "No relay holds a reservation now (gone: %s): unreachable until one does", gone
                )
        self.relays = relays
        self.status.reachability = "relayed" if relays else "unreachable"
