"""Chains of servers: opening one, a step through it with push, failover and exact replay, cache-free passes,
and the inference session on top."""
