"""Gated DeltaNet linear attention at Qwen3.5's real shapes: what a server keeps per session, and what
it costs.

Builds a Qwen3.5 text config with the real model's shapes (transformers' defaults for `qwen3_5`: hidden
4096, MLPs of 12288, full attention of 16 heads / 4 kv heads of 256 every 4th layer, linear attention of
16 key / 32 value heads of 128 with a 4-wide convolution) but `--layers` layers and a small vocabulary,
with random weights in bfloat16, saved as a Hugging Face folder. Serves it on 2 servers of half the
layers each (each ends on a full-attention layer: 3 linear, 1 full), then reports: decode tokens/s of
one greedy session (a 16-token prompt, `--new-tokens` new tokens) against transformers running the same
folder in this process, each server's RSS, the cache bytes per token the servers announce against what
the same model with full attention in every layer would cache, one sequence's recurrent states, and how
many sessions of `--context` tokens a 4 GiB cache holds (tokens plus the states twice, as the engine
charges them), for these layers and for the real model's 32. One torch thread per process. JSON on
stdout.

    python -m bench.models.linear_attention [--layers 8] [--new-tokens 16] [--context 4096]
"""

from __future__ import annotations

import os
import tempfile

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch: one thread here and in every server

import torch

from bench.lib.checkpoints import save_random
from bench.lib.env import parser, shape_flags
from bench.lib.stamp import report
from bench.models.mla import CACHE_BUDGET, serve_and_measure
from corolla.models.span import Span

REAL_LAYERS = 32


def save_model(folder: str, layers: int):
    from transformers import AutoConfig

    config = AutoConfig.for_model("qwen3_5").get_text_config()
    config.num_hidden_layers = layers
    config.layer_types = config.layer_types[:layers]
    config.vocab_size = 1024
    config.eos_token_id = None
    save_random(config, folder)
    return config


def sessions_in(budget: int, per_token: float, states: int, context: int) -> float:
    return round(budget / (per_token * context + 2 * states), 2)


def main() -> None:
    args = parser(__doc__, shape_flags(layers=8, new_tokens=16)).parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="corolla-bench-linear-") as folder:
        config = save_model(folder, args.layers)
        linear = Span.load(folder, 0, 1, dtype=torch.bfloat16)  # one linear-attention layer
        attention = Span.load(folder, 3, 4, dtype=torch.bfloat16)  # one full-attention layer
        state_per_layer = linear.state_bytes_per_row
        kv_per_layer = attention.cache_bytes_per_token
        del linear, attention
        announced, served = serve_and_measure(folder, args.layers, args.new_tokens)
    report(__file__, summary(args, config, announced, served, state_per_layer, kv_per_layer))


def summary(args, config, announced, served: dict, state_per_layer: int, kv_per_layer: int) -> dict:
    cached = sum(s.info.cache_bytes_per_token for s in announced)
    linear_layers = sum(kind == "linear_attention" for kind in config.layer_types)
    real_linear = REAL_LAYERS * linear_layers // args.layers
    states = linear_layers * state_per_layer
    real = {"per_token": (REAL_LAYERS - real_linear) * kv_per_layer, "states": real_linear * state_per_layer}
    context = args.context
    return {
        "model": f"Qwen3.5 shapes, {args.layers} layers ({linear_layers} linear), random bfloat16 weights",
        **served,
        "cache_bytes_per_token_announced": cached,
        "cache_bytes_per_token_if_every_layer_attended": args.layers * kv_per_layer,
        "state_bytes_per_linear_layer": state_per_layer,
        "state_bytes_per_sequence": states,
        f"sessions_of_{context}_tokens_in_4GiB": {
            f"these_{args.layers}_layers": sessions_in(CACHE_BUDGET, cached, states, context),
            f"these_{args.layers}_layers_all_attention": sessions_in(
                CACHE_BUDGET, args.layers * kv_per_layer, 0, context
            ),
            f"real_{REAL_LAYERS}_layers": sessions_in(
                CACHE_BUDGET, real["per_token"], real["states"], context
            ),
            f"real_{REAL_LAYERS}_layers_all_attention": sessions_in(
                CACHE_BUDGET, REAL_LAYERS * kv_per_layer, 0, context
            ),
        },
        "torch_threads_per_process": 1,
    }


if __name__ == "__main__":
    main()
