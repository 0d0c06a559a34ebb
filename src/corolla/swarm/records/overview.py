"""What the swarm looks like for one model: every server's span and figures, and each block's coverage.

Built as clients see the swarm: the DHT records (`find_spans`), then a ping (rpc_info) to each server.
Only servers that answer are listed and counted, with their live figures; a record whose server does not
answer (dead, or signed by a peer that is no server at all) is listed apart as "not answering" and never
counts, as clients never route to it. A model's number of blocks is what the servers that answer claim
(`confirmed_models`), never a `corolla.models` record alone. The API's dashboard draws it
(`to_dict` is its JSON) and `corolla status` prints it (`format_table`). A server whose model fingerprint
differs from the model's (the API's own model; for `corolla status`, the one that most blocks are
announced with) serves another model under the same prefix: it is shown as "other model" and does not
count in the coverage, as clients ignore it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from hivemind import DHT
from hivemind.p2p import P2P

from corolla.errors import counted
from corolla.swarm.dht import RemoteSpan, rejected_records
from corolla.swarm.p2p.ping import Ping, ping
from corolla.swarm.p2p.transport import P2PTransport
from corolla.swarm.records.block_records import find_spans
from corolla.swarm.records.faulty_reports import find_reports
from corolla.wire.records import ServerState, ServerStatus

SHOWN_STATES = (ServerState.JOINING, ServerState.ONLINE)
LIVE_TIMEOUT = 2.0  # seconds a server has to report its live figures


@dataclass(frozen=True)
class SwarmOverview:
    model: str  # the DHT prefix
    num_blocks: int
    servers: tuple[RemoteSpan, ...]  # the servers that answered: blocks (from the DHT), live report
    coverage: tuple[int, ...]  # ONLINE servers of this model per block, among those that answered
    taken_at: float
    model_fingerprint: str = ""  # the model's; servers announcing another are shown, not counted
    # DHT records refused by this peer (bad signatures, signed in another's name, unsigned, malformed,
    # not allowed), by reason: (reason, count) pairs
    rejected_records: tuple[tuple[str, int], ...] = ()
    # servers that clients' spot checks caught (swarm/records/faulty_reports.py): (peer id, what each client
    # found)
    reported_faulty: tuple[tuple[str, tuple[str, ...]], ...] = ()
    # DHT records whose server did not answer rpc_info: shown apart, never counted
    silent: tuple[RemoteSpan, ...] = ()

    def other_model(self, span: RemoteSpan) -> bool:
        return not span.info.serves_model(self.model_fingerprint)

    def state(self, span: RemoteSpan) -> str:
        return "other model" if self.other_model(span) else span.info.state.name.lower()

    @property
    def uncovered(self) -> tuple[int, ...]:
        return tuple(i for i, count in enumerate(self.coverage) if count == 0)

    def to_dict(self) -> dict:
        """The dashboard's JSON: one row per server, with the status fields it draws."""
        return {
            "model": self.model,
            "num_blocks": self.num_blocks,
            "servers": [_row(span, self.state(span)) for span in self.servers],
            "coverage": list(self.coverage),
            "taken_at": self.taken_at,
            "uncovered": list(self.uncovered),
            "model_fingerprint": self.model_fingerprint,
            "rejected_records": dict(self.rejected_records),
            "reported_faulty": {peer_id: list(reasons) for peer_id, reasons in self.reported_faulty},
            # what their records claim is not shown: nothing vouches for it
            "not_answering": [{"peer_id": s.peer_id, "start": s.start, "end": s.end} for s in self.silent],
        }


def _row(span: RemoteSpan, state: str) -> dict:
    info = span.info
    return {
        "peer_id": span.peer_id,
        "start": span.start,
        "end": span.end,
        "state": state,  # "online", "joining" or "other model"
        "model_fingerprint": info.model_fingerprint,
        # blocks/s clients route by: the pace of its passes, else as measured at start (None: neither)
        "throughput": info.speed,
        "pace": info.pace,
        "num_sessions": info.num_sessions,
        "queued_tokens": info.queued_tokens,
        "free_cache_tokens": info.cache_tokens_available,
        "inference_max_length": info.inference_max_length,
        "dtype": info.dtype,
        "precision": info.precision or info.dtype,  # of the weights: int8 | int4 when quantized
        "device": device_label(info),
        "reachability": info.reachability,  # direct | relayed | unreachable, as the server says
        # relayed: through which relays, and the limits each puts on a relayed connection
        "relays": [{"relay": path.relay, **path.to_dict()} for path in info.relays],
        "version": info.version,
    }


def reached_label(info: ServerStatus) -> str:
    """How a server says it is reached, for people: "direct", "relayed via ...abcd1234, ...ef567890"."""
    relays = list(dict.fromkeys(f"...{path.relay[-8:]}" for path in info.relays))
    return f"{info.reachability} via {', '.join(relays)}" if relays else info.reachability or "-"


def device_label(info: ServerStatus) -> str:
    """Where a server computes, for people: "cuda (NVIDIA H200, 140 GB)", "cpu (31 GB)", "" if unsaid."""
    details = [info.device_name] if info.device != "cpu" and info.device_name else []
    if info.device_memory:
        details.append(f"{info.device_memory / 1e9:.0f} GB")
    return f"{info.device} ({', '.join(details)})" if info.device and details else info.device


