"""`corolla api MODEL --initial-peers ...`: serve the OpenAI, Anthropic and Ollama HTTP APIs, a dashboard and
metrics."""

from __future__ import annotations

import argparse
import functools
import logging
import os
import signal
import socket

from corolla.cli.common import CLIENT_HOST, add_client_args, add_dht_prefix, add_swarm_args, client_config
from corolla.cli.config_options import add_field
from corolla.cli.signals import exit_on
from corolla.config import EMBEDDING_POOLINGS, ApiConfig, ClientConfig
from corolla.errors import StartFailed

logger = logging.getLogger(__name__)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "api",
        help="serve OpenAI's, Anthropic's and Ollama's HTTP APIs (and a swarm dashboard) backed by the swarm",
        description="Serve /v1/models, /v1/completions and /v1/chat/completions (streaming or not) and "
        "/v1/embeddings with MODEL's blocks running on the swarm, Anthropic's /v1/messages and "
        "/v1/messages/count_tokens, Ollama's /api/chat, /api/generate, "
        "/api/tags, /api/show and /api/version, plus vLLM's /tokenize, /detokenize and /version, /health, "
        "/metrics (Prometheus), /v1/swarm (JSON) and a dashboard of the swarm at /.",
    )
    parser.add_argument(
        "model", metavar="MODEL", help="the same model folder, .gguf file or alias as the servers"
    )
    option = functools.partial(add_field, parser, ApiConfig)
    option("host", "HTTP address (default: %(default)s)", dest="http_host")
    option("port", "HTTP port (default: %(default)s)", dest="http_port")
    option(
        "served_model_name",
        "the model id clients pass in requests (default: the model's name, e.g. SmolLM2-135M-Instruct)",
    )
    option(
        "max_model_len",
        "longest prompt + completion a request may ask for, capped by the model's context "
        "(default: %(default)s, the servers' default session limit)",
    )
    add_field(
        parser,
        ClientConfig,
        "routing_timeout",
        "how long a request waits for servers to cover every block before it gets a 503 naming the "
        "missing ones (default: %(default)ss)",
    )
    add_dht_prefix(parser, ClientConfig)
    _add_embedding_args(parser)
    _add_access_args(parser)
    add_client_args(parser)
    add_swarm_args(parser, default_host=CLIENT_HOST, listen_flag="p2p-")
    parser.set_defaults(run=run)


def _add_embedding_args(parser: argparse.ArgumentParser) -> None:
    """How /v1/embeddings makes one vector of an input (client/training/embeddings.py), and what the API
    logs."""
    add_field(
        parser,
        ApiConfig,
        "stats_interval",
        "log running requests and throughput this often while there is traffic (0: never; default: "
        "%(default)s); every request also gets a log line when it ends",
        metavar="SECONDS",
    )
    add_field(
        parser,
        ApiConfig,
        "embedding_pooling",
        "how /v1/embeddings pools an input's final hidden states into one vector: mean (the "
        "default) averages every token's, which is what a generic decoder model gives usable embeddings "
        "from; last takes the last token's, which embedding-tuned decoders (e5-mistral, gte-Qwen) expect",
        choices=EMBEDDING_POOLINGS,
    )


def _add_access_args(parser: argparse.ArgumentParser) -> None:
    """Who may call the API (api/access.py)."""
    add_field(
        parser,
        ApiConfig,
        "api_keys",
        "require `Authorization: Bearer KEY` (or `x-api-key: KEY`) on every /v1 and /api route (repeat for "
        "several keys; default: COROLLA_API_KEY if set, else no key)",
        flag="--api-key",
        default=None,  # not given: COROLLA_API_KEY (see run)
        metavar="KEY",
    )
    add_field(
        parser,
        ApiConfig,
        "allowed_origins",
        "web origins whose pages may call the API (CORS), e.g. https://app.example.com, or * for any "
        "(repeat for several; default: none)",
        metavar="ORIGIN",
    )
    add_field(
        parser,
        ApiConfig,
        "chat_template",
        "a Jinja chat template used instead of the model's own: a file, or chatml-tools (bundled: ChatML "
        "with Hermes tool calls, for ChatML models such as SmolLM2 whose template renders no tools; default: "
        "the model's)",
        metavar="FILE",
    )
    add_field(
        parser,
        ApiConfig,
        "default_temperature",
        "the sampling temperature of requests that set none (0: greedy; default: each API's own, 1.0, and "
        "Ollama's 0.8), e.g. for agents that never send one",
        metavar="T",
    )
    add_field(
        parser,
        ApiConfig,
        "stored_responses",
        "how many answers of the Responses API to keep per API key, least recently used evicted, so that "
        "a request may continue one with previous_response_id (0: keep none; default: %(default)s)",
        metavar="N",
    )


def run(args: argparse.Namespace) -> None:
    import uvicorn

    from corolla.api.app import build_app
    from corolla.api.chat import chat_template
    from corolla.api.metrics import ApiMetrics
    from corolla.api.serving import OpenAIServing
    from corolla.client.model import DistributedModelForCausalLM

    # uvicorn stops on SIGTERM, then raises it again with the handler it found: this one, which ends the
    # command through `with model` (its DHT process and daemon stop too) instead of killing it
    exit_on(signal.SIGTERM, status=0)
    exit_on(signal.SIGHUP)
    api = api_config(args)  # checked before the swarm is joined
    template = chat_template(api.chat_template) if api.chat_template else None
    check_http_port(api.host, api.port)  # before the swarm and the "Serving at" line
    config = client_config(args, routing_timeout=args.routing_timeout)
    with DistributedModelForCausalLM.from_pretrained(
        args.model, dht_prefix=args.dht_prefix, config=config
    ) as model:
        name = api.served_model_name or model.source.name
        if template is not None and model.tokenizer is not None:
            model.tokenizer.chat_template = template
        serving = OpenAIServing(model, name, api.max_model_len, ApiMetrics())
        serving.default_temperature = api.default_temperature
        logger.info("Serving %s at http://%s:%d/v1 (dashboard at /)", name, api.host, api.port)
        uvicorn.run(
            build_app(serving, api),
            host=api.host,
            port=api.port,
            log_level="warning",
            timeout_graceful_shutdown=5,
        )


def api_config(args: argparse.Namespace) -> ApiConfig:
    """ApiConfig of the options (no --api-key: COROLLA_API_KEY's, if set), which checks them."""
    keys = args.api_keys or ([os.environ["COROLLA_API_KEY"]] if os.environ.get("COROLLA_API_KEY") else [])
    return ApiConfig(
        host=args.http_host,
        port=args.http_port,
        served_model_name=args.served_model_name,
        max_model_len=args.max_model_len,
        stats_interval=args.stats_interval,
        embedding_pooling=args.embedding_pooling,
        api_keys=tuple(keys),
        allowed_origins=tuple(args.allowed_origins),
        stored_responses=args.stored_responses,
        chat_template=args.chat_template,
        default_temperature=args.default_temperature,
    )


def check_http_port(host: str, port: int) -> None:
    """StartFailed unless this process can listen on host:port (another program may hold it)."""
    from corolla.swarm.p2p.addresses import listen_error

    try:
        code = listen_error(host, port)
    except socket.gaierror as e:
        raise StartFailed(f"--host {host!r} is not an address of this machine ({e.strerror})") from None
    if code is not None:
        raise StartFailed(
            f"HTTP port {port} on {host} is not available ({os.strerror(code)}): stop what holds it, or pass "
            "another --port"
        )
