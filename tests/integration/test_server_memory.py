"""A server holding 10 of SmolLM2's 30 blocks needs far less memory than a process holding the whole model."""

from __future__ import annotations

import subprocess
import sys

import torch

from corolla.utils import peak_rss_bytes
from swarm_helpers import SMOL_CHAINS, connect

# What a user does to run the model locally: load it whole and run it (which touches every weight).
FULL_MODEL_SCRIPT = """
import sys, torch
from transformers import AutoModelForCausalLM
from corolla.utils import peak_rss_bytes
torch.set_num_threads(1)
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
with torch.no_grad():
    model(torch.arange(1, 33)[None])
print(peak_rss_bytes())
"""


def test_server_of_blocks_10_to_20_uses_much_less_memory_than_the_whole_model(smol_swarm, smollm2_path):
    with connect(smollm2_path, smol_swarm, SMOL_CHAINS[3]) as model:  # the chain runs through blocks 10:20
        model(torch.arange(1, 33)[None])
    server = next(s for s in smol_swarm.servers if s.blocks == (10, 20))
    server_peak = peak_rss_bytes(server.pid)
    result = subprocess.run(
        [sys.executable, "-c", FULL_MODEL_SCRIPT, str(smollm2_path)],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    full_peak = int(result.stdout.strip().splitlines()[-1])
    print(f"peak RSS: server 10:20 {server_peak / 2**20:.0f} MiB, whole model {full_peak / 2**20:.0f} MiB")
    assert server_peak < 0.6 * full_peak
