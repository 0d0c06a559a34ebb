"""`corolla demo`: a whole local swarm on 127.0.0.1 serving a real model, one chat answer, clean shutdown."""

from __future__ import annotations

import argparse
import signal
import sys
import time
from typing import TYPE_CHECKING

from corolla.cli.generate import add_generation_args, encode_prompt, sampling_params, stream_completion
from corolla.cli.signals import exit_on
from corolla.models.source import DEFAULT_MODEL, resolve_model

if TYPE_CHECKING:  # imported when the command runs: `corolla --help` stays quick
    from corolla.launch.local import LocalSwarm

DEFAULT_PROMPT = "What is the capital of France, and what is it famous for?"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="start a local swarm and chat with it",
        description="Start a DHT peer and several servers on 127.0.0.1 (separate processes, each hosting "
        "part of the model's blocks), stream the model's answer to a chat prompt through them, then shut "
        "everything down. The default model is the bundled SmolLM2-135M-Instruct.",
    )
    parser.add_argument(
        "prompt",
        nargs="?",
        default=DEFAULT_PROMPT,
        metavar="PROMPT",
        help="what to ask (default: %(default)r)",
    )
    parser.add_argument(
        "--model", default=DEFAULT_MODEL, help="model folder, .gguf file or alias (default: %(default)s)"
    )
    parser.add_argument("--servers", type=int, default=3, help="number of servers (default: %(default)s)")
    parser.add_argument("--workdir", default=None, help="keep the peers' logs in this folder")
    parser.add_argument(
        "--api",
        type=int,
        default=None,
        metavar="PORT",
        help="after the answer, keep the swarm up and serve the OpenAI API and the swarm dashboard at "
        "http://127.0.0.1:PORT until Ctrl-C",
    )
    add_generation_args(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> None:
    from corolla.client.model import DistributedModelForCausalLM

    exit_on(signal.SIGTERM, signal.SIGHUP)  # through LocalSwarm's exit: every peer is stopped
    params = sampling_params(args)
    from corolla.launch.local import LocalSwarm, even_spans
    from corolla.models.model_config import ModelConfig

    source = resolve_model(args.model)  # converts a GGUF once, before any server needs it
    num_blocks = ModelConfig.from_folder(source.path).num_hidden_layers
    spans = even_spans(num_blocks, max(1, min(args.servers, num_blocks)))
    print(
        f"Starting a local swarm: 1 DHT peer + {len(spans)} servers for {source.name} "
        f"(blocks {', '.join(f'{a}:{b}' for a, b in spans)})",
        file=sys.stderr,
        flush=True,
    )
    started = time.monotonic()
    with LocalSwarm(args.model, spans, workdir=args.workdir) as swarm:
        print(
            f"Swarm ready in {time.monotonic() - started:.1f}s; asking: {args.prompt}\n",
            file=sys.stderr,
            flush=True,
        )
        config = swarm.client_config()
        with DistributedModelForCausalLM.from_pretrained(args.model, config=config) as model:
            input_ids = encode_prompt(model.tokenizer, args.prompt, args.system, args.raw)
            generation_started = time.monotonic()
            _, num_tokens = stream_completion(model, input_ids, params, sys.stdout)
            elapsed = time.monotonic() - generation_started
        print(f"\n[{num_tokens} tokens in {elapsed:.1f}s through {len(spans)} servers]", file=sys.stderr)
        if args.api is not None:
            serve_api(swarm, args.api)
        print("[shutting the swarm down]", file=sys.stderr, flush=True)


def serve_api(swarm: LocalSwarm, port: int) -> None:
    api = swarm.add_api(port)
    print(
        f"OpenAI API: {api.url}/v1 (model {resolve_model(swarm.model).name}), dashboard: {api.url}/, "
        f"metrics: {api.url}/metrics. Logs: {swarm.workdir}. Ctrl-C stops everything.",
        file=sys.stderr,
        flush=True,
    )
    try:
        while api.alive and all(server.alive for server in swarm.servers):
            time.sleep(1)
    except KeyboardInterrupt:
        return
    print(f"A peer exited unexpectedly:\n{api.log_tail()}", file=sys.stderr)
