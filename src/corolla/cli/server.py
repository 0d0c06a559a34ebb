"""`corolla server MODEL`: host a span of MODEL's blocks for the swarm.

The options map one to one onto `ServerConfig` and its nested `EngineConfig` (config.py), which check
their own ranges: a bad value gets the same error from the command line as from Python.
"""

from __future__ import annotations

import argparse
import asyncio
import re
from typing import TYPE_CHECKING

from corolla.cli.common import add_dht_prefix, add_swarm_args, swarm_config
from corolla.config import DTYPES, QUANTIZE_MODES, EngineConfig, ServerConfig

if TYPE_CHECKING:  # imported when the command runs: `corolla --help` stays quick
    from corolla.server.server import Server

ENGINE_OPTIONS = (
    "max_cache_tokens",
    "page_size",
    "max_batch_tokens",
    "max_batch_rows",
    "forward_slice_tokens",
    "max_batch_wait_ms",
    "max_sessions",
    "max_idle_sessions_per_peer",
    "idle_session_timeout",
)
SERVER_OPTIONS = (
    "dht_prefix",
    "blocks",
    "num_blocks",
    "memory_budget",
    "balance_period",
    "device",
    "dtype",
    "inference_max_length",
    "max_batch_size",
    "max_forward_tokens",
    "max_tree_tokens",
    "step_timeout",
    "session_timeout",
    "max_sessions_per_peer",
    "max_passes_per_peer",
    "announce_period",
    "drain_timeout",
    "simulate_slow_ms",
    "simulate_faulty",
    "quantize",
    "num_threads",
    "metrics_port",
    "metrics_host",
)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "server",
        help="serve a span of a model's blocks",
        description="Load a contiguous span of MODEL's transformer blocks, announce it on the swarm's DHT "
        "and answer inference and forward requests until SIGINT or SIGTERM (then it announces "
        "OFFLINE and stops). MODEL is a Hugging Face folder, a .gguf file, a hub id, or "
        "`smollm2` (the bundled SmolLM2-135M-Instruct).",
    )
    parser.add_argument("model", metavar="MODEL")
    _placement_options(parser)
    _engine_options(parser.add_argument_group("engine (continuous batching)"), EngineConfig())
    defaults = ServerConfig(model="")
    _limit_options(parser, defaults)
    _operation_options(parser, defaults)
    add_swarm_args(parser, default_host="0.0.0.0")
    _testing_options(parser.add_argument_group("for testing only (make this server misbehave)"), defaults)
    parser.set_defaults(run=run)


def _placement_options(parser: argparse.ArgumentParser) -> None:
    blocks = parser.add_mutually_exclusive_group()
    blocks.add_argument(
        "--blocks", type=_block_range, default=None, metavar="A:B", help="host blocks A to B-1 (0-based)"
    )
    blocks.add_argument(
        "--memory-budget",
        type=_size,
        default=None,
        metavar="SIZE",
        help="without --blocks: host as many blocks as fit in SIZE (e.g. 2GB, 500MB) with 4096 tokens of "
        "cache each (default: half the available memory of --device)",
    )
    blocks.add_argument(
        "--num-blocks",
        type=int,
        default=None,
        metavar="N",
        help="host N blocks where the swarm has the fewest servers (default: all blocks)",
    )
    add_dht_prefix(parser)
    parser.add_argument(
        "--device",
        default=None,
        metavar="DEVICE",
        help="where the weights, the cache and the computation live: cpu, cuda, cuda:N or mps "
        "(default: the best available: a CUDA GPU, else MPS, else the CPU)",
    )
    parser.add_argument(
        "--dtype",
        default=None,
        choices=DTYPES,
        help="compute and cache dtype; auto: the checkpoint's (default: float32 on a CPU, bfloat16 on a GPU "
        "that has it, else float16)",
    )
    parser.add_argument(
        "--quantize",
        default=None,
        choices=QUANTIZE_MODES,
        help="store the blocks' weights in int8 or int4 (weight-only, torchao; lossy: announced, and "
        "clients with --exact skip this server); activations and cache stay in --dtype (default: off)",
    )


