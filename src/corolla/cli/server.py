"""`corolla server MODEL`: host a span of MODEL's blocks for the swarm."""

from __future__ import annotations

import argparse
import asyncio
import re

from corolla.cli.common import add_swarm_args, swarm_config
from corolla.config import ServerConfig
from corolla.errors import InvalidRequest
from corolla.server.server import Server, serve


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    defaults = ServerConfig(model="")
    parser = subparsers.add_parser(
        "server",
        help="serve a span of a model's blocks",
        description="Load a contiguous span of MODEL's transformer blocks, announce it on the swarm's DHT "
        "and answer inference and forward requests until SIGINT or SIGTERM (then it announces "
        "OFFLINE and stops). MODEL is a Hugging Face folder, a .gguf file, a hub id, or "
        "`smollm2` (the bundled SmolLM2-135M-Instruct).",
    )
    parser.add_argument("model", metavar="MODEL")
    blocks = parser.add_mutually_exclusive_group()
    blocks.add_argument(
        "--blocks",
        type=_block_range,
        default=None,
        metavar="A:B",
        help="host blocks A to B-1 (0-based, end exclusive)",
    )
    blocks.add_argument(
        "--memory-budget",
        type=_size,
        default=None,
        metavar="SIZE",
        help="without --blocks: host as many blocks as fit in SIZE (e.g. 2GB, 500MB) with 4096 tokens of "
        "cache each (default: half the available memory)",
    )
    blocks.add_argument(
        "--num-blocks",
        type=int,
        default=None,
        metavar="N",
        help="host N blocks where the swarm has the fewest servers (default: all blocks)",
    )
    parser.add_argument(
        "--dht-prefix", default=None, help="DHT key prefix (default: derived from the model name)"
    )
    parser.add_argument(
        "--dtype",
        default=defaults.dtype,
        choices=["float32", "float16", "bfloat16", "auto"],
        help="compute dtype (default: %(default)s)",
    )
    engine = parser.add_argument_group("engine (continuous batching)")
    engine.add_argument(
        "--max-cache-tokens",
        type=int,
        default=None,
        help="attention cache pool, in tokens over all hosted blocks (default: a quarter of the "
        "memory available at start, at most 262144)",
    )
    engine.add_argument(
        "--block-size",
        type=int,
        default=defaults.block_size,
        help="positions per cache block (default: %(default)s)",
    )
    engine.add_argument(
        "--max-batch-tokens",
        type=int,
        default=defaults.max_batch_tokens,
        help="tokens per engine pass: decode steps plus prefill chunks (default: %(default)s)",
    )
    engine.add_argument(
        "--max-batch-rows",
        type=int,
        default=defaults.max_batch_rows,
        help="sequence rows per engine pass; 1 turns batching across sessions off (default: %(default)s)",
    )
    engine.add_argument(
        "--forward-slice-tokens",
        type=int,
        default=defaults.forward_slice_tokens,
        help="forward/backward (training) work runs this many tokens (whole rows) per pass, between "
        "inference passes: smaller keeps chat latency steady under training, bigger trains faster "
        "(default: %(default)s)",
    )
    engine.add_argument(
        "--max-batch-wait-ms",
        type=float,
        default=defaults.max_batch_wait_ms,
        help="when fewer than half of the recently active sessions have a step waiting, wait up to this long "
        "for more before a pass (0: never wait; default: %(default)s)",
    )
    engine.add_argument(
        "--max-sessions",
        type=int,
        default=defaults.max_sessions,
        help="open inference sessions at once (default: %(default)s)",
    )
    parser.add_argument(
        "--inference-max-length",
        type=int,
        default=defaults.inference_max_length,
        help="longest inference session a client may open (default: %(default)s)",
    )
    parser.add_argument(
        "--max-batch-size",
        type=int,
        default=defaults.max_batch_size,
        help="most rows per session or forward request (default: %(default)s)",
    )
    parser.add_argument(
        "--max-forward-tokens",
        type=int,
        default=defaults.max_forward_tokens,
        help="most batch x length tokens per forward request (default: %(default)s)",
    )
    parser.add_argument(
        "--step-timeout",
        type=float,
        default=defaults.step_timeout,
        help="close a session whose next step does not arrive within this many seconds "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--session-timeout",
        type=float,
        default=defaults.session_timeout,
        help="close any session after this many seconds (default: %(default)s)",
    )
    parser.add_argument(
        "--announce-period",
        type=float,
        default=defaults.announce_period,
        help="re-announce on the DHT this often, in seconds (default: %(default)s)",
    )
    parser.add_argument(
        "--balance-period",
        type=float,
        default=defaults.balance_period,
        help="without --blocks: check this often (seconds) whether moving to other blocks would help the "
        "swarm, and move if so (0: never move; default: %(default)s)",
    )
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=defaults.drain_timeout,
        help="on SIGTERM/SIGINT, announce OFFLINE, refuse new sessions and give open ones this long to "
        "finish (a second signal stops at once; default: %(default)s)",
    )
    parser.add_argument(
        "--adapters",
        nargs="+",
        default=[],
        metavar="[NAME=]PATH",
        help="PEFT LoRA adapter folders to serve for this span (named after the folder unless NAME= is "
        "given); a request selects one by name with active_adapter",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus metrics (sessions, batch sizes, queue depth, free cache, pass times) at "
        "http://METRICS_HOST:PORT/metrics (default: off)",
    )
    parser.add_argument(
        "--metrics-host",
        default=defaults.metrics_host,
        help="address for --metrics-port (default: %(default)s)",
    )
    parser.add_argument(
        "--simulate-slow-ms",
        type=float,
        default=0.0,
        help="testing aid: make this server slow by sleeping this long after every engine pass",
    )
    parser.add_argument(
        "--num-threads",
        type=int,
        default=None,
        help="torch compute threads (default: torch's choice; use 1 when several peers share "
        "a small machine)",
    )
    add_swarm_args(parser, default_host="0.0.0.0")
    parser.set_defaults(run=run)


