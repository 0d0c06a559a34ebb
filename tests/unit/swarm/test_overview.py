"""The swarm overview: servers of another model under the same prefix are shown and not counted; what
clients reported is shown."""

from __future__ import annotations

import dataclasses

from corolla.swarm.dht import RemoteSpan
from corolla.swarm.records.faulty_reports import MAX_REASON, MAX_REPORTED, well_formed
from corolla.swarm.records.overview import build_overview, format_table
from corolla.wire.records import RelayPath, ServerStatus


def server(peer_id: str, start: int, end: int, fingerprint: str) -> RemoteSpan:
    status = ServerStatus(start, end, "1.0", "float32", 64, 100, model_fingerprint=fingerprint)
    return RemoteSpan(peer_id, start, end, ServerStatus.from_dict(status.to_dict()))


SERVERS = [server("peer-a", 0, 4, "good"), server("peer-b", 4, 8, "good"), server("peer-c", 4, 8, "bad")]


def test_the_fingerprint_most_blocks_are_announced_with_is_the_models():
    overview = build_overview("m", 8, SERVERS)
    assert overview.model_fingerprint == "good"
    assert overview.coverage == (1,) * 8  # peer-c does not count
    states = {row["peer_id"]: row["state"] for row in overview.to_dict()["servers"]}
    assert states == {"peer-a": "online", "peer-b": "online", "peer-c": "other model"}
    (line,) = [line for line in format_table(overview).splitlines() if line.startswith("...peer-c")]
    assert "other model" in line


def test_a_given_fingerprint_wins_and_servers_without_one_are_taken_on_trust():
    old = server("peer-d", 0, 8, "")
    overview = build_overview("m", 8, [*SERVERS, old], model_fingerprint="bad")
    assert overview.coverage == (1,) * 4 + (2,) * 4  # peer-c and peer-d count; peer-a and peer-b do not
    assert "1 server" in format_table(build_overview("m", 8, [old])).splitlines()[0]
    assert "1 servers" not in format_table(build_overview("m", 8, [old]))


def test_records_of_servers_that_did_not_answer_are_shown_apart_and_never_counted():
    lure = dataclasses.replace(
        server("peer-x", 0, 8, "good"), info=ServerStatus(0, 8, "1.0", "float32", 64, 10**9)
    )
    overview = build_overview("m", 8, SERVERS[:1], silent=[lure])
    assert overview.coverage == (1,) * 4 + (0,) * 4 and overview.uncovered == (4, 5, 6, 7)
    shown = overview.to_dict()
    assert [row["peer_id"] for row in shown["servers"]] == ["peer-a"]
    assert shown["not_answering"] == [{"peer_id": "peer-x", "start": 0, "end": 8}]
    table = format_table(overview)
    assert "DHT records of servers that do not answer (not counted): ...peer-x (0:8)" in table
    assert "1 server" in table.splitlines()[0] and not any(
        line.startswith("...peer-x") for line in table.splitlines()
    )


def test_reports_of_faulty_servers_are_shown_and_only_well_formed_ones_read():
    overview = dataclasses.replace(
        build_overview("m", 8, SERVERS), reported_faulty=(("peer-b", ("wrong outputs", "wrong outputs")),)
    )
    assert "reported faulty by the spot checks of 2 clients: ...peer-b (wrong outputs)" in format_table(
        overview
    )
    assert overview.to_dict()["reported_faulty"] == {"peer-b": ["wrong outputs", "wrong outputs"]}
    assert well_formed({"peer-b": "wrong outputs"})
    too_many = {f"peer-{i}": "x" for i in range(MAX_REPORTED + 1)}
    for value in (
        {},
        [],
        {"peer-b": 3},
        {"peer-b": "x" * (MAX_REASON + 1)},
        {"": "x"},
        {"peer-b": "\x1b[2J"},
        too_many,
    ):
        assert not well_formed(value), value


def test_how_each_server_is_reached_is_shown_with_its_relays_and_their_limits():
    relay = "12D3KooWRakRqGMCZWZvmwggU793aGxsVVidMZQRoxjCmPvNrR8A"
    path = RelayPath(
        f"/ip4/11.79.0.10/tcp/31337/p2p/{relay}/p2p-circuit", time_limit=1800, data_limit=4 << 30
    )
    status = ServerStatus(0, 8, "1.0", "float32", 64, 100, reachability="relayed", relays=(path,))
    home = RemoteSpan("peer-h", 0, 8, ServerStatus.from_dict(status.to_dict()))
    public = dataclasses.replace(SERVERS[0], info=dataclasses.replace(SERVERS[0].info, reachability="direct"))
    overview = build_overview("m", 8, [home, public])
    rows = {row["peer_id"]: row for row in overview.to_dict()["servers"]}
    assert rows["peer-h"]["reachability"] == "relayed" and rows["peer-a"]["relays"] == []
    assert rows["peer-h"]["relays"] == [
        {"relay": relay, "address": path.address, "time_limit": 1800, "data_limit": 4 << 30}
    ]
    lines = format_table(overview).splitlines()
    assert [line for line in lines if line.startswith("...peer-h")][0].endswith(
        f"relayed via ...{relay[-8:]}"
    )
    assert [line for line in lines if line.startswith("...peer-a")][0].endswith("direct")
