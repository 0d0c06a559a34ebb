"""Seeing the swarm: the dashboard in a real headless Chromium, `corolla status`, and the 503 for gaps.

Chromium is Debian's `chromium` package (`make test` installs it when it can), on loopback only
(tests/browser.py).
"""

from __future__ import annotations

import json
import re
import subprocess
import urllib.error
import urllib.request

import pytest

from browser import ARTIFACTS, LOOPBACK_ONLY, chromium
from corolla.launch.local import LocalSwarm
from swarm_helpers import run_corolla


def coverage(swarm: LocalSwarm, num_blocks: int) -> list[int]:
    counts = [0] * num_blocks
    for server in swarm.servers:
        for index in range(*server.blocks):
            counts[index] += 1
    return counts


@pytest.fixture(scope="module")
def api(smol_api):
    return smol_api


def test_the_dashboard_draws_every_block_and_server(api, smol_swarm, tmp_path):
    browser = chromium()
    profile = ["--user-data-dir=" + str(tmp_path / "profile")]
    # virtual time runs the page's scripts (its fetch of /v1/swarm included) before the DOM is dumped
    dom = subprocess.run(
        [browser, *LOOPBACK_ONLY, *profile, "--virtual-time-budget=15000", "--dump-dom", f"{api.url}/"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    assert 'data-loaded="true"' in dom, dom[-2000:]
    cells = {int(i): int(n) for i, n in re.findall(r'data-block="(\d+)" data-servers="(\d+)"', dom)}
    assert cells == dict(enumerate(coverage(smol_swarm, 30)))
    rows = set(re.findall(r'data-peer="([^"]+)" data-start="(\d+)" data-end="(\d+)"', dom))
    assert rows == {(s.peer_id, str(s.blocks[0]), str(s.blocks[1])) for s in smol_swarm.servers}
    assert "30 blocks, 5 servers, every block covered" in dom
    assert dom.count('class="reached"') == 5  # how each is reached (and through which relays)

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    screenshot = ARTIFACTS / "dashboard.png"
    subprocess.run(
        [browser, *LOOPBACK_ONLY, *profile, "--virtual-time-budget=15000", "--window-size=1300,800",
         f"--screenshot={screenshot}", f"{api.url}/"],
        capture_output=True,
        timeout=120,
        check=True,
    )  # fmt: skip
    assert screenshot.stat().st_size > 10_000


def test_swarm_json_lists_the_servers(api, smol_swarm):
    with urllib.request.urlopen(f"{api.url}/v1/swarm", timeout=30) as response:
        swarm = json.loads(response.read())
    assert swarm["num_blocks"] == 30 and swarm["uncovered"] == []
    assert {s["peer_id"] for s in swarm["servers"]} == {s.peer_id for s in smol_swarm.servers}
    assert all(s["state"] == "online" and s["free_cache_tokens"] > 0 for s in swarm["servers"])


def corolla_status(initial_peers: list[str]) -> str:
    (result,) = run_corolla(["status", "--no-nat-port-map", "--initial-peers", *initial_peers])
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_status_prints_every_server_span(smol_swarm):
    out = corolla_status(smol_swarm.initial_peers)
    assert "30 blocks, 5 servers" in out and "every block is covered" in out
    for server in smol_swarm.servers:
        line = next(line for line in out.splitlines() if line.startswith(f"...{server.peer_id[-8:]}"))
        assert f"{server.blocks[0]}:{server.blocks[1]}" in line.split() and "online" in line.split()


def test_uncovered_blocks_get_a_503_naming_them(smollm2_path):
    with LocalSwarm(str(smollm2_path), []) as swarm:
        server = swarm.add_server((0, 10), wait=False)  # the server and the API start side by side
        api = swarm.add_api(extra_args=["--routing-timeout", "2"])
        swarm.wait_ready(server)
        body = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "hi"}]}
        request = urllib.request.Request(
            f"{api.url}/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(request, timeout=60)
        assert info.value.code == 503
        error = json.loads(info.value.read())["error"]
        assert error["code"] == "missing_blocks" and "10-29" in error["message"]
        status = corolla_status(swarm.initial_peers)
        assert "uncovered blocks: 10-29" in status
