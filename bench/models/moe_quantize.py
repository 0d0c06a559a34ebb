"""Quantized MoE experts at a real model's shapes: the bytes they take and what a decode step costs.

Builds `--layers` layers of Qwen3-30B-A3B's shapes (hidden 2048, 128 experts of 768, 8 per token, 32
heads of 128 with 4 key/value heads) with random bfloat16 weights, saved as a Hugging Face folder, and
loads the span three ways: as stored (bfloat16), `--quantize int8` and `--quantize int4` (fused experts
become torchao int8 tensors in both modes; the attention's linears int8 or int4). For each: the span's
weight bytes (experts apart), the process's RSS once loaded (and its peak while loading), and blocks
per second for one decode step through the engine (corolla's own throughput measurement). One torch
thread. JSON on stdout.

    python -m bench.models.moe_quantize [--layers 2]
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch: one thread here and in every mode's child

import psutil
import torch

from bench.lib.checkpoints import save_random
from bench.lib.env import ROOT, module_command, parser
from bench.lib.stamp import report
from corolla.models.quantize import weight_bytes
from corolla.models.span import Span
from corolla.server.hosting.startup_speed import measure_throughput
from corolla.utils import peak_rss_bytes, release_freed_memory

SHAPES = dict(
    hidden_size=2048,
    intermediate_size=6144,
    moe_intermediate_size=768,
    num_experts=128,
    num_experts_per_tok=8,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    vocab_size=1024,
)


def save_model(folder: str, layers: int) -> None:
    from transformers import Qwen3MoeConfig

    save_random(Qwen3MoeConfig(**SHAPES, num_hidden_layers=layers), folder)


def measure(folder: str, layers: int, quantize: str | None) -> dict:
    span = Span.load(folder, 0, layers, torch.bfloat16, quantize)
    release_freed_memory()
    experts = sum(weight_bytes(block.mlp.experts) for block in span.blocks)
    return {
        "weights_gb": round(weight_bytes(span) / 1e9, 3),
        "experts_gb": round(experts / 1e9, 3),
        "blocks_per_s_decode": round(measure_throughput(span, use_cache=False), 2),
        "rss_gb": round(psutil.Process().memory_info().rss / 1e9, 2),  # loaded, freed memory returned
        "peak_rss_gb": round(peak_rss_bytes() / 1e9, 2),  # while loading
    }


def main() -> None:
    flags = parser(__doc__)
    flags.add_argument("--layers", type=int, default=2)
    flags.add_argument("--only", choices=["bfloat16", "int8", "int4"], help="one mode in this process")
    args = flags.parse_args()
    torch.set_num_threads(1)
    if args.only:  # a child: one mode, so that its peak RSS is its own
        folder = os.environ["COROLLA_BENCH_FOLDER"]
        quantize = None if args.only == "bfloat16" else args.only
        print(json.dumps(measure(folder, args.layers, quantize)))
        return
    results = {}
    with tempfile.TemporaryDirectory(prefix="corolla-bench-moe-") as folder:
        save_model(folder, args.layers)
        for mode in ("bfloat16", "int8", "int4"):
            child = subprocess.run(
                [*module_command(__spec__.name), "--layers", str(args.layers), "--only", mode],
                env={**os.environ, "COROLLA_BENCH_FOLDER": folder},
                cwd=ROOT,
                capture_output=True,
                text=True,
                check=True,
            )
            results[mode] = json.loads(child.stdout.strip().splitlines()[-1])
    base = results["bfloat16"]
    for mode in ("int8", "int4"):
        results[mode]["experts_vs_bfloat16"] = round(results[mode]["experts_gb"] / base["experts_gb"], 3)
        speed = results[mode]["blocks_per_s_decode"] / base["blocks_per_s_decode"]
        results[mode]["decode_speed_vs_bfloat16"] = round(speed, 3)
    shapes = f"Qwen3-30B-A3B shapes, {args.layers} layers, random bfloat16 weights"
    report(__file__, {"model": shapes, "torch_threads": 1, "results": results})


if __name__ == "__main__":
    main()
