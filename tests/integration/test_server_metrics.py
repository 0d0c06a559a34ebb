"""`corolla server --metrics-port`: Prometheus figures read while sessions run, and after they end."""

from __future__ import annotations

import re
import threading
import urllib.request

import torch

from corolla.launch.local import LocalSwarm, free_port
from corolla.server.hosting.pace import MIN_PASSES
from swarm_helpers import connect


def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(corolla_\S+) (\S+)$", text, re.M)}


def test_server_metrics_follow_sessions_and_passes(tiny_models):
    ports = [free_port(), free_port()]
    with LocalSwarm(str(tiny_models["llama"]), [], server_args=["--max-cache-tokens", "2048"]) as swarm:
        for blocks, port in zip([(0, 3), (3, 6)], ports, strict=True):
            swarm.add_server(blocks, extra_args=["--metrics-port", str(port)])
        idle = scrape(ports[0])
        measured = idle["corolla_server_blocks_per_second"]  # at start, before any pass
        assert idle["corolla_server_sessions"] == 0
        assert idle["corolla_server_free_cache_tokens"] == idle["corolla_server_cache_tokens"] == 2048
        with connect(tiny_models["llama"], swarm) as model:
            during = {}
            with model.inference_session(max_length=64) as session:
                session.step(model.head.embed(torch.randint(0, 100, (2, 20))))
                during = {port: scrape(port) for port in ports}
            threads = [
                threading.Thread(
                    target=model.generate,
                    args=(torch.randint(0, 100, (1, 8)),),
                    kwargs={"max_new_tokens": 12},
                )
                for _ in range(4)
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(120)
            # one session's decode steps alone: passes of one row, enough for the pace
            # (server/hosting/pace.py)
            model.generate(torch.randint(0, 100, (1, 8)), max_new_tokens=MIN_PASSES + 2)
        for port in ports:
            assert during[port]["corolla_server_sessions"] == 1
            assert during[port]["corolla_server_free_cache_tokens"] < 2048  # two rows of 20 tokens cached
            after = scrape(port)
            assert after["corolla_server_engine_passes_total"] >= 12
            assert after["corolla_server_batch_rows_count"] == after["corolla_server_engine_passes_total"]
            assert after["corolla_server_batch_rows_sum"] == after["corolla_server_engine_rows_total"]
            assert after["corolla_server_pass_seconds_count"] == after["corolla_server_engine_passes_total"]
            assert after["corolla_server_pass_seconds_sum"] > 0
        paced = scrape(ports[0])["corolla_server_blocks_per_second"]
        # the same machine's speed, now from its passes (a figure equal to the start-up one to the last
        # digit would mean the passes were not counted)
        assert paced != measured and measured / 20 < paced < measured * 20, (measured, paced)
    assert all(not s.alive for s in swarm.servers)
