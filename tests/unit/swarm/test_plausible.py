"""Announced speeds bounded by their device's (swarm/policy/plausible.py): a server counts for at most
the median of the servers announcing its device and precision, where three or more do, and one claiming
IMPLAUSIBLE times that median or more counts for the slowest of them; a device fewer announce counts for
at most RARE_MARGIN times the fastest such median."""

from __future__ import annotations

from corolla.swarm.policy.plausible import DEVICE_MARGIN, IMPLAUSIBLE, RARE_MARGIN, speed_bounds
from corolla.wire.records import ServerStatus


def status(device: str, speed: float | None, precision: str = "") -> ServerStatus:
    return ServerStatus(
        0, 4, "0.1.0", "float16", 1024, 512, throughput=speed, device_name=device, precision=precision
    )


def test_a_speed_counts_for_at_most_its_devices_median():
    statuses = {
        "a": status("RTX 3060", 10.0),
        "b": status("RTX 3060", 12.0),
        "c": status("RTX 3060", 11.0),
        "liar": status("RTX 3060", 1100.0),  # 100x
        "h100": status("H100", 300.0),  # alone with its device: no median of its own
        "4bit": status("RTX 3060", 40.0, precision="int4"),  # another precision: not compared
        "nameless": status("", 500.0),  # names no device
        "new": status("RTX 3060", None),  # not measured yet: no speed, bounded like the others
    }
    bounds = speed_bounds(statuses)
    bound = DEVICE_MARGIN * 11.5  # the median of 10, 11, 12 and 1100
    assert bounds["a"] == bounds["new"] == bound < 100
    assert bounds["liar"] == 10.0  # 100x the median: counted as the slowest RTX 3060
    # a device too few announce, or none: at most RARE_MARGIN x the fastest kind's median (the RTX 3060s')
    assert bounds["h100"] == bounds["4bit"] == bounds["nameless"] == RARE_MARGIN * 11.5
    assert speed_bounds({"a": statuses["a"], "b": statuses["b"]}) == {}  # two are too few to judge
    assert speed_bounds({p: statuses[p] for p in ("a", "b", "h100", "nameless")}) == {}


def test_a_fast_honest_server_is_held_to_the_median_not_taken_for_a_liar():
    """Servers of one device differ (a pace against a start-up figure, a loaded machine): a speed under
    IMPLAUSIBLE times the median is held to the median; from IMPLAUSIBLE times on it is a lie."""
    speeds = {"a": 10.0, "b": 11.0, "c": 12.0, "d": 13.0}
    fast = 0.95 * IMPLAUSIBLE * 12.0  # under IMPLAUSIBLE x the median of the five (12)
    statuses = {peer: status("RTX 4090", speed) for peer, speed in {**speeds, "fast": fast}.items()}
    assert speed_bounds(statuses)["fast"] == DEVICE_MARGIN * 12.0
    statuses["fast"] = status("RTX 4090", IMPLAUSIBLE * 12.0)
    assert speed_bounds(statuses)["fast"] == 10.0


def test_a_device_of_its_own_counts_for_at_most_the_fastest_kind():
    """Liars naming devices nobody else announces are held to RARE_MARGIN times the median of the fastest
    device that enough servers announce, as is an honest rare one."""
    statuses = {f"h{i}": status("H100", 300.0 + i) for i in range(3)}
    statuses |= {f"r{i}": status("RTX 3060", 10.0 + i) for i in range(3)}
    statuses |= {f"liar{i}": status(f"Quantum {i}", 30_000.0) for i in range(5)}
    bounds = speed_bounds(statuses)
    assert all(bounds[f"liar{i}"] == RARE_MARGIN * 301.0 < 30_000 for i in range(5))
    assert bounds["r0"] == DEVICE_MARGIN * 11.0 and bounds["h0"] == DEVICE_MARGIN * 301.0


def test_a_liar_in_a_blocks_key_pushes_no_honest_server_out_of_it():
    """A server choosing its level counts no server of implausible speed as faster than itself: liars
    write themselves into the blocks' keys as they like, and must not take honest servers' places there
    (a liar among fast devices, bounded to the slowest of them, is still faster than slower devices)."""
    from corolla.swarm.policy.plausible import announced_kinds, bounded, implausible
    from corolla.swarm.records.record_cells import Walk

    statuses = {f"fast{i}": status("RTX 4090", 100.0 + i) for i in range(3)}
    statuses["liar"] = status("RTX 4090", 10_000.0)
    statuses["slow"] = status("RTX 3060", 10.0)
    assert implausible(announced_kinds(statuses)) == {"liar"}
    believed = bounded({peer: record.speed for peer, record in statuses.items()}, speed_bounds(statuses))
    assert believed["liar"] == 100.0 > believed["slow"]  # the slowest RTX 4090: faster than an RTX 3060
    walk = Walk("m", 1, where=0)
    walk.add({(0, 0): list(statuses)}, believed, implausible(announced_kinds(statuses)))
    assert walk.faster([0], "slow", 10.0) == [3]  # the honest RTX 4090s, not the liar
    doubting_none = Walk("m", 1, where=0)
    doubting_none.add({(0, 0): list(statuses)}, believed)
    assert doubting_none.faster([0], "slow", 10.0) == [4]


def test_a_key_holding_liars_makes_room_for_more_honest_servers():
    """Under a key holding doubted records, a server enters level 0 while fewer than HONEST_PER_DOUBTED
    times as many servers are faster: honest servers keep the larger share of what every reader reads."""
    from corolla.swarm.records.record_cells import CELL_SERVERS, HONEST_PER_DOUBTED, Walk, choose_level

    walk = Walk("m", 2, where=0)
    liars = [f"liar{i}" for i in range(10)]
    walk.add({(0, 0): [f"h{i}" for i in range(40)] + liars, (0, 1): ["h0"]}, {}, liars)
    assert walk.room([1]) == CELL_SERVERS and walk.room([0, 1]) == HONEST_PER_DOUBTED * 10 == 40
    others = [[50, 1], [0]]
    assert choose_level(others, None, [35, 0], room=walk.room([0, 1])) == 0  # 35 faster: under 40
    assert choose_level(others, None, [35, 0]) == 1  # without liars there, 32 is the room
    assert choose_level(others, 0, [70, 0], room=40) == 0 and choose_level(others, 0, [72, 0], room=40) == 1
