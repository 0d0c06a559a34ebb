"""Decode speed side by side with local transformers: one session, then N sessions released together.

Both sides run SmolLM2-135M-Instruct in float32 with one torch thread in every process (the bench
process, each server, the reference), on a local swarm of a DHT and 3 servers of 10 blocks. One
session: greedy decode of one prompt, against transformers' `generate` on the same prompt. N sessions
(`--sessions`): N greedy sessions of one client at once (asyncio tasks, as the API server runs them),
against transformers decoding the same N prompts as one left-padded batch. Runs alternate between the
two sides so that drift on a shared machine hits both alike; the JSON reports every run, the medians
and their ratio (issue 26: >= 0.95 for one session, >= 0.7 for 16), and the servers' mean rows per
engine pass during the swarm's runs.

On a GPU (`--device cuda`, issue 27) the servers, the client's head and the reference all compute on
it, in `--dtype` (bfloat16 there is what a GPU server takes by default). `--model` takes another
checkpoint folder (for speed at a realistic size: random weights with a real model's shapes and a
tokenizer that has a chat template), split evenly over `--servers`; `--server-arg` passes an option to
every server (e.g. `--server-arg=--max-cache-tokens=65536` when several servers share one GPU).

    python -m bench.decode.latency [--new-tokens 64] [--runs 3] [--sessions 8 16]
        [--device cuda --dtype bfloat16] [--model FOLDER --servers 2]
"""

from __future__ import annotations

import os
import statistics
from dataclasses import replace

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch: one thread here and in every server

import torch

from bench.lib.env import device_flags, parser
from bench.lib.prompts import chat_ids, topic_prompts
from bench.lib.stamp import report
from bench.lib.swarm import concurrent, engine_counters
from bench.lib.timing import Stamps, decode_rate
from corolla.client.model import DistributedModelForCausalLM
from corolla.launch.local import LocalSwarm, even_spans
from corolla.models.source import resolve_model

PROMPT = "Write a short story about a lighthouse keeper."


def local_rate(reference, tokenizer, prompts: list[list[int]], new_tokens: int) -> float:
    """transformers' greedy decode of `prompts` as one left-padded batch: tokens per second, all rows."""
    tokenizer.padding_side = "left"
    batch = tokenizer.pad({"input_ids": prompts}, return_tensors="pt")
    stamps = Stamps()
    with torch.no_grad():
        reference.generate(
            **batch,
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            streamer=stamps if len(prompts) == 1 else None,
            logits_processor=None if len(prompts) == 1 else [BatchStamps(stamps)],
        )
    return decode_rate(stamps.times, len(prompts))


class BatchStamps:
    """A logits processor that stamps each decode step of a batch (streamers take one row only)."""

    def __init__(self, stamps: Stamps) -> None:
        self.stamps = stamps

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.stamps.stamp()
        return scores


def swarm_rate(model: DistributedModelForCausalLM, prompts: list[list[int]], new_tokens: int) -> float:
    """The same prompts as concurrent sessions of one client: decode tokens per second, all sessions
    (from the step where the last session got its first token to the last token)."""
    stamps = concurrent(model, prompts, new_tokens).stamps
    start, end = max(times[0] for times in stamps), max(times[-1] for times in stamps)
    tokens = sum(sum(start < t <= end for t in times) for times in stamps)
    return tokens / (end - start)


def compare(reference, model, prompts: list[list[int]], runs: int, new_tokens: int) -> dict:
    local, remote = [], []
    rows = passes = 0
    for _ in range(runs):
        local.append(local_rate(reference, model.tokenizer, prompts, new_tokens))
        before = engine_counters(model)
        remote.append(swarm_rate(model, prompts, new_tokens))
        after = engine_counters(model)
        rows += after[0] - before[0]
        passes += after[1] - before[1]
    return {
        "sessions": len(prompts),
        "local_transformers_decode_tokens_per_s": [round(x, 2) for x in local],
        "swarm_decode_tokens_per_s": [round(x, 2) for x in remote],
        "local_median": round(statistics.median(local), 2),
        "swarm_median": round(statistics.median(remote), 2),
        "ratio_swarm_to_local": round(statistics.median(remote) / statistics.median(local), 3),
        "swarm_rows_per_pass": round(rows / max(passes, 1), 2),  # the servers' mean batch, prefill included
    }


def main() -> None:
    flags = parser(__doc__, device_flags())
    flags.add_argument("--new-tokens", type=int, default=64)
    flags.add_argument("--runs", type=int, default=3)
    flags.add_argument("--sessions", type=int, nargs="*", default=[], help="also N sessions at once")
    flags.add_argument("--model", default="smollm2", help="smollm2 (bundled) or a checkpoint folder")
    flags.add_argument("--servers", type=int, default=3, help="the model's blocks split evenly over them")
    flags.add_argument("--server-arg", action="append", default=[], help="an option for every server")
    args = flags.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM

    source = resolve_model(args.model)
    dtype = getattr(torch, args.dtype)
    reference = AutoModelForCausalLM.from_pretrained(source.path, dtype=dtype).to(args.device).eval()
    spans = even_spans(reference.config.num_hidden_layers, args.servers)
    server_args = ["--device", args.device, "--dtype", args.dtype, *args.server_arg]
    with LocalSwarm(args.model, spans, num_threads=1, server_args=server_args) as swarm:
        config = replace(swarm.client_config(), dtype=args.dtype)
        with DistributedModelForCausalLM.from_pretrained(args.model, config=config) as model:
            model.to(args.device)
            ids = chat_ids(model.tokenizer, PROMPT)
            model.generate(torch.tensor([ids]), max_new_tokens=4)  # warm up connections and caches
            levels = [compare(reference, model, [ids], args.runs, args.new_tokens)]
            for count in args.sessions:
                prompts = topic_prompts(model.tokenizer, count)
                levels.append(compare(reference, model, prompts, args.runs, args.new_tokens))
    targets = {1: 0.95, 16: 0.7}
    for level in levels:
        if level["sessions"] in targets:
            level["target_ratio"] = targets[level["sessions"]]
            level["meets_target"] = level["ratio_swarm_to_local"] >= level["target_ratio"]
    result = {
        "model": source.name,
        "dtype": args.dtype,
        "device": str(reference.device),
        "device_name": torch.cuda.get_device_name(reference.device)
        if reference.device.type == "cuda"
        else "",
        "torch_threads_per_process": 1,
        "servers": args.servers,
        "prompt_tokens": len(ids),
        "new_tokens": args.new_tokens,
        "levels": levels,
    }
    report(__file__, result)


if __name__ == "__main__":
    main()
