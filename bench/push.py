"""Per-token latency with server-to-server push on and off, on loopback.

A local 3-server SmolLM2 swarm (one torch thread per process). One session at a time generates 64 tokens
greedily, alternating push on and off over --runs runs each; reports the median time between tokens,
the ratio, and how the servers say the steps arrived (by push or from the client).

    python bench/push.py [--runs 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import replace

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from corolla.client.model import DistributedModelForCausalLM
from corolla.launch.local import LocalSwarm, even_spans
from corolla.swarm.p2p.ping import fetch_status
from stamp import report  # bench/stamp.py: stamped into bench/results/

NEW_TOKENS = 64


def token_gaps(model: DistributedModelForCausalLM, prompt: list[int]) -> list[float]:
    stamps: list[float] = []
    model.generate(
        prompt,
        max_new_tokens=NEW_TOKENS,
        ignore_eos=True,
        streamer=lambda _: stamps.append(time.perf_counter()),
    )
    return [b - a for a, b in zip(stamps, stamps[1:], strict=False)]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    gaps: dict[bool, list[float]] = {True: [], False: []}
    with (
        LocalSwarm("smollm2", even_spans(30, 3), num_threads=1) as swarm,
        DistributedModelForCausalLM.from_pretrained("smollm2", config=swarm.client_config()) as model,
    ):
        text = model.tokenizer.apply_chat_template(
            [{"role": "user", "content": "Describe a forest."}], tokenize=False, add_generation_prompt=True
        )
        prompt = model.tokenizer(text, add_special_tokens=False).input_ids
        token_gaps(model, prompt)  # warm up
        for _ in range(args.runs):
            for push in (True, False):
                model.client.config = replace(model.client.config, use_push=push)
                gaps[push] += token_gaps(model, prompt)
        infos = [
            model.runtime.run(fetch_status(model.client.swarm.peers.transport, s.peer_id, 10.0))
            for s in swarm.servers
        ]
    on, off = statistics.median(gaps[True]), statistics.median(gaps[False])
    report(
        __file__,
        {
            "model": "SmolLM2-135M-Instruct",
            "servers": 3,
            "network": "loopback",
            "runs_each": args.runs,
            "median_token_ms_push_on": round(1000 * on, 2),
            "median_token_ms_push_off": round(1000 * off, 2),
            "ratio_on_to_off": round(on / off, 3),
            "steps_by_server": [
                {"from_client": i.steps_from_client, "from_push": i.steps_from_push} for i in infos
            ],
        },
    )


if __name__ == "__main__":
    main()
