"""Does a training job stall chat users? Per-token inference latency with and without training load.

Starts a local 3-server SmolLM2 swarm. Measures an inference session's per-token latency (greedy, 64
tokens, median over 3 generations) alone; then starts a training job in another process (deep prompt
tuning: forward + backward of a batch of 8 x 40 tokens through every server, in a loop) and measures
the same generations while it runs. Prints both medians, the ratio (target: <= 2) and how many training
steps ran meanwhile. Servers run inference passes before forward/backward work (a forward or backward
waits at most a few inference passes; see engine/scheduler.py).

    python -m bench.decode.training [--new-tokens 64] [--runs 3]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import time

import torch

from bench.lib.env import ROOT, module_command, parser
from bench.lib.prompts import chat_ids
from bench.lib.stamp import report
from bench.lib.swarm import smollm2_swarm
from bench.lib.timing import gaps, percentile
from corolla.client.model import DistributedModelForCausalLM
from corolla.config import ClientConfig, SwarmConfig


def train_forever(peers: list[str]) -> None:
    """The training job (run in its own process): deep prompt tuning steps until SIGTERM."""
    torch.set_num_threads(1)
    config = ClientConfig(swarm=SwarmConfig(initial_peers=tuple(peers), host="127.0.0.1", nat_port_map=False))
    model = DistributedModelForCausalLM.from_pretrained(
        "smollm2", config=config, tuning_mode="deep_ptune", pre_seq_len=8
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    ids = torch.randint(100, 20000, (8, 40), generator=torch.Generator().manual_seed(0))
    steps, stop = 0, False

    def on_term(*_):
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    while not stop:
        loss = model(ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        steps += 1
        print(f"training step {steps}", flush=True)
    model.shutdown()


def token_latencies(model: DistributedModelForCausalLM, ids: list[int], new_tokens: int) -> list[float]:
    stamps = [
        time.perf_counter() for _ in model.generate_stream(ids, max_new_tokens=new_tokens, ignore_eos=True)
    ]
    return gaps(stamps, skip=1)  # the first gap includes the prefill


def latency(model, ids, new_tokens: int, runs: int) -> tuple[float, float]:
    """Median and 95th percentile of the gaps between tokens."""
    between = [gap for _ in range(runs) for gap in token_latencies(model, ids, new_tokens)]
    return statistics.median(between), percentile(between, 95)


def main() -> None:
    flags = parser(__doc__)
    flags.add_argument("--new-tokens", type=int, default=64)
    flags.add_argument("--runs", type=int, default=3)
    flags.add_argument("--trainer", nargs="+", help=argparse.SUPPRESS)  # internal: run the training job
    args = flags.parse_args()
    if args.trainer:
        train_forever(args.trainer)
        return
    torch.set_num_threads(1)
    with smollm2_swarm() as (swarm, model):
        ids = chat_ids(model.tokenizer, "Tell me about the sea.")
        token_latencies(model, ids, 4)  # warm up
        alone, alone_p95 = latency(model, ids, args.new_tokens, args.runs)
        log = open(swarm.workdir / "trainer.log", "w+")  # noqa: SIM115
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        trainer = subprocess.Popen(
            [*module_command(__spec__.name), "--trainer", *swarm.initial_peers],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=ROOT,
        )
        try:
            while "training step 2" not in open(log.name).read():  # noqa: SIM115
                if trainer.poll() is not None:
                    raise RuntimeError(f"the training job exited:\n{open(log.name).read()[-3000:]}")  # noqa: SIM115
                time.sleep(0.5)
            before = open(log.name).read().count("training step")  # noqa: SIM115
            started = time.monotonic()
            training, training_p95 = latency(model, ids, args.new_tokens, args.runs)
            elapsed = time.monotonic() - started
            steps = open(log.name).read().count("training step") - before  # noqa: SIM115
        finally:
            trainer.send_signal(signal.SIGTERM)
            try:
                trainer.wait(60)
            except subprocess.TimeoutExpired:
                trainer.kill()
                trainer.wait()
    ratio = training / alone
    report(
        __file__,
        {
            "model": "SmolLM2-135M-Instruct",
            "servers": 3,
            "token_latency_alone_ms": round(1000 * alone, 1),
            "token_latency_with_training_ms": round(1000 * training, 1),
            "ratio": round(ratio, 2),
            "p95_alone_ms": round(1000 * alone_p95, 1),
            "p95_with_training_ms": round(1000 * training_p95, 1),
            "p95_ratio": round(training_p95 / alone_p95, 2),
            "target_ratio": 2.0,
            "meets_target": ratio <= 2.0,
            "training_steps_meanwhile": steps,
            "training_steps_per_s": round(steps / elapsed, 2),
        },
    )


if __name__ == "__main__":
    main()
