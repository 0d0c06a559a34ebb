"""Spot checks against lying servers: detection, false alarms on honest mixed-precision replicas, overhead.

SmolLM2-135M-Instruct on 127.0.0.1 (no NAT port mapping, one torch thread per process), servers of all
30 blocks. Sections, one after the other:

- false alarms: honest replicas in float32 (two), bfloat16 and int8; spot checks on every step (share
  1.0) over the 8 prompts (bench/lib/prompts.py) x 128 tokens, over 1,000 steps, each check comparing two
  replicas (of any precisions): servers accused.
- overhead: the same replicas; decode tokens/s over the 8 prompts x 64 tokens without spot checks and at
  `--share`, median of `--runs` rounds, and their ratio.
- detection: two float32 replicas slowed by --simulate-slow-ms (clients prefer a faster server); for each
  --simulate-faulty mode a faulty server joins and a client with spot checks on `--share` of the steps
  generates 64 greedy tokens for 4 prompts through it. Reported: whether the tokens equal the honest
  ones, how many wrong tokens were generated before a check caught the server (what the generation
  withdrew), and whether it was banned.
- training: forward + backward passes of the whole chain over the prompts' embeddings (random output
  gradients): on the honest mixed-precision replicas with every pass checked (false alarms over 64
  passes), then per fault mode how many passes at `--share` ran before the liar was caught.

JSON to stdout, logs to stderr.

    python -m bench.trust.spot_checks [--share 0.1] [--runs 3]
"""

from __future__ import annotations

import os
import statistics
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch: one thread here and in every server

import torch

from bench.lib.env import parser
from bench.lib.prompts import benchmark_prompts
from bench.lib.stamp import report
from corolla.client.model import DistributedModelForCausalLM
from corolla.client.training.remote_chain import RemoteChain
from corolla.launch.local import LocalSwarm

FAULTS = ("noise:0.1", "noise:0.03", "skip-layer", "wrong-weights", "garbage-after:40")
SECTIONS = ("false_alarms", "overhead", "detection", "training")
TRAINING_PASSES = 64
HONEST = (["--dtype", "float32"], ["--dtype", "bfloat16"], ["--quantize", "int8"])
SLOW = ["--simulate-slow-ms", "20"]


def connect(swarm: LocalSwarm, share: float) -> DistributedModelForCausalLM:
    config = swarm.client_config(spot_checks=share, routing_timeout=30.0)
    return DistributedModelForCausalLM.from_pretrained("smollm2", config=config)


def prompt_ids(model: DistributedModelForCausalLM) -> list[torch.Tensor]:
    return [torch.tensor([ids]) for _, ids in benchmark_prompts(model.tokenizer)]


def generate(model: DistributedModelForCausalLM, ids: torch.Tensor, new_tokens: int) -> tuple[list[int], int]:
    """Greedy tokens, and how many tokens the generation withdrew (spot checks caught a liar)."""
    tokens, withdrawn = [], 0
    for step in model.runtime.iterate(model.agenerate_steps(ids, max_new_tokens=new_tokens, ignore_eos=True)):
        if step.withdrawn:
            withdrawn = max(withdrawn, step.withdrawn)
            del tokens[len(tokens) - step.withdrawn :]
        else:
            tokens.append(int(step.tokens[0]))
    return tokens, withdrawn


def detection(swarm: LocalSwarm, share: float, prompts: list[torch.Tensor], honest: list[list[int]]) -> dict:
    results = {}
    for fault in FAULTS:
        liar = swarm.add_server((0, 30), ["--simulate-faulty", fault, "--simulate-slow-ms", "0"])
        try:
            with connect(swarm, share) as model:
                for server in swarm.servers[:2]:  # timed as slow, which they are: the liar is preferred
                    model.client.swarm.estimates.observe_step(server.peer_id, 0.5, 30)
                model.client.swarm.estimates.observe_step(liar.peer_id, 0.05, 30)
                runs = [generate(model, ids, 64) for ids in prompts]
                results[fault] = {
                    "identical_to_honest": [tokens for tokens, _ in runs] == honest,
                    "wrong_tokens_before_caught": [withdrawn for _, withdrawn in runs],
                    "banned": liar.peer_id in model.client.swarm.bans.faulty,
                    "checks": dict(model.client.checker.counts),
                }
        finally:
            swarm.servers.remove(liar)
            liar.stop()
        print(f"{fault}: {results[fault]}", file=sys.stderr, flush=True)
    return results


