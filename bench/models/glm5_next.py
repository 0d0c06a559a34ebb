"""GLM-5-Next at its real shapes: what a server caches per token and per session, and what it costs.

Builds GLM-5-Next's text model with the real layer shapes (hidden 4096; KDA linear attention of 64 heads
of 128; sparse latent attention of 64 heads, q_lora_rank 1536, kv_lora_rank 512, no rotary part, keys and
values of 256, an indexer of 32 heads of 128 ranking pools of 16 keys; 4 hyper-connection streams; dense
MLPs of 12288) but `--layers` layers in the real pattern (3 linear, then 1 sparse; all dense: a real MoE
layer's 288 experts would be 14 GB) and a small vocabulary, inside its multimodal wrapper with a tiny
vision tower, random bfloat16 weights, saved as a Hugging Face folder. Serves it on 2 servers of half the
layers each (bench/models/mla.py's measurement), then reports decode tokens/s against transformers on the same
folder, each server's RSS, the cache bytes per token per sparse layer the servers announce (latent and the
indexer's key, gate and flag) against expanded keys and values, the recurrent state a sequence keeps per
linear layer, and how many sessions of `--context` tokens a 4 GiB cache holds for the real 45 layers
(11 sparse, 34 linear; states charged twice, as the engine does). One torch thread per process. JSON out.

    python -m bench.models.glm5_next [--layers 4] [--new-tokens 8] [--context 4096]
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

TEXT = dict(
    hidden_size=4096,
    intermediate_size=12288,
    num_attention_heads=64,
    num_key_value_heads=64,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_rope_head_dim=0,
    qk_nope_head_dim=256,
    v_head_dim=256,
    index_n_heads=32,
    index_head_dim=128,
    index_kpool=16,
    index_topk=2048,
    linear_num_heads=64,
    linear_head_dim=128,
    hc_mult=4,
)
VISION = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=4096)
REAL_SPARSE, REAL_LINEAR = 11, 34


def save_model(folder: str, layers: int) -> None:
    from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration

    kinds = ["indexed_attention" if i % 4 == 3 else "linear_attention" for i in range(layers)]
    text = dict(
        **TEXT,
        num_hidden_layers=layers,
        layer_types=kinds,
        mlp_layer_types=["dense"] * layers,
        indexer_types=["full"] * layers,
        vocab_size=1024,
        eos_token_id=None,
        pad_token_id=0,
    )
    vision = dict(**VISION, projection_intermediate_size=64, image_size=28, patch_size=14)
    config = Glm5NextConfig(text_config=text, vision_config=vision)
    save_random(config, folder, Glm5NextForConditionalGeneration)


def main() -> None:
    args = parser(__doc__, shape_flags(layers=4, new_tokens=8)).parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="corolla-bench-glm5-next-") as folder:
        save_model(folder, args.layers)
        state = Span.load(folder, 0, 1, torch.bfloat16).state_bytes_per_row  # one linear layer
        # a sequence's recurrent states are charged as cache tokens: 4096 would not hold one
        announced, served = serve_and_measure(folder, args.layers, args.new_tokens, cache_tokens=65536)
    sparse_layers = sum(1 for i in range(args.layers) if i % 4 == 3)
    per_sparse = sum(a.info.cache_bytes_per_token for a in announced) // sparse_layers
    expanded = TEXT["num_attention_heads"] * (TEXT["qk_nope_head_dim"] + TEXT["v_head_dim"]) * 2  # bf16
    per_session = per_sparse * REAL_SPARSE * args.context + 2 * state * REAL_LINEAR
    expanded_session = expanded * (REAL_SPARSE + REAL_LINEAR) * args.context  # every layer attending
    result = {
        "model": f"GLM-5-Next shapes, {args.layers} dense layers (1 in 4 sparse), random bfloat16 weights",
        **served,
        "cache_bytes_per_token_per_sparse_layer": per_sparse,
        "expanded_kv_bytes_per_token_per_layer": expanded,
        "expanded_vs_cached": round(expanded / per_sparse, 1),
        "state_bytes_per_sequence_per_linear_layer": state,
        f"sessions_of_{args.context}_tokens_in_4GiB_real_45_layers": round(CACHE_BUDGET / per_session, 2),
        "same_if_every_layer_cached_expanded_kv": round(CACHE_BUDGET / expanded_session, 3),
        "torch_threads_per_process": 1,
    }
    report(__file__, result)


if __name__ == "__main__":
    main()
