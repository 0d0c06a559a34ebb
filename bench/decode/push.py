"""Per-token latency with server-to-server push on and off, on loopback.

A local 3-server SmolLM2 swarm (one torch thread per process). One session at a time generates 64 tokens
greedily, alternating push on and off over --runs runs each; reports the median time between tokens,
the ratio, and how the servers say the steps arrived (by push or from the client).

    python -m bench.decode.push [--runs 5]
"""

from __future__ import annotations

import statistics
from dataclasses import replace

import torch

from bench.lib.env import parser
from bench.lib.prompts import chat_ids
from bench.lib.stamp import report
from bench.lib.swarm import server_status, smollm2_swarm
from bench.lib.timing import Stamps, gaps
from corolla.client.model import DistributedModelForCausalLM

NEW_TOKENS = 64


def token_gaps(model: DistributedModelForCausalLM, prompt: list[int]) -> list[float]:
    stamps = Stamps()
    model.generate(prompt, max_new_tokens=NEW_TOKENS, ignore_eos=True, streamer=stamps.stamp)
    return gaps(stamps.times)


def main() -> None:
    flags = parser(__doc__)
    flags.add_argument("--runs", type=int, default=5)
    args = flags.parse_args()
    torch.set_num_threads(1)
    between: dict[bool, list[float]] = {True: [], False: []}
    with smollm2_swarm() as (swarm, model):
        prompt = chat_ids(model.tokenizer, "Describe a forest.")
        token_gaps(model, prompt)  # warm up
        for _ in range(args.runs):
            for push in (True, False):
                model.client.config = replace(model.client.config, use_push=push)
                between[push] += token_gaps(model, prompt)
        infos = [server_status(model, server.peer_id) for server in swarm.servers]
    on, off = statistics.median(between[True]), statistics.median(between[False])
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