def training_pass(model: DistributedModelForCausalLM, ids: torch.Tensor, seed: int) -> None:
    """A forward and a backward pass of all 30 blocks over the prompt's embeddings (random output grads)."""
    with torch.no_grad():
        hidden = model.head.embed(ids)
    hidden.requires_grad_(True)
    outputs = RemoteChain.apply(hidden, torch.empty(0), model.client.passes, model.runtime)
    outputs.backward(torch.randn(outputs.shape, generator=torch.Generator().manual_seed(seed)))


def training_false_alarms(swarm: LocalSwarm, prompts: list[torch.Tensor], passes: int) -> dict:
    with connect(swarm, 1.0) as model:
        for index in range(passes):
            training_pass(model, prompts[index % len(prompts)], index)
        return {
            "passes": passes,
            "accused": len(model.client.swarm.bans.faulty),
            "checks": dict(model.client.checker.counts),
        }


def training_detection(swarm: LocalSwarm, share: float, prompts: list[torch.Tensor], passes: int) -> dict:
    """Per fault mode: how many training passes (forward + backward) ran before the liar was caught."""
    results = {}
    for fault in FAULTS:
        liar = swarm.add_server((0, 30), ["--simulate-faulty", fault, "--simulate-slow-ms", "0"])
        try:
            with connect(swarm, share) as model:
                for server in swarm.servers[:2]:
                    model.client.swarm.estimates.observe_step(server.peer_id, 0.5, 30)
                model.client.swarm.estimates.observe_step(liar.peer_id, 0.05, 30)
                ran = 0
                while ran < passes and liar.peer_id not in model.client.swarm.bans.faulty:
                    training_pass(model, prompts[ran % len(prompts)], ran)
                    ran += 1
                results[fault] = {
                    "passes_until_caught": ran,
                    "banned": liar.peer_id in model.client.swarm.bans.faulty,
                }
        finally:
            swarm.servers.remove(liar)
            liar.stop()
        print(f"training, {fault}: {results[fault]}", file=sys.stderr, flush=True)
    return results


def false_alarms(swarm: LocalSwarm, prompts: list[torch.Tensor]) -> dict:
    with connect(swarm, 1.0) as model:
        steps = 0
        for ids in prompts:
            generate(model, ids, 128)
            steps += 128
        return {
            "steps": steps,
            "accused": len(model.client.swarm.bans.faulty),
            "checks": dict(model.client.checker.counts),
        }


def tokens_per_s(swarm: LocalSwarm, share: float, prompts: list[torch.Tensor], runs: int) -> float:
    with connect(swarm, share) as model:
        generate(model, prompts[0], 8)  # warm-up
        rates = []
        for _ in range(runs):
            started, count = time.perf_counter(), 0
            for ids in prompts:
                count += len(generate(model, ids, 64)[0])
            rates.append(count / (time.perf_counter() - started))
        return statistics.median(rates)


def main() -> None:
    flags = parser(__doc__)
    flags.add_argument("--share", type=float, default=0.1, help="spot checks' share of steps")
    flags.add_argument("--runs", type=int, default=3)
    flags.add_argument(
        "--sections", nargs="+", default=SECTIONS, choices=SECTIONS, help="run only these (default: all)"
    )
    args = flags.parse_args()
    result = {"model": "SmolLM2-135M-Instruct", "share": args.share}
    common = ["--max-cache-tokens", "4096", "--num-threads", "1"]
    with LocalSwarm("smollm2", [], server_args=common) as swarm:
        for extra in (*HONEST[:1], *HONEST):
            swarm.add_server((0, 30), extra)
        with connect(swarm, 0.0) as model:
            prompts = prompt_ids(model)
        if "false_alarms" in args.sections:
            result["false_alarms"] = false_alarms(swarm, prompts)
        if "overhead" in args.sections:
            plain = tokens_per_s(swarm, 0.0, prompts, args.runs)
            checked = tokens_per_s(swarm, args.share, prompts, args.runs)
            result["overhead"] = {
                "tokens_per_s_off": round(plain, 2),
                "tokens_per_s_on": round(checked, 2),
                "ratio": round(checked / plain, 3),
            }
        if "training" in args.sections:
            result["training_false_alarms"] = training_false_alarms(swarm, prompts, TRAINING_PASSES)
    if "detection" in args.sections or "training" in args.sections:
        with LocalSwarm("smollm2", [(0, 30), (0, 30)], server_args=[*common, *SLOW]) as swarm:
            if "detection" in args.sections:
                with connect(swarm, 0.0) as model:
                    honest = [generate(model, ids, 64)[0] for ids in prompts[:4]]
                result["detection"] = detection(swarm, args.share, prompts[:4], honest)
            if "training" in args.sections:
                result["training_detection"] = training_detection(swarm, args.share, prompts, TRAINING_PASSES)
    report(__file__, result)


if __name__ == "__main__":
    main()
