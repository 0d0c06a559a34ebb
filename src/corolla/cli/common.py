"""Options and helpers shared by several subcommands."""

from __future__ import annotations

import argparse
import functools
import logging
import sys
from typing import Any

from corolla.cli.config_options import add_field, field_default
from corolla.config import QUANTIZE_MODES, WIRE_ENCODINGS, ClientConfig, SpeculationConfig, SwarmConfig
from corolla.errors import InvalidRequest
from corolla.swarm.p2p.addresses import parse_peer

# the options of speculative decoding: SpeculationConfig's field -> the option's dest (--draft-depth...)
DRAFT_DESTS = {
    "draft": "draft",
    "quantize": "draft_quantize",
    "device": "draft_device",
    "width": "draft_width",
    "max_depth": "draft_depth",
    "pipeline": "draft_pipeline",
}
SERVER_HOST = SwarmConfig.host  # where a peer listens for the swarm: every address of the machine
CLIENT_HOST = field_default(ClientConfig, "swarm").host  # a client's: loopback


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    logging.getLogger("corolla").setLevel(level)


def add_dht_prefix(parser: argparse.ArgumentParser, config: type) -> None:
    """The one --dht-prefix (of a ServerConfig or a ClientConfig): servers, clients and the API must agree
    on it."""
    add_field(parser, config, "dht_prefix", "DHT key prefix (default: derived from the model name)")


def add_swarm_args(parser: argparse.ArgumentParser, *, default_host: str, listen_flag: str = "") -> None:
    """The swarm options (SwarmConfig's); `listen_flag` prefixes --host/--port (e.g. "p2p-") when a
    command needs those names for something else."""
    group = parser.add_argument_group("swarm")
    option = functools.partial(add_field, group, SwarmConfig)
    option(
        "initial_peers",
        "multiaddress of a peer already in the swarm, as `corolla dht` prints it (repeat the option "
        "for several peers)",
        type=_peer,
        metavar="MADDR",
    )
    text = "address to listen on for the swarm (default: %(default)s)"
    option("host", text, flag=f"--{listen_flag}host", default=default_host)
    text = "TCP port to listen on for the swarm (default: any free port)"
    option("port", text, flag=f"--{listen_flag}port")
    option("announce_host", f"address other peers should use to reach this one (needs --{listen_flag}port)")
    parser.set_defaults(port_flag=f"--{listen_flag}port")
    option(
        "nat_port_map",
        "ask the LAN gateway (UPnP / NAT-PMP) to forward our port; default: on unless "
        "--host is a loopback address. Turn it off in tests and private networks",
    )
    _add_reachability_args(group)
    _add_identity_args(group)


def _add_reachability_args(group: argparse._ArgumentGroup) -> None:
    reachability = group.add_mutually_exclusive_group()
    reachability.add_argument(
        "--public",
        dest="reachability",
        action="store_const",
        const="public",
        default=field_default(SwarmConfig, "reachability"),
        help="this machine is reachable at its address (a public IP, or a forwarded port): say so instead "
        "of asking peers to dial it back (they still do, to warn when it is not), and relay for peers "
        "behind NAT (the default of `corolla dht`)",
    )
    reachability.add_argument(
        "--behind-nat",
        dest="reachability",
        action="store_const",
        const="behind-nat",
        help="this machine cannot be dialed (a home router, no forwarded port): be reachable through "
        "relays (the initial peers and public servers) instead of asking peers to dial it back first",
    )
    option = functools.partial(add_field, group, SwarmConfig)
    option(
        "relay",
        "relay for peers behind NAT when this peer is reachable (default: on; --no-relay refuses "
        "every request to relay)",
    )
    option(
        "relay_time_limit",
        "the longest a connection this peer relays may last (every peer not behind NAT relays, unless "
        "--no-relay); clients move their sessions before it (default: 1800)",
        metavar="SECONDS",
    )
    text = "the most a connection this peer relays may carry each way (default: 4096)"
    option("relay_data_limit_mib", text, metavar="MIB")
    option("relay_circuits", "connections this peer relays for one peer at once (default: 16)", metavar="N")


def _add_identity_args(group: argparse._ArgumentGroup) -> None:
    add_field(
        group,
        SwarmConfig,
        "identity_path",
        "private key file that fixes this peer's id across restarts and signs its DHT records "
        "(created if missing; `corolla identity PATH` prints its peer id)",
        flag="--identity",
        dest="identity",
        metavar="PATH",
    )
    group.add_argument(  # a file of peer ids, read into SwarmConfig.allowed_peers by swarm_config
        "--allowed-peers",
        default=None,
        metavar="FILE",
        help="a private swarm: peer ids (one per line) that may use this peer and whose DHT records count; "
        "every member, clients included, runs with the same list and its own --identity",
    )


