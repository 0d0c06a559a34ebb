"""A server holding 10 of SmolLM2's 30 blocks needs far less memory than a process holding the whole model."""

from __future__ import annotations

import torch

from corolla.utils import peak_rss_bytes, whole_model_peak_rss_bytes
from swarm_helpers import SMOL_CHAINS, connect


def test_server_of_blocks_10_to_20_uses_much_less_memory_than_the_whole_model(smol_swarm, smollm2_path):
    with connect(smollm2_path, smol_swarm, SMOL_CHAINS[3]) as model:  # the chain runs through blocks 10:20
        model(torch.arange(1, 33)[None])
    server = next(s for s in smol_swarm.servers if s.blocks == (10, 20))
    server_peak = peak_rss_bytes(server.pid)
    full_peak = whole_model_peak_rss_bytes(smollm2_path)
    print(f"peak RSS: server 10:20 {server_peak / 2**20:.0f} MiB, whole model {full_peak / 2**20:.0f} MiB")
    assert server_peak < 0.6 * full_peak
