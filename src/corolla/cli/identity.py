"""`corolla identity PATH`: a peer's key file (made if missing) and the peer id it gives, for allow lists."""

from __future__ import annotations

import argparse


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "identity",
        help="print the peer id of an identity file (creating it if missing)",
        description="Print the peer id of the private key file PATH, creating a new key there if the file "
        "does not exist. Pass the same file to --identity to run a peer under that id; list the ids of "
        "a private swarm's members in the file given to --allowed-peers.",
    )
    parser.add_argument("path", metavar="PATH", help="identity file (an RSA key in libp2p's format)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> None:
    from corolla.swarm.p2p.identity import load_identity, peer_id_of_identity

    print(peer_id_of_identity(load_identity(args.path)), flush=True)