def build_overview(
    model: str,
    num_blocks: int,
    spans: Sequence[RemoteSpan],
    model_fingerprint: str | None = None,
    silent: Sequence[RemoteSpan] = (),
) -> SwarmOverview:
    """`spans`: the servers that answered; `silent`: the records of those that did not (not counted).
    `model_fingerprint`: the model's (None: the one announced for most blocks)."""
    if model_fingerprint is None:
        weights = Counter()
        for span in spans:
            weights[span.info.model_fingerprint] += span.end - span.start
        model_fingerprint = max(weights, key=weights.__getitem__, default="")
    overview = SwarmOverview(model, num_blocks, (), (), time.time(), model_fingerprint)
    coverage = [0] * num_blocks
    for span in spans:
        if span.info.state == ServerState.ONLINE and not overview.other_model(span):
            for index in range(span.start, min(span.end, num_blocks)):
                coverage[index] += 1
    servers = tuple(sorted(spans, key=_span_order))
    silent = tuple(sorted(silent, key=_span_order))
    return dataclasses.replace(overview, servers=servers, coverage=tuple(coverage), silent=silent)


def _span_order(span: RemoteSpan) -> tuple[int, int, str]:
    return (span.start, span.end, span.peer_id)


async def read_overview(
    dht: DHT, model: str, num_blocks: int, model_fingerprint: str | None = None, p2p: P2P | None = None
) -> SwarmOverview:
    """Pings every server found in the DHT (through `p2p`, else a replica of the DHT's daemon): those
    that answer within LIVE_TIMEOUT are shown with their live report, the others apart (`silent`)."""
    tally = Counter(await rejected_records(dht))
    spans = await find_spans(dht, model, num_blocks, SHOWN_STATES, tally)
    replica = await dht.replicate_p2p() if p2p is None else None
    try:
        answers = await _ping_all(P2PTransport(p2p or replica), [span.peer_id for span in spans])
    finally:
        if replica is not None:
            await replica.shutdown()
    answered = [
        dataclasses.replace(span, info=answers[span.peer_id].status)
        for span in spans
        if answers[span.peer_id].answered
    ]
    silent = [span for span in spans if not answers[span.peer_id].answered]
    reports = await find_reports(dht, model, tally)
    overview = build_overview(model, num_blocks, answered, model_fingerprint, silent)
    return dataclasses.replace(
        overview,
        rejected_records=tuple(sorted(tally.items())),
        reported_faulty=tuple((peer_id, tuple(reasons)) for peer_id, reasons in reports.items()),
    )


async def confirmed_models(p2p: P2P, claims: dict[str, dict[str, int]]) -> dict[str, int]:
    """Each model's number of blocks as the servers that answer claim it (`claims`: find_models'): a
    claim counts only where its signer answers rpc_info as a server of that model; where they differ,
    the number most of them claim (then the smallest). Models no such server claims are left out."""
    signers = sorted({peer_id for by_peer in claims.values() for peer_id in by_peer})
    answers = await _ping_all(P2PTransport(p2p), signers)
    models = {}
    for prefix, by_peer in claims.items():
        votes = Counter(
            blocks
            for peer_id, blocks in by_peer.items()
            if answers[peer_id].answered and answers[peer_id].status.dht_prefix == prefix
        )
        if votes:
            models[prefix] = min(votes, key=lambda blocks: (-votes[blocks], blocks))
    return models


async def _ping_all(transport: P2PTransport, peer_ids: Sequence[str]) -> dict[str, Ping]:
    answers = await asyncio.gather(*(ping(transport, peer_id, LIVE_TIMEOUT) for peer_id in peer_ids))
    return dict(zip(peer_ids, answers, strict=True))


def format_table(overview: SwarmOverview) -> str:
    """A terminal table: a coverage line per block range, then one line per server."""
    servers = counted(len(overview.servers), "server")
    lines = [f"model {overview.model}: {overview.num_blocks} blocks, {servers}"]
    counts = "".join(_coverage_char(c) for c in overview.coverage)
    lines.append(f"coverage (servers per block, 0-{overview.num_blocks - 1}): {counts}")
    uncovered = overview.uncovered
    lines.append(f"uncovered blocks: {_ranges(uncovered)}" if uncovered else "every block is covered")
    if overview.rejected_records:
        refused = ", ".join(f"{count} {reason}" for reason, count in overview.rejected_records)
        lines.append(f"DHT records refused (never used): {refused}")
    if overview.silent:
        silent = ", ".join(f"...{span.peer_id[-8:]} ({span.start}:{span.end})" for span in overview.silent)
        lines.append(f"DHT records of servers that do not answer (not counted): {silent}")
    for peer_id, reasons in overview.reported_faulty:
        by = counted(len(reasons), "client")
        lines.append(f"reported faulty by the spot checks of {by}: ...{peer_id[-8:]} ({reasons[0]})")
    header = ("server", "blocks", "state", "throughput", "sessions", "queued", "free cache", "weights")
    header += ("device", "reached")
    rows = [
        (
            f"...{span.peer_id[-8:]}",
            f"{span.start}:{span.end}",
            overview.state(span),
            "-" if span.info.speed is None else f"{span.info.speed:.1f}",
            str(span.info.num_sessions),
            str(span.info.queued_tokens),
            str(span.info.cache_tokens_available),
            span.info.precision or span.info.dtype,
            device_label(span.info),
            reached_label(span.info),
        )
        for span in overview.servers
    ]
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows, strict=True)]
    for cells in (header, *rows):
        lines.append("  ".join(cell.ljust(width) for cell, width in zip(cells, widths, strict=True)).rstrip())
    return "\n".join(lines)


def _coverage_char(count: int) -> str:
    return str(count) if count < 10 else "+"


def _ranges(indices: Sequence[int]) -> str:
    """(3, 4, 5, 9) -> "3-5, 9"."""
    parts = []
    first = None
    for i, index in enumerate(indices):
        first = index if first is None else first
        if i + 1 == len(indices) or indices[i + 1] != index + 1:
            parts.append(str(first) if first == index else f"{first}-{index}")
            first = None
    return ", ".join(parts)
