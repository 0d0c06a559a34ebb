"""Quantized servers (`--quantize int8|int4`) and `--dtype bfloat16` versus float32: memory, speed, quality.

SmolLM2-135M-Instruct, per precision, one swarm at a time on 127.0.0.1 (no NAT port mapping, one torch
thread per process, `--max-cache-tokens 1024`): servers 0:10, 10:20, 20:30 and a 10:11 baseline that the
client never routes through. Tensor bytes of blocks 10:20 loaded here as a server loads them; RSS of the
10:20 and 10:11 servers settled after one forward of the same 32 tokens straight to each (the difference
is what 9 blocks cost); perplexity of pydoc_data topics (1536 tokens, chunks of 512) through the swarm;
greedy agreement with fp32 (8 chat prompts x 64 tokens, EOS ignored); decode tokens/s over 64 tokens
(arrival times, median of 3 after a warm-up). Then random weights shaped as Llama-3.2-1B, saved in bfloat16,
served with --dtype float32 (0:6, 6:11, 11:16, `--max-cache-tokens 2048`) in int8 and fp32: RSS per server,
decode tokens/s over 32 tokens. JSON to stdout, logs to stderr.

    python -m bench.models.quantize [--precisions fp32 bf16 int8 int4] [--skip-large] [--large-runs 1]
"""

from __future__ import annotations

import gc
import logging
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch: one thread here and in every server

import psutil
import torch

from bench.lib.env import parser
from bench.lib.stamp import report
from bench.lib.swarm import server_status
from bench.lib.timing import Stamps, decode_rate
from corolla.cli.generate import encode_prompt
from corolla.client.model import DistributedModelForCausalLM
from corolla.launch.local import LocalSwarm
from corolla.models.quantize import quantize_blocks, weight_bytes
from corolla.models.source import resolve_model
from corolla.models.span import Span
from corolla.swarm.policy.routing import Hop
from corolla.utils import peak_rss_bytes

logger = logging.getLogger("bench.quantize")

