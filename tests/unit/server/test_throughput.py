"""The announced speed: measured through the engine (one sequence's steps, and how a batch's grow), cached
for a while, then measured again."""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import time

import pytest
import torch

from corolla.models.span import Span
from corolla.server.hosting import startup_speed as throughput
from tiny_models import RECURRENT


def test_a_cached_figure_stands_for_max_age_then_is_measured_again(tiny_models, tmp_path, monkeypatch):
    monkeypatch.setenv("COROLLA_CACHE", str(tmp_path))
    span = Span.load(tiny_models["llama"], 0, 2, torch.float32)
    first = throughput.measure_throughput(span)
    assert first > 0
    path = tmp_path / "throughput.json"
    (key,) = json.loads(path.read_text())

    def cache(blocks_per_s: float, age: float) -> None:
        entry = {"blocks_per_s": blocks_per_s, "batch_growth": 0.5, "measured_at": time.time() - age}
        path.write_text(json.dumps({key: entry}))

    cache(12345.0, age=10.0)
    assert throughput.measure_speed(span) == throughput.Speed(12345.0, 0.5)  # fresh: taken from the cache
    cache(12345.0, age=throughput.MAX_AGE + 1)
    measured = throughput.measure_throughput(span)
    assert measured != 12345.0 and json.loads(path.read_text())[key]["blocks_per_s"] == measured
    path.write_text(json.dumps({key: 645.0}))  # an entry of the old format (cached forever) is replaced
    assert throughput.measure_throughput(span) != 645.0
    old = {"blocks_per_s": 645.0, "measured_at": time.time()}  # as cached before batch growth was measured
    path.write_text(json.dumps({key: old}))
    speed = throughput.measure_speed(span)
    assert speed.blocks_per_s != 645.0 and 0 <= speed.batch_growth < 1  # 8 sequences' step: under 8 one's
    path.write_text("[not a map")
    assert throughput.measure_throughput(span) > 0


@pytest.mark.parametrize("family", RECURRENT)
def test_spans_with_recurrent_states_are_measured_too(family, tiny_models, tmp_path, monkeypatch):
    """A batch of 8 rows holding recurrent states fits the measuring engine's cache (a row short of pages
    would wait for them for ever, and the server would never start)."""
    monkeypatch.setenv("COROLLA_CACHE", str(tmp_path))
    span = Span.load(tiny_models[family], 0, 2, torch.float32)
    speed = throughput.measure_speed(span, use_cache=False)
    assert speed.blocks_per_s > 0 and speed.batch_growth >= 0


def _measure_in_child(path, cache: str, results) -> None:
    os.environ["COROLLA_CACHE"] = cache
    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    throughput.logger.addHandler(handler)
    throughput.logger.setLevel(logging.INFO)
    speed = throughput.measure_speed(Span.load(path, 0, 2, torch.float32))
    results.put((speed, sum(line.startswith("Measured") for line in said)))


def test_servers_starting_together_measure_a_shape_once(tiny_models, tmp_path):
    """Three server processes measuring the same blocks at once: one measures (alone), the others wait for
    its figure and read it from the cache."""
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    children = [
        context.Process(target=_measure_in_child, args=(tiny_models["llama"], str(tmp_path), results))
        for _ in range(3)
    ]
    for child in children:
        child.start()
    try:
        found = [results.get(timeout=120) for _ in children]
    finally:
        for child in children:
            child.join(timeout=30)
    speeds, measured = zip(*found, strict=True)
    assert sum(measured) == 1 and len(set(speeds)) == 1
