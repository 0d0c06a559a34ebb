"""A server holding 10 of SmolLM2's 30 blocks needs far less memory than a process holding the whole model.

The servers are fresh (not the session's shared swarm), so the peak measured is that of this workload
alone, not of every test that used a shared server before.
"""

from __future__ import annotations

import torch

from corolla.launch.local import LocalSwarm, even_spans
from corolla.utils import peak_rss_bytes, whole_model_peak_rss_bytes
from swarm_helpers import SMOL_LIMITS, connect


def test_server_of_blocks_10_to_20_uses_much_less_memory_than_the_whole_model(smollm2_path):
    with LocalSwarm(str(smollm2_path), even_spans(30, 3), server_args=SMOL_LIMITS) as swarm:
        with connect(smollm2_path, swarm) as model:
            model(torch.arange(1, 33)[None])
            model.generate(torch.arange(1, 17)[None], max_new_tokens=16)
        server = next(s for s in swarm.servers if s.blocks == (10, 20))
        server_peak = peak_rss_bytes(server.pid)
    full_peak = whole_model_peak_rss_bytes(smollm2_path)
    print(f"peak RSS: server 10:20 {server_peak / 2**20:.0f} MiB, whole model {full_peak / 2**20:.0f} MiB")
    assert server_peak < 0.6 * full_peak
