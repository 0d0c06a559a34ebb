"""The client's composition root: everything that knows the swarm, built once, in layers.

From the bottom: `Peers` (how to talk to a server, over a transport), `ServerEstimates` and `Bans`,
`SwarmView` (who serves what), `Router` (the cheapest chain of routable servers); then what uses them:
the spot checker and the forward/backward passes. `connect` builds it on the libp2p network (a DHT peer
of its own, started here); tests build it on an in-process transport. Nothing is set after construction.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass

from hivemind.p2p import P2P

from corolla.client.checks.spot_checks import SpotChecker
from corolla.client.generation.prefixes import PrefixCache
from corolla.client.routing.bans import Bans, Report
from corolla.client.routing.estimates import ServerEstimates
from corolla.client.routing.router import Router
from corolla.client.routing.swarm_access import SwarmAccess
from corolla.client.routing.swarm_view import SpanReader, SwarmView
from corolla.client.rpc.peers import Peers
from corolla.client.training.remote_chain import ChainPasses
from corolla.config import ClientConfig
from corolla.models.model_config import ModelConfig
from corolla.swarm.dht import PeerDHT, RemoteSpan, Spawning, spawn_dht
from corolla.swarm.p2p.transport import P2PTransport, Transport
from corolla.swarm.records.block_records import find_spans
from corolla.swarm.records.faulty_reports import report_faulty
from corolla.swarm.records.overview import SwarmOverview, read_overview
from corolla.swarm.records.record_cells import CLIENT_CELLS


@dataclass(frozen=True)
class ServedModel:
    """What a client knows of the model it asks servers for."""

    num_blocks: int
    fingerprint: str = ""  # ModelConfig.fingerprint (empty: any server's blocks)
    forbidden_cuts: frozenset[int] = frozenset()  # blocks no hop starts or ends at (models/kv_sharing.py)

    @classmethod
    def of(cls, config: ModelConfig) -> ServedModel:
        return cls(config.num_hidden_layers, config.fingerprint(), config.kv_sharing.forbidden_cuts)


class Client:
    def __init__(
        self,
        config: ClientConfig,
        dht_prefix: str,
        model: ServedModel,
        transport: Transport,
        read_spans: SpanReader,
        report: Report | None = None,
        dht: PeerDHT | None = None,
    ):
        """`read_spans` reads the model's servers (from the DHT, or a test's list); `report` stores this
        client's findings for the swarm's operators; `dht` is the client's own DHT peer, if it has one
        (its `p2p` handle is the transport's)."""
        self.config = config
        self.dht_prefix = dht_prefix
        self.model_fingerprint = model.fingerprint
        self.dht = dht
        estimates = ServerEstimates()
        bans = Bans(config, report)
        peers = Peers(transport, dht_prefix, config)
        view = SwarmView(config, model.fingerprint, read_spans, peers, estimates, bans)
        router = Router(config, model.num_blocks, view, bans, estimates, forbidden_cuts=model.forbidden_cuts)
        self.swarm = SwarmAccess(config, model.num_blocks, peers, view, bans, estimates, router)
        self.checker = SpotChecker(self.swarm, config.spot_checks) if config.spot_checks > 0 else None
        self.passes = ChainPasses(self.swarm, self.checker)
        self.prefixes = PrefixCache(config.prefix_cache) if config.prefix_cache else None
        self._transport = transport

    @classmethod
    async def connect(
        cls, config: ClientConfig, dht_prefix: str, model: ServedModel, spawning: Spawning | None = None
    ) -> Client:
        """A client of the swarm `config.swarm` names: its DHT peer started (or `spawning` already, see
        swarm/dht.py), its view refreshed in the background."""
        spawning = spawning or await asyncio.to_thread(spawn_dht, config.swarm)
        dht = await asyncio.to_thread(spawning.ready)
        try:
            p2p = await dht.replicate_p2p()
        except BaseException:
            await asyncio.to_thread(dht.shutdown)
            raise

        async def read_spans(tally: Counter) -> list[RemoteSpan]:
            # the records' tree as far as CLIENT_CELLS allow, then a random path
            # (swarm/records/record_cells.py)
            return await find_spans(dht, dht_prefix, model.num_blocks, tally=tally, budget=CLIENT_CELLS)

        async def report(faulty: dict[str, str]) -> bool:
            return await report_faulty(dht, dht_prefix, faulty)

        client = cls(config, dht_prefix, model, P2PTransport(p2p), read_spans, report, dht)
        client.start()
        return client

    @property
    def p2p(self) -> P2P | None:
        return self._transport.p2p if isinstance(self._transport, P2PTransport) else None

    def start(self) -> None:
        self.swarm.view.start()

    def findings(self) -> dict:
        """What this client found of servers: caught lying (banned for good), its spot checks' counts."""
        checks = None if self.checker is None else dict(self.checker.counts)
        return {"faulty_servers": dict(self.swarm.bans.faulty), "spot_checks": checks}

    async def overview(self) -> SwarmOverview:
        """The swarm as `corolla status` shows it: every server in the DHT, with its live report."""
        if self.dht is None:
            raise RuntimeError("this client has no DHT peer")
        swarm = self.swarm
        return await read_overview(
            self.dht, self.dht_prefix, swarm.num_blocks, self.model_fingerprint, self.p2p
        )

    async def shutdown(self) -> None:
        await self.swarm.view.shutdown()
        await self.swarm.bans.shutdown()
        p2p = self.p2p
        if p2p is not None:
            await p2p.shutdown()  # a replica: closes our connection to the daemon, not the daemon
        if self.dht is not None:
            await asyncio.to_thread(self.dht.shutdown)