def _engine_options(group: argparse._ArgumentGroup, defaults: EngineConfig) -> None:
    def option(name: str, kind: type, text: str, *aliases: str) -> None:
        flag = "--" + name.replace("_", "-")
        default = getattr(defaults, name)
        group.add_argument(flag, *aliases, dest=name, type=kind, default=default, help=text)

    option(
        "max_cache_tokens",
        int,
        "attention cache pool, in tokens over all hosted blocks (default: a quarter of the memory "
        "available at start on a CPU, 80%% of the GPU's free memory after the weights; at most 262144)",
    )
    option("page_size", int, "positions per cache page (default: %(default)s)", "--block-size")
    option("max_batch_tokens", int, "tokens per engine pass: decodes + prefill chunks (default: %(default)s)")
    option("max_batch_rows", int, "rows per engine pass; 1 turns batching off (default: %(default)s)")
    option(
        "forward_slice_tokens",
        int,
        "forward/backward (training) work runs this many tokens (whole rows) per pass, between inference "
        "passes: smaller keeps chat latency steady under training, bigger trains faster "
        "(default: %(default)s)",
    )
    option(
        "max_batch_wait_ms",
        float,
        "when fewer than half of the recently active sessions have a step waiting, wait up to this long "
        "(or two passes' time, if longer) for more before a pass (0: never wait; default: %(default)s)",
    )
    option("max_sessions", int, "open inference sessions at once (default: %(default)s)")
    option(
        "max_idle_sessions_per_peer",
        int,
        "ended sessions a peer asked to keep for later forks (reused prefixes), kept idle per peer; the "
        "first taken back when cache runs short (0: keep none; default: %(default)s)",
    )
    option(
        "idle_session_timeout",
        float,
        "seconds an ended session is kept for forks at most (default: %(default)s)",
    )


def _limit_options(parser: argparse.ArgumentParser, defaults: ServerConfig) -> None:
    def option(name: str, kind: type, text: str) -> None:
        flag = "--" + name.replace("_", "-")
        default = getattr(defaults, name)
        parser.add_argument(flag, type=kind, default=default, help=text + " (default: %(default)s)")

    option("inference_max_length", int, "longest inference session a client may open")
    option("max_batch_size", int, "most rows per session or forward request")
    option("max_forward_tokens", int, "most batch x length tokens per forward request")
    option(
        "max_tree_tokens",
        int,
        "most batch x tokens of one speculative step (a draft tree verified in one pass; at most "
        "--max-batch-tokens)",
    )
    option("step_timeout", float, "close a session whose next step does not come within this many seconds")
    option("session_timeout", float, "close any session after this many seconds")
    option("max_sessions_per_peer", int, "most inference sessions one peer may hold open here")
    option("max_passes_per_peer", int, "most forward/backward requests one peer may have running here")


def _operation_options(parser: argparse.ArgumentParser, defaults: ServerConfig) -> None:
    def option(name: str, kind: type | None, text: str, **extra: object) -> None:
        flag = "--" + name.replace("_", "-")
        parser.add_argument(flag, type=kind, default=getattr(defaults, name), help=text, **extra)

    option("announce_period", float, "re-announce on the DHT this often, in seconds (default: %(default)s)")
    option(
        "balance_period",
        float,
        "without --blocks: check this often (seconds) whether moving to other blocks would help the swarm, "
        "and move if so (0: never move; default: %(default)s)",
    )
    option(
        "drain_timeout",
        float,
        "on SIGTERM/SIGINT, announce OFFLINE, refuse new sessions and give open ones this long to finish "
        "(a second signal stops at once; default: %(default)s)",
    )
    parser.add_argument(
        "--adapters",
        action="append",
        default=[],
        metavar="[NAME=]PATH",
        help="a PEFT LoRA adapter folder to serve for this span (named after the folder unless NAME= is "
        "given; repeat the option for several); a request selects one by name with active_adapter",
    )
    option(
        "metrics_port",
        int,
        "serve Prometheus metrics (sessions, batch sizes, queue depth, free cache, pass times) at "
        "http://METRICS_HOST:PORT/metrics (default: off)",
    )
    option("metrics_host", None, "address for --metrics-port (default: %(default)s)")
    option(
        "num_threads",
        int,
        "torch compute threads (default: torch's choice; use 1 when several peers share a small machine)",
    )


def _testing_options(group: argparse._ArgumentGroup, defaults: ServerConfig) -> None:
    """Testing aids, apart from the real options in --help: never for a server others rely on."""

    def option(name: str, kind: type | None, text: str) -> None:
        group.add_argument(
            "--" + name.replace("_", "-"), type=kind, default=getattr(defaults, name), help=text
        )

    option("simulate_slow_ms", float, "sleep this long after every pass")
    option(
        "simulate_faulty",
        None,
        "compute wrong outputs, for spot checks to catch: noise[:SCALE] (Gaussian noise, SCALE x each "
        "block's output RMS, default 0.1), skip-layer (its last block does nothing), wrong-weights (its "
        "first block's MLP output weights permuted), garbage-after:N (random outputs after N passes)",
    )


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
    engine = EngineConfig(**{name: getattr(args, name) for name in ENGINE_OPTIONS})
    return ServerConfig(
        model=args.model,
        swarm=swarm_config(args),
        engine=engine,
        adapters=tuple(args.adapters),
        **{name: getattr(args, name) for name in SERVER_OPTIONS},
    )


def _print_ready(server: Server) -> None:
    status = server.status.snapshot()
    print(
        f"corolla server ready: peer_id={server.peer_id} blocks={status.start}:{status.end} "
        f"dht_prefix={server.dht_prefix}",
        flush=True,
    )


def run(args: argparse.Namespace) -> None:
    from corolla.server.server import serve

    asyncio.run(serve(build_config(args), on_ready=_print_ready))