def add_client_args(parser: argparse.ArgumentParser) -> None:
    """How a client uses the swarm (ClientConfig's): which servers, speculative decoding, the wire's
    encoding."""
    group = parser.add_argument_group("client")
    option = functools.partial(add_field, group, ClientConfig)
    text = "use only servers with full-precision weights (skip servers started with --quantize)"
    option("exact", text, action="store_true")
    _add_draft_args(group)
    option(
        "spot_checks",
        "re-run this share of each server's steps on other servers over the same blocks and compare; "
        "a server caught computing wrong outputs is banned and its tokens redone (default: %(default)s)",
        metavar="SHARE",
    )
    option(
        "prefix_cache",
        "keep this many ended sessions on their servers, indexed by their tokens: a prompt sharing a "
        "prefix with one (a later turn of a chat, a shared system prompt) sends and computes only the rest "
        "(0: off; default: %(default)s)",
        metavar="SESSIONS",
    )
    option(
        "wire_encoding",
        "hidden states between hops: lossless, or (lossy, for slow links) float16 or blockwise8 "
        "(8-bit) for tensors of 32 KiB or more, such as prompts (default: %(default)s)",
        choices=WIRE_ENCODINGS,
    )


def _add_draft_args(group: argparse._ArgumentGroup) -> None:
    """Speculative decoding's options (SpeculationConfig's fields, as DRAFT_DESTS names them)."""
    group.add_argument(  # SpeculationConfig.draft, or none at all: no speculation (default: off)
        "--draft",
        default=None,
        metavar="lookup|mtp|MODEL",
        help="speculative decoding: draft tokens with prompt lookup (`lookup`: n-grams of the prompt and "
        "the text so far), with the checkpoint's own multi-token prediction layers run here (`mtp`: "
        "DeepSeek-V3, GLM-4.5...) or with a draft MODEL run here, sharing the model's tokenizer (a folder, "
        ".gguf file, hub id or `smollm2`); the swarm verifies several tokens per round trip and the output "
        "is the same as without (default: off)",
    )

    def option(name: str, text: str, **overrides: Any) -> None:
        dest = DRAFT_DESTS[name]
        add_field(
            group, SpeculationConfig, name, text, flag="--" + dest.replace("_", "-"), dest=dest, **overrides
        )

    option(
        "quantize",
        "store the draft model's weights in int8 or int4 (faster drafts; default: as stored)",
        choices=QUANTIZE_MODES,
    )
    option(
        "device",
        "where the draft model runs: cpu, cuda, cuda:N, mps or auto (the best available) "
        "(default: %(default)s)",
        metavar="DEVICE",
    )
    option(
        "width",
        "a tree's branching: a draft model's tokens per level (default 1), prompt lookup's places the "
        "last tokens appeared (default 2); 1 drafts a chain",
    )
    option(
        "max_depth",
        "most drafted tokens along a path; each step's depth follows the measured acceptance and "
        "round trips (default: %(default)s)",
    )
    option(
        "pipeline",
        "most drafts in flight: the next draft goes out before the last one is verified, so servers "
        "compute while replies travel, each carrying --draft-depth / (drafts in flight) tokens; the "
        "client keeps the number that emits the most tokens per second (measured); 1 waits for each "
        "verification (default: %(default)s)",
    )


def client_config(args: argparse.Namespace, **extra: Any) -> ClientConfig:
    speculation = None
    if args.draft is not None:
        try:
            speculation = SpeculationConfig(
                **{name: getattr(args, dest) for name, dest in DRAFT_DESTS.items()}
            )
        except InvalidRequest as e:  # SpeculationConfig names its fields, the CLI's flags are --draft-*
            name = str(e).split(" ", 1)[0]
            flag = "--" + DRAFT_DESTS.get(name, name).replace("_", "-")
            raise InvalidRequest(f"{name} ({flag}){str(e)[len(name) :]}") from None
    swarm = swarm_config(args, client_mode=True)
    return ClientConfig(
        swarm=swarm,
        exact=args.exact,
        speculation=speculation,
        wire_encoding=args.wire_encoding,
        spot_checks=args.spot_checks,
        prefix_cache=args.prefix_cache,
        **extra,
    )


def _peer(text: str) -> str:
    try:
        return parse_peer(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def swarm_config(args: argparse.Namespace, *, client_mode: bool = False) -> SwarmConfig:
    """SwarmConfig checks the values; its errors name this command's flags (`corolla api`'s --p2p-port)."""
    try:
        return SwarmConfig(
            initial_peers=tuple(args.initial_peers),
            host=args.host,
            port=args.port,
            announce_host=args.announce_host,
            nat_port_map=args.nat_port_map,
            identity_path=args.identity,
            client_mode=client_mode,
            allowed_peers=_allowed_peers(args.allowed_peers),
            reachability=args.reachability,
            relay=args.relay,
            relay_time_limit=args.relay_time_limit,
            relay_data_limit_mib=args.relay_data_limit_mib,
            relay_circuits=args.relay_circuits,
        )
    except InvalidRequest as e:
        raise InvalidRequest(
            str(e).replace("(--port)", f"({getattr(args, 'port_flag', '--port')})")
        ) from None


def _allowed_peers(path: str | None) -> frozenset[str] | None:
    if path is None:
        return None
    from corolla.swarm.p2p.identity import read_allowed_peers  # here: `corolla --help` stays quick

    try:
        return read_allowed_peers(path)
    except OSError as e:
        raise InvalidRequest(f"--allowed-peers {path}: {e.strerror}") from None
