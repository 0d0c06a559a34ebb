"""What clients caught: their reports of faulty servers in the DHT, signed, for operators to see.

A client whose spot checks catch a server computing wrong outputs (client/checks/spot_checks.py) stores every
server it has banned so far under `<dht prefix>.reports`, in one record of its own: signed with its
identity under its own subkey, like a server's records (swarm/dht.py), so no peer can write or erase
another's report. `corolla status` and the API's /v1/swarm show them, with how many clients reported each
server. Clients never act on others' reports: any peer can report anyone (sybils cost nothing), so a
client bans only the servers its own checks caught.
"""

from __future__ import annotations

import logging
from collections import Counter
from functools import partial

from hivemind.dht import DHT

from corolla.swarm.dht import PeerDHT, read_records, signer_of, store_records

logger = logging.getLogger(__name__)

REPORTS_SUFFIX = ".reports"
REPORT_TTL = 3600.0  # seconds a client's report lasts unless it reports again
MAX_REPORTED = 32  # servers in one client's report
MAX_REASON = 200  # characters of what a check found


def reports_key(dht_prefix: str) -> str:
    return dht_prefix + REPORTS_SUFFIX


async def report_faulty(dht: PeerDHT, dht_prefix: str, faulty: dict[str, str]) -> bool:
    """Store this client's report: the servers it caught (the latest MAX_REPORTED) and what it found.
    Whether it was stored; a DHT error is logged, not raised (the report is for people; bans stand)."""
    value = {peer_id: reason[:MAX_REASON] for peer_id, reason in list(faulty.items())[-MAX_REPORTED:]}
    keys = [reports_key(dht_prefix)]
    store = partial(store_records, keys=keys, subkey=dht.subkey, value=value, ttl=REPORT_TTL)
    try:
        return await dht.run_coroutine(store, return_future=True)
    except Exception:  # a DHT hiccup, or the DHT shut down under us
        logger.debug("Could not store this client's report of faulty servers", exc_info=True)
        return False


async def find_reports(dht: DHT, dht_prefix: str, tally: Counter | None = None) -> dict[str, list[str]]:
    """Every reported server: its peer id -> what each client that reported it found. Unsigned and
    malformed reports are counted in `tally` and skipped."""
    key = reports_key(dht_prefix)
    found = await dht.run_coroutine(partial(read_records, keys=[key]), return_future=True)
    tally = Counter() if tally is None else tally
    reports: dict[str, list[str]] = {}
    for subkey, value in found.get(key, {}).items():
        if signer_of(subkey, tally) is None:
            continue
        if not well_formed(value):
            tally["malformed"] += 1
            continue
        for peer_id, reason in value.items():
            reports.setdefault(peer_id, []).append(reason)
    return dict(sorted(reports.items(), key=lambda item: -len(item[1])))


def well_formed(value: object) -> bool:
    """Whether a report read from the DHT is what clients store: {peer id: reason}, within the limits."""
    return (
        isinstance(value, dict)
        and 0 < len(value) <= MAX_REPORTED
        and all(
            isinstance(peer_id, str)
            and 0 < len(peer_id) <= 128
            and isinstance(reason, str)
            and len(reason) <= MAX_REASON
            and (peer_id + reason).isprintable()  # shown in terminals: no control characters
            for peer_id, reason in value.items()
        )
    )