MIB = 2**20
# precision: (server arguments, dtype and mode of the in-process load)
PRECISIONS = {
    "fp32": (["--dtype", "float32"], torch.float32, None),
    "bf16": (["--dtype", "bfloat16"], torch.bfloat16, None),
    "int8": (["--quantize", "int8"], torch.float32, "int8"),
    "int4": (["--quantize", "int4"], torch.float32, "int4"),
}
SPANS, MEASURED, BASELINE = [(0, 10), (10, 20), (20, 30)], (10, 20), (10, 11)
LARGE_SPANS = [(0, 6), (6, 11), (11, 16)]
PROMPT = "Write a short story about a lighthouse keeper."
CHAT_PROMPTS = [
    "What is the capital of France?",
    "Explain photosynthesis in two sentences.",
    "Write a haiku about the sea.",
    "List three uses of a paperclip.",
    "How do I reverse a list in Python?",
    "Why is the sky blue?",
    "Give me a recipe for pancakes.",
    "Summarize the plot of Romeo and Juliet.",
]
TOPICS = ["assignment", "if", "while", "for", "try", "with", "function", "class", "import", "lambda"]
LARGE_SHAPES = {"vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16}
LARGE_HEADS = {"num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64}
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0}
LLAMA3_ROPE |= {"high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
RATIOS = {"tensor": "tensor_bytes_10_20", "rss_growth": "rss_growth_mb_9_blocks", "perplexity": "perplexity"}
PPL_TOKENS, PPL_CHUNK, NEW_TOKENS, LARGE_NEW_TOKENS = 1536, 512, 64, 32


def tensor_bytes(path: Path, precision: str) -> int:
    """Stored bytes of blocks 10:20 loaded as SpanLoader.load_span loads them."""
    _, dtype, mode = PRECISIONS[precision]
    span = Span.load(path, MEASURED[0], MEASURED[1], dtype)
    if mode is not None:
        quantize_blocks(span.blocks, mode)
    return weight_bytes(span.blocks)


def settled_rss_mb(pid: int, timeout: float = 20.0) -> tuple[float, float]:
    """RSS and its file-backed part (psutil's `shared`: mapped checkpoint pages, libraries), in MiB, once
    three readings 0.5 s apart lie within 1 MiB (or after `timeout`)."""
    process, readings, deadline = psutil.Process(pid), [], time.monotonic() + timeout
    while True:
        info = process.memory_info()
        readings.append(info.rss / MIB)
        recent = readings[-3:]
        if (len(recent) == 3 and max(recent) - min(recent) < 1.0) or time.monotonic() > deadline:
            return round(info.rss / MIB, 1), round(info.shared / MIB, 1)
        time.sleep(0.5)


def memory_probe(model: DistributedModelForCausalLM, swarm: LocalSwarm) -> dict:
    """RSS of the 10:20 and 10:11 servers, settled after one forward of the same 32 tokens sent to each."""
    with torch.no_grad():
        hidden = model.head.embed(torch.arange(100, 132)[None])
    servers = {s.blocks: s for s in swarm.servers}
    for blocks in (MEASURED, BASELINE):
        hop = Hop(servers[blocks].peer_id, *blocks)
        model.runtime.run(model.client.swarm.peers.forward(hop, hidden))
    (rss, file), (rss_one, file_one) = (settled_rss_mb(servers[b].pid) for b in (MEASURED, BASELINE))
    result = {"rss_mb": rss, "rss_mb_10_11": rss_one, "rss_growth_mb_9_blocks": round(rss - rss_one, 1)}
    return result | {"rss_growth_file_backed_mb": round(file - file_one, 1)}


def announced(model: DistributedModelForCausalLM, swarm: LocalSwarm) -> dict:
    """The precision each server reports in its status (rpc_info)."""
    statuses = {s.blocks: server_status(model, s.peer_id) for s in swarm.servers}
    return {f"{start}:{end}": status.precision for (start, end), status in statuses.items()}


def ppl_ids(tokenizer) -> torch.Tensor:
    from pydoc_data.topics import topics

    ids = tokenizer("\n\n".join(topics[name] for name in TOPICS), add_special_tokens=False).input_ids
    assert len(ids) >= PPL_TOKENS, f"the perplexity text has only {len(ids)} tokens"
    return torch.tensor(ids[:PPL_TOKENS])[None]


def perplexity(model: DistributedModelForCausalLM, ids: torch.Tensor) -> float:
    """exp of the mean next-token loss over chunks of PPL_CHUNK tokens (each chunk its own context)."""
    chunks = ids.split(PPL_CHUNK, dim=1)
    with torch.no_grad():
        total = sum(float(model(chunk, labels=chunk).loss) * (chunk.shape[1] - 1) for chunk in chunks)
    return math.exp(total / (ids.shape[1] - len(chunks)))


def greedy(model: DistributedModelForCausalLM) -> list[list[int]]:
    outputs = []
    for prompt in CHAT_PROMPTS:
        ids = torch.tensor(encode_prompt(model.tokenizer, prompt, None, False))[None]
        out = model.generate(ids, max_new_tokens=NEW_TOKENS, ignore_eos=True)
        outputs.append(out[0, ids.shape[1] :].tolist())
    return outputs


def decode_speed(model: DistributedModelForCausalLM, ids: torch.Tensor, new: int, runs: int) -> list:
    """Tokens/s after the first (which includes the prefill), `runs` times after a 4-token warm-up."""
    model.generate(ids, max_new_tokens=4, ignore_eos=True)
    rates = []
    for _ in range(runs):
        stamps = Stamps()
        model.generate(ids, max_new_tokens=new, ignore_eos=True, streamer=stamps.stamp)
        rates.append(round(decode_rate(stamps.times), 2))
        logger.info("decode run: %.2f tokens/s", rates[-1])
    return rates


def bench_smollm2(path: Path, precision: str, runs: int) -> tuple[dict, list[list[int]]]:
    result: dict = {"tensor_bytes_10_20": tensor_bytes(path, precision)}
    server_args = [*PRECISIONS[precision][0], "--max-cache-tokens", "1024"]
    with LocalSwarm("smollm2", [*SPANS, BASELINE], num_threads=1, server_args=server_args) as swarm:
        allowed = tuple(s.peer_id for s in swarm.servers if s.blocks != BASELINE)
        config = swarm.client_config(allowed_servers=allowed)
        with DistributedModelForCausalLM.from_pretrained("smollm2", config=config) as model:
            result.update(memory_probe(model, swarm))
            result["announced_precision"] = announced(model, swarm)
            result["perplexity"] = round(perplexity(model, ppl_ids(model.tokenizer)), 4)
            logger.info("%s: %s", precision, result)
            tokens = greedy(model)
            ids = torch.tensor(encode_prompt(model.tokenizer, PROMPT, None, False))[None]
            rates = decode_speed(model, ids, NEW_TOKENS, runs)
            result |= {"decode_tokens_per_s": statistics.median(rates), "decode_tokens_per_s_runs": rates}
            measured = next(s for s in swarm.servers if s.blocks == MEASURED)
            result["rss_mb_after_workload"] = settled_rss_mb(measured.pid)[0]
            result["peak_rss_mb"] = round(peak_rss_bytes(measured.pid) / MIB, 1)
    return result, tokens


def agreement(tokens: list[list[int]], reference: list[list[int]]) -> tuple[str, list[int]]:
    """Tokens equal to the reference's, position by position, and each prompt's common prefix."""
    matched, prefixes = 0, []
    for ours, theirs in zip(tokens, reference, strict=True):
        same = [a == b for a, b in zip(ours, theirs, strict=True)]
        matched += sum(same)
        prefixes.append(same.index(False) if False in same else len(same))
    return f"{matched}/{sum(map(len, reference))}", prefixes


def add_ratios(results: dict, tokens: dict) -> None:
    """Ratios and greedy agreement against fp32 (when fp32 was run)."""
    base = results.get("fp32")
    for precision, result in results.items():
        if base is None or "error" in result or "error" in base:
            continue
        for short, name in RATIOS.items():
            result[f"{short}_ratio_vs_fp32"] = round(result[name] / base[name], 4)
        matched, prefixes = agreement(tokens[precision], tokens["fp32"])
        result["greedy_tokens_matching_fp32"] = matched
        result["greedy_common_prefix_per_prompt"] = prefixes


def save_large(folder: str) -> int:
    """A random-weight model with Llama-3.2-1B's shapes, saved in bfloat16; returns its parameter count."""
    from transformers import LlamaConfig, LlamaForCausalLM

    extra = {"tie_word_embeddings": True, "max_position_embeddings": 4096}
    config = LlamaConfig(**LARGE_SHAPES, **LARGE_HEADS, rope_parameters=LLAMA3_ROPE, **extra)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():  # norms 1, matrices uniform with std 0.02
            param.fill_(1.0) if param.dim() == 1 else param.uniform_(-0.0346, 0.0346, generator=generator)
    model.tie_weights()
    model.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def bench_large(folder: str, precision: str, runs: int) -> dict:
    server_args = [*PRECISIONS[precision][0], "--max-cache-tokens", "2048"]
    swarm = LocalSwarm(folder, LARGE_SPANS, num_threads=1, server_args=server_args, start_timeout=600)
    with swarm, DistributedModelForCausalLM.from_pretrained(folder, config=swarm.client_config()) as model:
        generator = torch.Generator().manual_seed(1234)
        ids = torch.randint(1000, model.config.vocab_size, (1, 16), generator=generator)
        rates = decode_speed(model, ids, LARGE_NEW_TOKENS, runs)
        result = {"announced_precision": announced(model, swarm), "rss_mb": {}, "peak_rss_mb": {}}
        for server in swarm.servers:
            span = f"{server.blocks[0]}:{server.blocks[1]}"
            result["rss_mb"][span] = settled_rss_mb(server.pid)[0]
            result["peak_rss_mb"][span] = round(peak_rss_bytes(server.pid) / MIB, 1)
    return {**result, "decode_tokens_per_s": statistics.median(rates), "decode_tokens_per_s_runs": rates}


def attempt(label: str, bench, *args):
    """`bench(*args)`, or {"error": ...} if it fails (one precision failing does not stop the others)."""
    logger.info("%s", label)
    try:
        return bench(*args)
    except Exception as error:
        logger.exception("%s failed", label)
        return {"error": f"{type(error).__name__}: {error}"}


def run_large(precisions: list[str], runs: int) -> dict:
    results: dict = {"checkpoint_dtype": "bfloat16", "servers": [f"{a}:{b}" for a, b in LARGE_SPANS]}
    with tempfile.TemporaryDirectory(prefix="corolla-bench-quantize-", dir="/tmp") as root:
        folder = f"{root}/llama-3.2-1b-shapes"
        started = time.perf_counter()
        results["parameters"] = save_large(folder)
        gc.collect()  # the model built to save it
        results["checkpoint_bytes"] = sum(f.stat().st_size for f in Path(folder).iterdir())
        results["save_s"] = round(time.perf_counter() - started, 1)
        for precision in precisions:
            results[precision] = attempt(f"large {precision}", bench_large, folder, precision, runs)
            logger.info("%s: %s", precision, results[precision])
    return results


def run_smollm2(precisions: list[str], runs: int) -> dict:
    path = resolve_model("smollm2").path
    results, tokens = {}, {}
    for precision in precisions:
        outcome = attempt(f"smollm2 {precision}", bench_smollm2, path, precision, runs)
        results[precision], tokens[precision] = outcome if isinstance(outcome, tuple) else (outcome, None)
    add_ratios(results, tokens)
    return results


def main() -> None:
    flags = parser(__doc__)
    flags.add_argument("--precisions", nargs="+", choices=list(PRECISIONS), default=list(PRECISIONS))
    flags.add_argument("--runs", type=int, default=3, help="timed decode runs per SmolLM2 precision")
    flags.add_argument("--skip-large", action="store_true", help="leave out the Llama-3.2-1B-shaped model")
    flags.add_argument("--large-precisions", nargs="+", choices=list(PRECISIONS), default=["int8", "fp32"])
    flags.add_argument("--large-runs", type=int, default=1, help="timed decode runs per large precision")
    args = flags.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    torch.set_num_threads(1)
    started = time.perf_counter()
    output = {"smollm2": run_smollm2(args.precisions, args.runs)}
    if not args.skip_large:
        output["llama_3_2_1b_shapes"] = run_large(args.large_precisions, args.large_runs)
    output["config"] = {
        "smollm2_servers": "0:10, 10:20, 20:30 (and 10:11 for RSS, not routed through)",
        "max_cache_tokens": {"smollm2": 1024, "llama_3_2_1b_shapes": 2048},
        "server_args": {name: server_args for name, (server_args, _, _) in PRECISIONS.items()},
        "perplexity_text": f"pydoc_data.topics {TOPICS}, first {PPL_TOKENS} tokens, chunks of {PPL_CHUNK}",
        "greedy": f"{len(CHAT_PROMPTS)} chat prompts x {NEW_TOKENS} new tokens, EOS ignored",
        "decode_new_tokens": {"smollm2": NEW_TOKENS, "llama_3_2_1b_shapes": LARGE_NEW_TOKENS},
        "decode_runs": {"smollm2": args.runs, "llama_3_2_1b_shapes": args.large_runs, "warmup_tokens": 4},
        "client": "embeddings and LM head in float32; one torch thread in every process",
        "wall_s": round(time.perf_counter() - started, 1),
    }
    report(__file__, output)


if __name__ == "__main__":
    main()
