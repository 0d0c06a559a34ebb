"""Peers behind NAT: reachability checked by dial-back, relays, reservations and relayed paths."""
