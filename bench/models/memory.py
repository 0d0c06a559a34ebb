"""Peak memory of a server hosting SmolLM2 blocks 10:20 versus a process that loads and runs the whole model.

Starts a local 3-server swarm, runs one forward pass through it (so every server touches its weights),
then reads each server's peak RSS (VmHWM) and the unique memory of its helper processes (the DHT
process and the libp2p daemon); a separate process loads the whole model with transformers and runs the same
forward pass. Prints JSON.

    python -m bench.models.memory
"""

from __future__ import annotations

import psutil
import torch

from bench.lib.env import parser
from bench.lib.stamp import report
from corolla.client.model import DistributedModelForCausalLM
from corolla.launch.local import LocalSwarm, even_spans
from corolla.models.source import resolve_model
from corolla.utils import peak_rss_bytes, whole_model_peak_rss_bytes

MIB = 2**20


def main() -> None:
    parser(__doc__).parse_args()
    source = resolve_model("smollm2")
    servers = {}
    with LocalSwarm("smollm2", even_spans(30, 3), num_threads=1) as swarm:
        config = swarm.client_config()
        with DistributedModelForCausalLM.from_pretrained("smollm2", config=config) as model:
            model(torch.arange(1, 33)[None])
        for server in swarm.servers:
            helpers = psutil.Process(server.pid).children(recursive=True)
            servers[f"{server.blocks[0]}:{server.blocks[1]}"] = {
                "peak_rss_mib": round(peak_rss_bytes(server.pid) / MIB),
                # unique memory (USS): the DHT process is forked from the server and shares its pages
                "helper_processes_uss_mib": round(sum(p.memory_full_info().uss for p in helpers) / MIB),
            }
    full_peak = whole_model_peak_rss_bytes(source.path) / MIB
    report(
        __file__,
        {
            "model": source.name,
            "servers": servers,
            "whole_model_process_peak_rss_mib": round(full_peak),
            "ratio_server_10_20_to_whole_model": round(servers["10:20"]["peak_rss_mib"] / full_peak, 3),
        },
    )


if __name__ == "__main__":
    main()
