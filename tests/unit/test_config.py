"""Configurations check their own ranges when built, so Python callers and the CLI get the same errors."""

import argparse

import pytest

from corolla.cli import server as server_cli
from corolla.config import ApiConfig, ClientConfig, EngineConfig, ServerConfig, SwarmConfig
from corolla.errors import InvalidRequest


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: EngineConfig(page_size=0), r"page_size \(--page-size\) must be greater than 0, got 0"),
        (lambda: EngineConfig(max_batch_tokens=-1), r"max_batch_tokens \(--max-batch-tokens\) must be"),
        (lambda: EngineConfig(max_batch_wait_ms=-1), r"max_batch_wait_ms \(--max-batch-wait-ms\) must be at"),
        (lambda: EngineConfig(max_cache_tokens=8, page_size=16), "at least one page of 16 tokens, got 8"),
        (lambda: ServerConfig(model="m", step_timeout=0), r"step_timeout \(--step-timeout\) must be greater"),
        (lambda: ServerConfig(model="m", blocks=(3, 1)), r"blocks \(--blocks\) must be A:B with 0 <= A < B"),
        (lambda: ServerConfig(model="m", dtype="int3"), r"dtype \(--dtype\) must be one of float32"),
        (
            lambda: ServerConfig(model="m", quantize="nf4"),
            r"quantize \(--quantize\) must be one of int8, int4",
        ),
        (lambda: ServerConfig(model="m", metrics_port=70000), "metrics_port .* must lie in 1..65535"),
        (lambda: SwarmConfig(port=-1), "port .* must lie in 0..65535"),
        (lambda: SwarmConfig(announce_host="203.0.113.7"), r"needs a fixed port \(--port\)"),
        (lambda: ApiConfig(port=0), r"port \(--port\) must lie in 1..65535, got 0"),
        (lambda: ApiConfig(max_model_len=1), r"max_model_len \(--max-model-len\) must be at least 2, got 1"),
        (lambda: ApiConfig(stats_interval=-1), r"stats_interval \(--stats-interval\) must be at least 0"),
        (
            lambda: ApiConfig(embedding_pooling="max"),
            r"embedding_pooling \(--embedding-pooling\) must be one",
        ),
        (lambda: ApiConfig(api_keys=("ok", " ")), r"api_keys \(--api-key\) must not be empty"),
        (
            lambda: ApiConfig(default_temperature=-1),
            r"default_temperature \(--default-temperature\) must be at",
        ),
        (lambda: ApiConfig(default_temperature=2.5), r"default_temperature .* must be at most 2, got 2.5"),
        (lambda: ClientConfig(request_timeout=0), "request_timeout must be greater than 0"),
    ],
)
def test_bad_values_are_refused_with_their_name(build, message):
    with pytest.raises(InvalidRequest, match=message):
        build()


def parse_server(*argv: str) -> ServerConfig:
    parser = argparse.ArgumentParser()
    server_cli.add_parser(parser.add_subparsers())
    return server_cli.build_config(parser.parse_args(["server", "model", *argv]))


def test_the_cli_builds_the_same_configuration():
    config = parse_server("--block-size=8", "--max-batch-wait-ms=0", "--blocks=0:3", "--step-timeout=9")
    assert config.engine == EngineConfig(page_size=8, max_batch_wait_ms=0)  # --block-size: the old name
    assert (config.blocks, config.step_timeout, config.model) == ((0, 3), 9.0, "model")
    assert parse_server("--page-size", "32").engine.page_size == 32
    defaults = parse_server()
    assert defaults.engine == EngineConfig() and defaults == ServerConfig(model="model", swarm=defaults.swarm)
    with pytest.raises(InvalidRequest, match=r"max_sessions \(--max-sessions\)"):
        parse_server("--max-sessions", "0")
