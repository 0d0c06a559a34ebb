"""`corolla server MODEL`: host a span of MODEL's blocks for the swarm.

The options map one to one onto `ServerConfig` and its nested `EngineConfig` (config.py), which check
their own ranges: a bad value gets the same error from the command line as from Python. Each option is
made from its field (cli/config_options.py): its flag, dest, type and default are the field's.
"""

from __future__ import annotations

import argparse
import asyncio
import re
from typing import TYPE_CHECKING

from corolla.cli.common import SERVER_HOST, add_dht_prefix, add_swarm_args, swarm_config
from corolla.cli.config_options import add_field, field_values
from corolla.config import DTYPES, QUANTIZE_MODES, EngineConfig, ServerConfig

if TYPE_CHECKING:  # imported when the command runs: `corolla --help` stays quick
    from corolla.server.server import Server


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
    _engine_options(parser.add_argument_group("engine (continuous batching)"))
    _limit_options(parser)
    _operation_options(parser)
    add_swarm_args(parser, default_host=SERVER_HOST)
    _testing_options(parser.add_argument_group("for testing only (make this server misbehave)"))
    parser.set_defaults(run=run)


def _placement_options(parser: argparse.ArgumentParser) -> None:
    blocks = parser.add_mutually_exclusive_group()
    add_field(
        blocks, ServerConfig, "blocks", "host blocks A to B-1 (0-based)", type=_block_range, metavar="A:B"
    )
    add_field(
        blocks,
        ServerConfig,
        "memory_budget",
        "without --blocks: host as many blocks as fit in SIZE (e.g. 2GB, 500MB) with 4096 tokens of "
        "cache each (default: half the available memory of --device)",
        type=_size,
        metavar="SIZE",
    )
    add_field(
        blocks,
        ServerConfig,
        "num_blocks",
        "host N blocks where the swarm has the fewest servers (default: all blocks)",
        metavar="N",
    )
    add_dht_prefix(parser, ServerConfig)
    add_field(
        parser,
        ServerConfig,
        "device",
        "where the weights, the cache and the computation live: cpu, cuda, cuda:N or mps "
        "(default: the best available: a CUDA GPU, else MPS, else the CPU)",
        metavar="DEVICE",
    )
    add_field(
        parser,
        ServerConfig,
        "dtype",
        "compute and cache dtype; auto: the checkpoint's (default: float32 on a CPU, bfloat16 on a GPU "
        "that has it, else float16)",
        choices=DTYPES,
    )
    add_field(
        parser,
        ServerConfig,
        "quantize",
        "store the blocks' weights in int8 or int4 (weight-only, torchao; lossy: announced, and "
        "clients with --exact skip this server); activations and cache stay in --dtype (default: off)",
        choices=QUANTIZE_MODES,
    )


def _engine_options(group: argparse._ArgumentGroup) -> None:
    def option(name: str, text: str, *aliases: str) -> None:
        add_field(group, EngineConfig, name, text, *aliases)

    option(
        "max_cache_tokens",
        "attention cache pool, in tokens over all hosted blocks (default: a quarter of the memory "
        "available at start on a CPU, 80%% of the GPU's free memory after the weights; at most 262144)",
    )
    option("page_size", "positions per cache page (default: %(default)s)", "--block-size")
    option("max_batch_tokens", "tokens per engine pass: decodes + prefill chunks (default: %(default)s)")
    option("max_batch_rows", "rows per engine pass; 1 turns batching off (default: %(default)s)")
    option(
        "forward_slice_tokens",
        "forward/backward (training) work runs this many tokens (whole rows) per pass, between inference "
        "passes: smaller keeps chat latency steady under training, bigger trains faster "
        "(default: %(default)s)",
    )
    option(
        "max_batch_wait_ms",
        "a pass waits for the sessions whose steps are due within this long (or two passes' time, if "
        "longer): announced by the previous server, or expected by their cycle (0: never wait; default: "
        "%(default)s)",
    )
    option("max_sessions", "open inference sessions at once (default: %(default)s)")
    option(
        "max_idle_sessions_per_peer",
        "ended sessions a peer asked to keep for later forks (reused prefixes), kept idle per peer; the "
        "first taken back when cache runs short (0: keep none; default: %(default)s)",
    )
    option(
        "idle_session_timeout", "seconds an ended session is kept for forks at most (default: %(default)s)"
    )


def _limit_options(parser: argparse.ArgumentParser) -> None:
    def option(name: str, text: str) -> None:
        add_field(parser, ServerConfig, name, text + " (default: %(default)s)")

    option("inference_max_length", "longest inference session a client may open")
    option("max_batch_size", "most rows per session or forward request")
    option("max_forward_tokens", "most batch x length tokens per forward request")
    option(
        "max_tree_tokens",
        "most batch x tokens of one speculative step (a draft tree verified in one pass; at most "
        "--max-batch-tokens)",
    )
    option("step_timeout", "close a session whose next step does not come within this many seconds")
    option("session_timeout", "close any session after this many seconds")
    option("max_sessions_per_peer", "most inference sessions one peer may hold open here")
    option("max_passes_per_peer", "most forward/backward requests one peer may have running here")


def _operation_options(parser: argparse.ArgumentParser) -> None:
    def option(name: str, text: str, **overrides: str) -> None:
        add_field(parser, ServerConfig, name, text, **overrides)

    option("announce_period", "re-announce on the DHT this often, in seconds (default: %(default)s)")
    option(
        "balance_period",
        "without --blocks: check this often (seconds) whether moving to other blocks would help the swarm, "
        "and move if so (0: never move; default: %(default)s)",
    )
    option(
        "remeasure_period",
        "measure this machine's speed again this often (seconds) while no session is open, and announce "
        "it; the first time at a random moment 1-2 minutes (or 2-4 announce periods) after the start (0: "
        "never; default: %(default)s)",
    )
    option(
        "drain_timeout",
        "on SIGTERM/SIGINT, announce OFFLINE, refuse new sessions and give open ones this long to finish "
        "(a second signal stops at once; default: %(default)s)",
    )
    option(
        "adapters",
        "a PEFT LoRA adapter folder to serve for this span (named after the folder unless NAME= is "
        "given; repeat the option for several); a request selects one by name with active_adapter",
        metavar="[NAME=]PATH",
    )
    option(
        "metrics_port",
        "serve Prometheus metrics (sessions, batch sizes, queue depth, free cache, pass times) at "
        "http://METRICS_HOST:PORT/metrics (default: off)",
    )
    option("metrics_host", "address for --metrics-port (default: %(default)s)")
    option(
        "num_threads",
        "torch compute threads (default: torch's choice; use 1 when several peers share a small machine)",
    )


def _testing_options(group: argparse._ArgumentGroup) -> None:
    """Testing aids, apart from the real options in --help: never for a server others rely on."""
    add_field(group, ServerConfig, "simulate_slow_ms", "sleep this long after every pass")
    add_field(
        group,
        ServerConfig,
        "simulate_faulty",
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
    engine = EngineConfig(**field_values(args, EngineConfig))
    return ServerConfig(swarm=swarm_config(args), engine=engine, **field_values(args, ServerConfig))


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
