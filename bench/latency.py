"""Single-session decode speed: a local 3-server swarm versus local transformers, in one run.

Both sides run SmolLM2-135M-Instruct in float32 with one torch thread in every process (the bench
process, each server, the reference). Runs alternate between the two sides so that drift on a shared
machine hits both alike; the JSON reports every run, the medians and their ratio (target: >= 0.8).

    python bench/latency.py [--new-tokens 64] [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

from corolla.client.model import DistributedModelForCausalLM
from corolla.launch.local import LocalSwarm, even_spans
from corolla.models.source import resolve_model

PROMPT = "Write a short story about a lighthouse keeper."


class Stamps:
    """A transformers streamer that records when each new token arrives."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:  # the first call carries the prompt
            self.prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def decode_rate(times: list[float]) -> float:
    """Tokens per second after the first token (the first one includes the prefill)."""
    return (len(times) - 1) / (times[-1] - times[0])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM

    source = resolve_model("smollm2")
    reference = AutoModelForCausalLM.from_pretrained(source.path, dtype=torch.float32).eval()
    with LocalSwarm("smollm2", even_spans(30, 3), num_threads=1) as swarm:
        config = swarm.client_config()
        with DistributedModelForCausalLM.from_pretrained("smollm2", config=config) as model:
            text = model.tokenizer.apply_chat_template(
                [{"role": "user", "content": PROMPT}], tokenize=False, add_generation_prompt=True
            )
            ids = model.tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
            model.generate(ids, max_new_tokens=4)  # warm up connections and caches
            local, remote = [], []
            for _ in range(args.runs):
                stamps = Stamps()
                with torch.no_grad():
                    reference.generate(
                        ids,
                        attention_mask=torch.ones_like(ids),
                        do_sample=False,
                        max_new_tokens=args.new_tokens,
                        min_new_tokens=args.new_tokens,
                        streamer=stamps,
                    )
                local.append(decode_rate(stamps.times))
                stamps = Stamps()
                stamps.prompt_seen = True  # corolla's streamer sees new tokens only
                model.generate(ids, max_new_tokens=args.new_tokens, ignore_eos=True, streamer=stamps.put)
                remote.append(decode_rate(stamps.times))
    result = {
        "model": source.name,
        "dtype": "float32",
        "torch_threads_per_process": 1,
        "servers": 3,
        "prompt_tokens": int(ids.shape[1]),
        "new_tokens": args.new_tokens,
        "local_transformers_decode_tokens_per_s": [round(x, 2) for x in local],
        "swarm_decode_tokens_per_s": [round(x, 2) for x in remote],
        "local_median": round(statistics.median(local), 2),
        "swarm_median": round(statistics.median(remote), 2),
        "ratio_swarm_to_local": round(statistics.median(remote) / statistics.median(local), 3),
        "target_ratio": 0.8,
    }
    result["meets_target"] = result["ratio_swarm_to_local"] >= result["target_ratio"]
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
