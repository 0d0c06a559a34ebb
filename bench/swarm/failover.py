"""Recovery from a server killed mid-generation: how long the user's token stream stalls.

A local SmolLM2 swarm with two servers per third of the model. Each run generates 64 tokens greedily and,
after 32, SIGKILLs the process group of the server serving one hop (first, middle or last), as when a
machine disappears; the client bans it, re-routes, replays the dead server's inputs to the replica, and
continues. Every run must end with exactly the uninterrupted run's tokens. Reports the stall (the gap
between the tokens around the kill) and the normal step time, as medians over --repeats runs per hop.

    python -m bench.swarm.failover [--repeats 5]
"""

from __future__ import annotations

import statistics
import time

import torch

from bench.lib.env import parser
from bench.lib.prompts import chat_ids
from bench.lib.stamp import report
from bench.lib.swarm import smollm2_swarm
from bench.lib.timing import gaps
from corolla.client.model import DistributedModelForCausalLM
from corolla.launch.local import LocalSwarm

SPANS = [(0, 10), (10, 20), (20, 30)]
NEW_TOKENS, KILL_AT = 64, 32
SERVER_ARGS = ["--announce-period", "2"]


def run(model: DistributedModelForCausalLM, swarm: LocalSwarm, prompt: list[int], hop: int | None) -> dict:
    stamps: list[float] = []
    victims = []
    with model.inference_session(max_length=len(prompt) + NEW_TOKENS) as session:

        def on_token(_: torch.Tensor) -> None:
            stamps.append(time.perf_counter())
            if hop is not None and len(stamps) == KILL_AT:
                victim = next(s for s in swarm.servers if s.peer_id == session.route[hop].peer_id)
                victim.kill_group()
                victims.append(victim)

        tokens = model.generate(
            prompt, session=session, max_new_tokens=NEW_TOKENS, ignore_eos=True, streamer=on_token
        )
    for victim in victims:  # restore two replicas per span
        swarm.servers.remove(victim)
        swarm.add_server(victim.blocks, extra_args=SERVER_ARGS)
    between = gaps(stamps)
    return {"tokens": tokens, "stall": between[KILL_AT - 1], "step": statistics.median(between)}


def main() -> None:
    flags = parser(__doc__)
    flags.add_argument("--repeats", type=int, default=5)
    args = flags.parse_args()
    torch.set_num_threads(1)
    results = {}
    with smollm2_swarm(SPANS + SPANS, SERVER_ARGS) as (swarm, model):
        prompt = chat_ids(model.tokenizer, "Tell me about the ocean.")
        reference = run(model, swarm, prompt, hop=None)
        for hop, name in [(0, "first"), (1, "middle"), (2, "last")]:
            runs = [run(model, swarm, prompt, hop) for _ in range(args.repeats)]
            results[name] = {
                "runs": len(runs),
                "all_tokens_exact": all(torch.equal(r["tokens"], reference["tokens"]) for r in runs),
                "median_stall_s": round(statistics.median(r["stall"] for r in runs), 3),
                "max_stall_s": round(max(r["stall"] for r in runs), 3),
                "median_step_s": round(statistics.median(r["step"] for r in runs), 3),
            }
    report(
        __file__,
        {
            "model": "SmolLM2-135M-Instruct",
            "servers": "2 per span of 10 blocks",
            "new_tokens": NEW_TOKENS,
            "killed_after": KILL_AT,
            "hops": results,
        },
    )


if __name__ == "__main__":
    main()