def _size(text: str) -> int:
    units = {"": 1, "B": 1, "KB": 2**10, "MB": 2**20, "GB": 2**30, "TB": 2**40}
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?B?)\s*", text.upper())
    if match is None or match.group(2) not in units:
        raise argparse.ArgumentTypeError(f"expected a size such as 500MB or 2GB, got {text!r}")
    return int(float(match.group(1)) * units[match.group(2)])


def _block_range(text: str) -> tuple[int, int]:
    try:
        start, end = (int(part) for part in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected A:B with integers A < B, got {text!r}") from None
    if not 0 <= start < end:
        raise argparse.ArgumentTypeError(f"expected A:B with 0 <= A < B, got {text!r}")
    return start, end


def build_config(args: argparse.Namespace) -> ServerConfig:
    positive = (
        "block_size",
        "max_batch_tokens",
        "max_batch_rows",
        "forward_slice_tokens",
        "max_sessions",
        "inference_max_length",
        "max_batch_size",
        "max_forward_tokens",
        "step_timeout",
        "session_timeout",
        "announce_period",
    )
    for name in positive:
        if getattr(args, name) <= 0:
            raise InvalidRequest(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.balance_period < 0:
        raise InvalidRequest(f"--balance-period must not be negative, got {args.balance_period}")
    if args.simulate_slow_ms < 0:
        raise InvalidRequest(f"--simulate-slow-ms must not be negative, got {args.simulate_slow_ms}")
    if args.drain_timeout < 0:
        raise InvalidRequest(f"--drain-timeout must not be negative, got {args.drain_timeout}")
    if args.max_batch_wait_ms < 0:
        raise InvalidRequest(f"--max-batch-wait-ms must not be negative, got {args.max_batch_wait_ms}")
    if args.max_cache_tokens is not None and args.max_cache_tokens < args.block_size:
        raise InvalidRequest(f"--max-cache-tokens must hold at least one block of {args.block_size} tokens")
    if args.metrics_port is not None and not 0 < args.metrics_port <= 65535:
        raise InvalidRequest(f"--metrics-port must lie in 1..65535, got {args.metrics_port}")
    if args.num_blocks is not None and args.num_blocks < 1:
        raise InvalidRequest(f"--num-blocks must be at least 1, got {args.num_blocks}")
    return ServerConfig(
        model=args.model,
        swarm=swarm_config(args),
        dht_prefix=args.dht_prefix,
        blocks=args.blocks,
        num_blocks=args.num_blocks,
        memory_budget=args.memory_budget,
        balance_period=args.balance_period,
        dtype=args.dtype,
        max_cache_tokens=args.max_cache_tokens,
        block_size=args.block_size,
        max_batch_tokens=args.max_batch_tokens,
        max_batch_rows=args.max_batch_rows,
        max_sessions=args.max_sessions,
        max_batch_wait_ms=args.max_batch_wait_ms,
        forward_slice_tokens=args.forward_slice_tokens,
        inference_max_length=args.inference_max_length,
        max_batch_size=args.max_batch_size,
        max_forward_tokens=args.max_forward_tokens,
        step_timeout=args.step_timeout,
        session_timeout=args.session_timeout,
        drain_timeout=args.drain_timeout,
        simulate_slow_ms=args.simulate_slow_ms,
        announce_period=args.announce_period,
        num_threads=args.num_threads,
        adapters=tuple(args.adapters),
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
    )


def _print_ready(server: Server) -> None:
    info = server.handler.info()
    print(
        f"corolla server ready: peer_id={server.peer_id} blocks={info.start}:{info.end} "
        f"dht_prefix={server.dht_prefix}",
        flush=True,
    )


def run(args: argparse.Namespace) -> None:
    asyncio.run(serve(build_config(args), on_ready=_print_ready))
