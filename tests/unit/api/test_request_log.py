"""Operators' log lines: one per request when it ends, and running requests and throughput while there is
traffic."""

from __future__ import annotations

import logging
import time

from corolla.api.request_log import RequestLog


def test_a_request_line_names_its_id_tokens_speed_and_status(caplog):
    log = RequestLog()
    record = log.start("chatcmpl-1", "m", prompt_tokens=7)
    record.started -= 1.0  # it began a second ago, its first token came 0.25 s later
    record.first_token = record.started + 0.25
    record.completion_tokens = 11
    record.status = "400"
    with caplog.at_level(logging.INFO, logger="corolla.api.requests"):
        log.end(record)
    (line,) = caplog.messages
    for part in ("chatcmpl-1", "model=m", "prompt_tokens=7", "completion_tokens=11", "ttft=0.250s"):
        assert part in line
    assert line.endswith("status=400")
    assert 10 / 0.8 < float(line.split("tokens/s=")[1].split()[0]) <= 10 / 0.75  # 10 tokens after the first
    assert not log.running


def test_a_request_that_never_produced_a_token_has_no_ttft():
    record = RequestLog().start("cmpl-2", "m", 3)
    assert "ttft=- tokens/s=-" in record.line()


def test_the_stats_line_counts_throughput_since_the_last_one_and_stays_quiet_when_idle():
    log = RequestLog()
    assert log.stats_line() is None  # nothing happened
    log.start("a", "m", prompt_tokens=100)
    log.generated(40)
    time.sleep(0.05)
    line = log.stats_line()
    assert line.startswith("running requests: 1,")
    generated = float(line.split("generated tokens/s: ")[1])
    assert 0 < generated <= 40 / 0.05
    assert log.stats_line() is not None  # a request still runs
    log.running.clear()  # it ended
    assert log.stats_line() is None
