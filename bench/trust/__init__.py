"""Peers that cannot be trusted: spot checks against lying servers (and their tolerance), and an honest
session next to a peer flooding a server."""
