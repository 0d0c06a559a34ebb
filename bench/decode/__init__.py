"""Decoding on one machine: tokens/s and per-token latency through a local swarm, against local
transformers, with many sessions, push, reused prefixes, the HTTP API and constrained decoding, the
engine's and the wire digest's own costs, and inference next to a training job."""
