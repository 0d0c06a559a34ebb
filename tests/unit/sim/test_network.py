"""The simulated internet and servers' speeds (corolla.sim): peers behind home routers reach each other
through a relay unless a hole punch succeeds, uploads price a step's data, and a class's pass over a block
is measured or priced from its hardware by the calibration of corolla's engine on this machine."""

from __future__ import annotations

import random

import pytest

from corolla.sim.compute import calibration, pass_cost
from corolla.sim.network import Network
from corolla.sim.scenario import ServerClass


def network(punch: float) -> Network:
    net = Network((10.0, 110.0), random.Random(0), hidden_bytes=16384, punch=punch)
    net.place("relay", upload_mbps=1000)
    for name in ("home", "other_home"):
        net.place(name, upload_mbps=10, behind_nat=True).relay = "relay"
    net.place("public", upload_mbps=100)
    return net


def test_two_peers_behind_routers_go_through_the_relay_unless_the_hole_punch_succeeds():
    never = network(punch=0.0)
    assert never.relay_of("home", "other_home") == "relay"
    through = never.distance("home", "relay") + never.distance("relay", "other_home")
    assert never.rtt("home", "other_home") == pytest.approx(through)
    assert never.rtt("home", "other_home") >= never.distance("home", "other_home")
    # a step's data crosses the caller's upload and then the relay's
    assert never.transfer("home", "other_home") == pytest.approx(16384 * 8 / 10e6 + 16384 * 8 / 1000e6)
    always = network(punch=1.0)
    assert always.relay_of("home", "other_home") is None
    assert always.rtt("home", "other_home") == pytest.approx(always.distance("home", "other_home"))


def test_a_public_peer_and_one_behind_a_router_connect_directly():
    net = network(punch=0.0)
    for a, b in (("home", "public"), ("public", "home")):
        assert net.relay_of(a, b) is None and net.rtt(a, b) == pytest.approx(net.distance(a, b))
    # a decode step's true round trip carries the hidden state both ways over each side's upload
    data = 16384 * 8 / 10e6 + 16384 * 8 / 100e6
    assert net.step_round_trip("home", "public") == pytest.approx(net.distance("home", "public") + data)
    # what push routing reads of a link: the round trip plus twice the one-way data (it halves it)
    assert net.links()["public"]["home"] == pytest.approx(net.rtt("public", "home") + 2 * 16384 * 8 / 100e6)


def test_a_hole_punch_succeeds_for_about_its_share_of_pairs():
    net = Network((5.0, 300.0), random.Random(0), punch=0.7)
    for i in range(200):
        net.place(f"peer{i}", behind_nat=True).relay = "peer0"
    relayed = sum(net.relay_of(f"peer{i}", f"peer{j}") is not None for i in range(1, 200) for j in range(i))
    assert 0.25 < relayed / (199 * 200 / 2) < 0.35
    assert net.relay_of("peer5", "peer9") == net.relay_of("peer5", "peer9")  # a pair's outcome holds


def hardware(**changes) -> ServerClass:
    spec = {"name": "gpu", "share": 1, "min_blocks": 1, "max_blocks": 1, "memory_gbps": 1000, "tflops": 100}
    return ServerClass.model_validate({**spec, **changes})


def test_a_class_priced_from_its_hardware_scales_the_engines_measured_pass():
    found = calibration()
    params = found["block"]["params"]
    assert found["fixed_s"] > 0 and found["per_token_s"] > 0 and params > 800e6  # a 70B-shaped block
    cost = pass_cost(hardware())
    assert cost.fixed == pytest.approx(params * 2 / 1e12 / found["memory_efficiency"])
    assert cost.per_token == pytest.approx(2 * params / 1e14 / found["compute_efficiency"])
    # twice the bandwidth halves the fixed part, 4-bit weights quarter it; tokens cost what compute says
    assert pass_cost(hardware(memory_gbps=2000)).fixed == pytest.approx(cost.fixed / 2)
    assert pass_cost(hardware(bytes_per_param=0.5)).fixed == pytest.approx(cost.fixed / 4)
    assert pass_cost(hardware(tflops=200)).per_token == pytest.approx(cost.per_token / 2)
    assert cost.seconds(8) == pytest.approx(cost.fixed + 8 * cost.per_token)
    measured = hardware(memory_gbps=None, tflops=None, seconds_per_block=0.01, seconds_per_token=0.001)
    assert pass_cost(measured).seconds(3) == pytest.approx(0.013)


def test_a_class_gives_its_speed_one_way_only():
    with pytest.raises(ValueError, match="either seconds_per_block or both memory_gbps and tflops"):
        hardware(tflops=None)
    with pytest.raises(ValueError, match="either seconds_per_block or both"):
        hardware(seconds_per_block=0.01)
