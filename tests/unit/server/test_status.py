"""One status snapshot: rpc_info, the DHT record, the metrics and `corolla status` show the same figures."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest
import torch
from prometheus_client import generate_latest

from corolla.config import EngineConfig, ServerConfig
from corolla.engine.async_engine import PassTiming
from corolla.models.devices import device_info
from corolla.models.model_config import ModelConfig
from corolla.server.hosting.backend import SpanLoader
from corolla.server.hosting.pace import MIN_PASSES, Pace
from corolla.server.hosting.spans import HostedSpans
from corolla.server.inference.service import InferenceService, StepMessage
from corolla.server.metrics import ServerMetrics
from corolla.server.status import Compute, StatusBoard
from corolla.swarm.dht import RemoteSpan
from corolla.swarm.records.overview import build_overview, format_table
from corolla.wire import tensors as wire_tensors
from corolla.wire.messages import InferenceStep
from corolla.wire.records import ServerState, ServerStatus, block_uids


@pytest.fixture
async def board(tiny_models):
    path = Path(tiny_models["llama"])
    engine = EngineConfig(max_cache_tokens=256, page_size=4, max_batch_wait_ms=0)
    loader = SpanLoader(path, ModelConfig.from_folder(path), torch.float32, engine, session_timeout=60)
    spans = HostedSpans("tiny", loader.load, frozenset({"lora-a"}))
    await spans.start((1, 5))
    config = ServerConfig(model=str(path), inference_max_length=128, max_batch_size=4)
    inference = InferenceService(spans, config, 64, pusher=None)
    compute = Compute("float32", 42.5, device_info(torch.device("cpu")), pace=Pace())
    board = StatusBoard(spans, inference, config, "9.9.9", compute)
    board.state = ServerState.ONLINE
    yield board
    await spans.stop()


async def test_every_report_reads_the_same_snapshot(board):
    first = StepMessage(
        block_uids("tiny", 1, 5),
        InferenceStep(step_id="a", max_length=64, session_id="s"),
        [wire_tensors.serialize(torch.randn(2, 9, 64))],
    )
    steps: asyncio.Queue = asyncio.Queue()

    async def later():
        while (step := await steps.get()) is not None:
            yield step

    replies = board.inference.serve(first, later(), "client-peer")
    await anext(replies)  # one session of 2 rows x 9 positions: 3 pages of 4 per row
    for _ in range(50):  # the engine publishes its stats snapshot right after the pass
        if board.snapshot().cache_tokens_available < 256:
            break
        await asyncio.sleep(0.01)
    status = board.snapshot()
    assert (status.start, status.end, status.num_sessions, status.steps_from_client) == (1, 5, 1, 1)
    assert (status.cache_tokens_total, status.cache_tokens_available) == (256, 256 - 2 * 3 * 4)
    assert status.cache_bytes_per_token == 4 * (2 * 2 * 16) * 4  # 4 blocks: 2 kv heads of 16, k and v, fp32
    assert status.engine_passes >= 1 and status.engine_rows == 2 * status.engine_passes
    assert (status.throughput, status.adapters, status.version) == (42.5, ("lora-a",), "9.9.9")
    assert status.pace is None and status.speed == 42.5  # too few passes for a pace yet
    # where it computes: the device and its memory (here the CPU and the host's RAM)
    assert status.device == "cpu" and status.device_name and status.device_memory > 2**30

    assert ServerStatus.from_bytes(status.to_bytes()) == status  # rpc_info's reply
    assert ServerStatus.from_dict(status.to_dict()) == status  # the DHT record

    metrics = ServerMetrics()
    metrics.watch(board.snapshot)
    text = generate_latest(metrics.registry).decode()
    scraped = dict(re.findall(r"^(corolla_server_\w+) (\S+)$", text, re.M))
    assert float(scraped["corolla_server_sessions"]) == status.num_sessions
    assert float(scraped["corolla_server_free_cache_tokens"]) == status.cache_tokens_available
    assert float(scraped["corolla_server_cache_tokens"]) == status.cache_tokens_total
    assert float(scraped["corolla_server_engine_passes_total"]) == status.engine_passes
    assert float(scraped["corolla_server_engine_rows_total"]) == status.engine_rows

    for _ in range(MIN_PASSES):  # once its passes have shown their pace, that is what clients route by
        board.compute.pace.observe(PassTiming(rows=1, tokens=1, blocks=4, seconds=0.02))
    paced = board.snapshot()
    assert (paced.pace, paced.speed, paced.throughput) == (pytest.approx(200.0), paced.pace, 42.5)
    scraped = dict(
        re.findall(r"^(corolla_server_\w+) (\S+)$", generate_latest(metrics.registry).decode(), re.M)
    )
    assert float(scraped["corolla_server_blocks_per_second"]) == pytest.approx(200.0)
    assert (
        build_overview("tiny", 6, [RemoteSpan("peer-1", 1, 5, paced)]).to_dict()["servers"][0]["pace"]
        == 200.0
    )

    announced = RemoteSpan("peer-123456789", 1, 5, ServerStatus.from_dict(status.to_dict()))
    overview = build_overview("tiny", 6, [announced])
    (row,) = overview.to_dict()["servers"]
    assert (row["start"], row["end"], row["state"]) == (1, 5, "online")
    assert (row["num_sessions"], row["free_cache_tokens"], row["throughput"]) == (1, 232, 42.5)
    assert overview.coverage == (0, 1, 1, 1, 1, 0)
    line = format_table(overview).splitlines()[-1].split()
    assert line[:3] == ["...23456789", "1:5", "online"] and line[4] == "1" and line[6] == "232"
    assert row["device"] == f"cpu ({status.device_memory / 1e9:.0f} GB)" and line[-4] == "cpu"
    assert row["reachability"] == "" and line[-1] == "-"  # a server that has not said how it is reached

    await steps.put(None)
    assert [r async for r in replies] == []
    assert board.snapshot().num_sessions == 0
