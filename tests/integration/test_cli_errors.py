"""Bad swarm options on the real command line: one line naming the cause and the fix, exit status 2."""

from __future__ import annotations

import json
import os
import socket
import subprocess

import pytest

from corolla.launch.local import READY_DHT, PeerProcess, free_port
from swarm_helpers import run_corolla

# a well-formed address of a peer that does not exist: nothing listens on port 1
UNREACHABLE = "/ip4/127.0.0.1/tcp/1/p2p/QmXfmJmpNSm5pjFXvEMcXxf2NAzAvmbeWRbxeAjJwHiFHf"
LOOPBACK = ["--no-nat-port-map"]


def assert_one_line(result: subprocess.CompletedProcess, text: str) -> None:
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert text in last, result.stderr[-3000:]


@pytest.fixture
def taken_port():
    """A port that a plain socket listens on (another program)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def test_unreachable_peers_and_taken_ports_get_one_line(tiny_models, taken_port):
    llama = str(tiny_models["llama"])
    port = str(taken_port)
    unreachable = ["--initial-peers", UNREACHABLE, *LOOPBACK]
    results = run_corolla(
        ["status", *unreachable],
        ["generate", llama, *unreachable, "--host", "127.0.0.1", "What is the capital of France?"],
        ["dht", "--host", "127.0.0.1", "--port", port, *LOOPBACK],
        ["server", llama, "--host", "127.0.0.1", "--port", port, *LOOPBACK],
        ["api", llama, "--p2p-port", port, "--port", str(free_port()), *unreachable],
    )
    status, generate, dht, server, api = results
    assert_one_line(status, f"corolla status: no --initial-peers answered ({UNREACHABLE})")
    assert status.stderr.count("\n") == 1, status.stderr
    assert_one_line(generate, "corolla generate: no --initial-peers answered")  # the prompt was not swallowed
    for result, command in ((dht, "dht"), (server, "server"), (api, "api")):
        assert_one_line(
            result, f"corolla {command}: swarm port {port} on 127.0.0.1 is in use by another process"
        )


def test_the_api_refuses_a_taken_http_port_before_it_joins_the_swarm(tiny_models, taken_port):
    (api,) = run_corolla(["api", str(tiny_models["llama"]), "--port", str(taken_port), *LOOPBACK])
    assert_one_line(api, f"corolla api: HTTP port {taken_port} on 127.0.0.1 is not available")
    assert "Serving" not in api.stderr


def test_malformed_peers_and_spans_are_refused_before_anything_starts(tiny_models):
    llama, gemma4 = str(tiny_models["llama"]), str(tiny_models["gemma4"])
    results = run_corolla(
        ["status", "--initial-peers", "127.0.0.1:31337"],
        ["server", llama, "--initial-peers", "/ip4/127.0.0.1/tcp/31337"],
        ["status", "--initial-peers", UNREACHABLE, "--host", "localhost"],
        ["server", gemma4, "--blocks", "0:5", *LOOPBACK],  # block 5 attends with block 4's keys
        ["dht", "--relay-time-limit", "0", *LOOPBACK],
        ["sim", "nowhere"],
        ["sim", "small", "--plot", "coverage.txt"],
        ["sim", "small", "--speculation", "--acceptance", "1"],
    )
    no_maddr, no_peer_id, bad_host, cut, no_limit, no_scenario, bad_plot, sure = results
    assert_one_line(sure, "argument --acceptance: must lie in [0, 1), got 1.0")
    assert_one_line(
        no_limit, "corolla dht: relay_time_limit (--relay-time-limit) must be greater than 0, got 0"
    )
    bundled = "crash10, day, five, flash, liars, one_by_one, small, thin, waves"
    assert_one_line(no_scenario, f"corolla sim: no scenario file 'nowhere' (bundled: {bundled})")
    assert_one_line(
        bad_plot, "corolla sim: --plot coverage.txt: the file must end in one of .png, .svg, .pdf"
    )
    assert bad_plot.stdout == ""  # refused before simulating anything
    assert_one_line(cut, "corolla server: blocks 0:5 cut gemma4_text's layers 4-5: layer 5 uses layer 4's")
    assert "Measured" not in cut.stderr  # refused before measuring (or starting) anything
    assert_one_line(no_maddr, "argument --initial-peers: '127.0.0.1:31337' is not a multiaddress")
    assert_one_line(
        no_peer_id, "argument --initial-peers: '/ip4/127.0.0.1/tcp/31337' has no /p2p/PEER_ID part"
    )
    assert_one_line(bad_host, "corolla status: --host 'localhost' is not an IP address")


def test_a_second_peer_on_the_same_port_is_refused(tmp_path):
    """libp2p listens with SO_REUSEPORT: without the check both peers would start and share the port."""
    port = str(free_port())
    args = ["dht", "--host", "127.0.0.1", "--port", port, *LOOPBACK]
    first = PeerProcess("dht", args, tmp_path / "dht.log", dict(os.environ))
    try:
        first.wait_for(READY_DHT, 60)
        (second,) = run_corolla(args, timeout=40)
        assert_one_line(second, f"corolla dht: swarm port {port} on 127.0.0.1 is in use by another process")
        assert first.alive
    finally:
        first.stop()


def test_models_corolla_cannot_serve_are_refused_naming_their_type(tmp_path):
    def folder(name: str, config: dict) -> str:
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
        return str(tmp_path / name)

    t5 = folder("t5", {"model_type": "t5", "d_model": 64, "num_layers": 2})
    vit = folder("vit", {"model_type": "vit", "hidden_size": 64})
    layers = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2}
    unknown = folder("ocr", {"model_type": "unlimited_ocr_text", **layers})  # attention to reference tokens
    results = run_corolla(
        ["server", t5, "--blocks", "0:1", *LOOPBACK],
        ["server", vit, "--blocks", "0:1", *LOOPBACK],
        ["server", unknown, "--blocks", "0:1", *LOOPBACK],
    )
    for result, model_type in zip(results, ("t5", "vit"), strict=False):
        assert_one_line(result, f"corolla server: model_type '{model_type}' is not a decoder-only causal LM")
        assert "tested: llama, mistral" in result.stderr
    refusal = (
        "corolla server: unlimited_ocr_text: layer types ['reference_sliding_attention'] are not supported"
    )
    assert_one_line(results[2], refusal)


def test_identities_and_allowed_peer_lists_on_the_command_line(tmp_path):
    key, ed25519 = tmp_path / "me.key", tmp_path / "ed25519.key"
    ed25519.write_bytes(bytes([8, 1, 18, 64]) + b"x" * 64)  # a libp2p PrivateKey protobuf of type Ed25519
    bad_list = tmp_path / "allowed.txt"
    bad_list.write_text("# members\nQmNotAPeerId0\n")
    (made,) = run_corolla(["identity", str(key)])
    results = run_corolla(
        ["identity", str(key)],
        ["dht", "--host", "127.0.0.1", "--identity", str(ed25519), *LOOPBACK],
        ["dht", "--host", "127.0.0.1", "--allowed-peers", str(bad_list), *LOOPBACK],
        ["dht", "--host", "127.0.0.1", "--allowed-peers", str(tmp_path / "missing.txt"), *LOOPBACK],
    )
    again, other_type, bad, missing = results
    assert made.returncode == 0 and made.stdout.strip() == again.stdout.strip()  # made once, then read
    assert made.stdout.strip().startswith("Qm") and key.exists()
    assert_one_line(other_type, f"corolla dht: identity {ed25519} holds a Ed25519 key")
    assert_one_line(bad, f"corolla dht: allowed peers {bad_list}, line 2: 'QmNotAPeerId0' is not a peer id")
    assert_one_line(missing, f"corolla dht: --allowed-peers {tmp_path / 'missing.txt'}: No such file")
