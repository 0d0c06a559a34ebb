"""Every Hugging Face decoder family: swarm decode speed versus local transformers, per family.

For each family of tests/tiny_models.py (a tiny random-weight config, 6 blocks), saves the checkpoint in a
temporary folder, then times greedy generation of `--new-tokens` tokens from a fixed 16-token prompt
(batch 1) twice: with transformers in this process, and through a local swarm of 2 servers (blocks 0:3
and 3:6) on 127.0.0.1 with NAT port mapping off. One torch thread in every process. Each side has one
warm-up run, then `--repeats` timed runs; the JSON reports medians. End-to-end tokens/s counts the whole
call (prefill included); decode tokens/s counts the tokens after the first, from the arrival time of the
first to that of the last (a streamer stamps each token). The swarm ignores EOS (transformers is told
`min_new_tokens`), and `tokens_equal` says whether both chose the same greedy tokens. JSON goes to
stdout, logs to stderr. `--device cuda` runs both sides on a GPU (the servers with `--device`, the
client's head and the reference moved there), in `--dtype` (float32 by default, as on the CPU).

    python -m bench.models.models [--families llama mistral ...] [--new-tokens 32] [--repeats 3]
        [--device cuda]
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch: one thread here and in every server

import torch

from bench.lib.env import device_flags, parser
from bench.lib.stamp import report
from bench.lib.timing import Stamps, decode_rate
from corolla.client.model import DistributedModelForCausalLM
from corolla.launch.local import LocalSwarm
from corolla.models.span import Span
from tests.tiny_models import FAMILIES, load_reference, save_tiny_model, tiny_config

logger = logging.getLogger("bench.models")

SPANS = [(0, 3), (3, 6)]
PROMPT_TOKENS = 16
PROMPT_SEED = 1234
TINY_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def special_ids(config) -> set[int]:
    ids = set()
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        value = getattr(config, name, None)
        ids.update(value if isinstance(value, list) else [] if value is None else [value])
    return ids


def eos_ids(config) -> list[int]:
    eos = config.eos_token_id
    return list(eos) if isinstance(eos, (list, tuple)) else [eos]


def prompt_ids(config) -> torch.Tensor:
    """A fixed prompt [1, 16] of ordinary tokens (no pad, BOS or EOS ids)."""
    generator = torch.Generator().manual_seed(PROMPT_SEED)
    low = max(special_ids(config)) + 1
    return torch.randint(low, config.vocab_size, (1, PROMPT_TOKENS), generator=generator)


def timed_runs(generate, repeats: int) -> tuple[torch.Tensor, float, float]:
    """Call `generate(stamps)` once to warm up, then `repeats` times; returns the last run's new tokens,
    the median end-to-end seconds and the median decode tokens/s."""
    generate(Stamps())
    seconds, rates, tokens = [], [], None
    for _ in range(repeats):
        stamps = Stamps()
        start = time.perf_counter()
        tokens = generate(stamps)
        seconds.append(time.perf_counter() - start)
        rates.append(decode_rate(stamps.times))
    return tokens, statistics.median(seconds), statistics.median(rates)


def run_local(path: Path, ids: torch.Tensor, new_tokens: int, repeats: int, device: str, dtype: str):
    reference = load_reference(path).to(device, getattr(torch, dtype))
    ids = ids.to(device)

    def generate(stamps: Stamps) -> torch.Tensor:
        with torch.no_grad():
            out = reference.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                streamer=stamps,
            )
        return out[0, ids.shape[1] :].cpu()

    return timed_runs(generate, repeats)


def run_swarm(path: Path, ids: torch.Tensor, new_tokens: int, repeats: int, device: str, dtype: str):
    server_args = ["--device", device, "--dtype", dtype]
    with LocalSwarm(str(path), SPANS, num_threads=1, server_args=server_args) as swarm:
        config = replace(swarm.client_config(), dtype=dtype)
        with DistributedModelForCausalLM.from_pretrained(str(path), config=config) as model:
            model.to(device)
            ids = ids.to(device)

            def generate(stamps: Stamps) -> torch.Tensor:
                out = model.generate(ids, max_new_tokens=new_tokens, ignore_eos=True, streamer=stamps.stamp)
                return out[0, ids.shape[1] :].cpu()

            return timed_runs(generate, repeats)


def first_difference(a: torch.Tensor, b: torch.Tensor) -> int | None:
    if a.shape != b.shape:
        return min(a.numel(), b.numel())
    diff = (a != b).nonzero()
    return int(diff[0, 0]) if diff.numel() else None


def cache_bytes(path: Path, config) -> dict:
    """What the servers cache per token, per block on average (float32), and what expanded keys and values
    in every block would take: for multi-head latent attention every head's keys and values, made from
    the cached latent; for layers with a recurrent state (which cache no tokens), attention's (DeepSeek-V4's
    compressed entries against full attention's keys and values). Plus the
    recurrent states of one sequence over all blocks (fixed, whatever its length), and the width of what
    one server hands the next."""
    span = Span.load(path, 0, config.num_hidden_layers)
    cached = span.cache_bytes_per_token / config.num_hidden_layers
    if getattr(config, "kv_lora_rank", None):
        qk_head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
        expanded = config.num_attention_heads * (qk_head_dim + config.v_head_dim) * 4
    elif span.kv_blocks:
        shapes = [span.cache_shapes[block] for block in span.kv_blocks]
        expanded = sum(shape.bytes_per_token(4) for shape in shapes) / len(shapes)
    else:  # DeepSeek-V4: a window and compressed entries; full attention would keep every key and value
        expanded = 2 * config.num_key_value_heads * config.head_dim * 4
    return {
        "cache_bytes_per_token_per_block": round(cached, 1),
        "expanded_kv_bytes_per_token_per_block": expanded,
        "cache_vs_expanded": round(cached / expanded, 4),
        "state_bytes_per_sequence": span.state_bytes_per_row,
        # what travels between servers per token (models/handoff.py: Gemma's per-layer inputs and streams)
        "wire_floats_per_token": span.config.wire.width,
        "wire_vs_hidden": round(span.config.wire.width / span.config.hidden_size, 2),
    }


def bench_family(family: str, root: Path, args: argparse.Namespace) -> dict:
    path = save_tiny_model(family, root / f"tiny-{family}")
    config = tiny_config(family).get_text_config()  # a multimodal wrapper: its language model
    ids = prompt_ids(config)
    logger.info("%s: local transformers", family)
    new_tokens, where = args.new_tokens, (args.new_tokens, args.repeats, args.device, args.dtype)
    local_tokens, local_s, local_decode = run_local(path, ids, *where)
    logger.info("%s: swarm of %d servers", family, len(SPANS))
    swarm_tokens, swarm_s, swarm_decode = run_swarm(path, ids, *where)
    local_rate, swarm_rate = new_tokens / local_s, new_tokens / swarm_s
    diff = first_difference(swarm_tokens, local_tokens)
    result = {
        "local_tokens_per_s": round(local_rate, 2),
        "local_decode_tokens_per_s": round(local_decode, 2),
        "swarm_tokens_per_s": round(swarm_rate, 2),
        "swarm_decode_tokens_per_s": round(swarm_decode, 2),
        "swarm_vs_local": round(swarm_rate / local_rate, 2),
        "swarm_vs_local_decode": round(swarm_decode / local_decode, 2),
        "tokens_equal": diff is None,
        **cache_bytes(path, config),
    }
    if diff is not None:
        swarm_token = int(swarm_tokens[diff]) if diff < swarm_tokens.numel() else None
        result["first_difference"] = {
            "index": diff,
            "swarm_token": swarm_token,
            "local_token": int(local_tokens[diff]) if diff < local_tokens.numel() else None,
            "swarm_chose_eos": swarm_token in eos_ids(config),  # transformers masks EOS there
        }
    logger.info("%s: %s", family, result)
    return result


def main() -> None:
    flags = parser(__doc__, device_flags())
    flags.add_argument("--families", nargs="+", choices=FAMILIES, default=list(FAMILIES))
    flags.add_argument("--new-tokens", type=int, default=32)
    flags.add_argument("--repeats", type=int, default=3)
    args = flags.parse_args()
    if args.new_tokens < 2 or args.repeats < 1:
        flags.error("--new-tokens must be at least 2 (decode speed) and --repeats at least 1")
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    torch.set_num_threads(1)
    results: dict[str, dict] = {}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="corolla-bench-models-") as root:
        for family in args.families:
            try:
                results[family] = bench_family(family, Path(root), args)
            except Exception as error:  # one family failing does not stop the others
                logger.error("%s failed:\n%s", family, traceback.format_exc())
                results[family] = {"error": f"{type(error).__name__}: {error}"}
    config = {
        "prompt_tokens": PROMPT_TOKENS,
        "batch_size": 1,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "warmup_runs": 1,
        "servers": [f"{start}:{end}" for start, end in SPANS],
        "dtype": args.dtype,
        "device": torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else args.device,
        "torch_threads_per_process": 1,
        "tiny_config": {k: getattr(tiny_config(FAMILIES[0]), k) for k in TINY_FIELDS},
        "families_run": args.families,
        "wall_s": round(time.perf_counter() - started, 2),
    }
    # a run over some families is kept beside the run over all of them, not over it
    subset = "" if set(args.families) == set(FAMILIES) else "_".join(args.families)[:60]
    report(__file__, {"families": results, "config": config}, variant=subset)


if __name__ == "__main__":
    main()
