"""Libp2p through hivemind: transports, streams, pings, addresses, the daemons and identities."""
