"""Across an emulated internet (network namespaces, delayed packets, capped uploads; root and iptables):
push, speculative decoding and wire encodings, many sessions, and servers behind home routers (NAT)."""
