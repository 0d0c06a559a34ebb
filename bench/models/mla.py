"""Multi-head latent attention at DeepSeek-V3's real shapes: what a server caches, and what it costs.

Builds a DeepSeek-V3 config with the real model's attention and MLP shapes (hidden 7168, 128 heads,
q_lora_rank 1536, kv_lora_rank 512, rotary key 64, value heads of 128, dense MLPs of 18432) but
`--layers` layers (all dense: a real MoE layer's 256 experts would be 45 GB) and a small vocabulary,
with random weights in bfloat16, saved as a Hugging Face folder. Serves it on 2 servers of half the
layers each, then reports: decode tokens/s of one greedy session (a 16-token prompt, `--new-tokens`
new tokens) against transformers running the same folder in this process, each server's RSS, the cache
bytes per token the servers announce against what expanded keys and values would take, and how many
sessions of `--context` tokens a 4 GiB cache holds either way, for these layers and for the real model's 61.
One torch thread per process. JSON on stdout.

    python -m bench.models.mla [--layers 4] [--new-tokens 16] [--context 4096]
"""

from __future__ import annotations

import os
import tempfile

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch: one thread here and in every server

import psutil
import torch

from bench.lib.checkpoints import save_random
from bench.lib.env import parser, shape_flags
from bench.lib.stamp import report
from bench.lib.timing import Stamps, decode_rate
from corolla.client.model import DistributedModelForCausalLM
from corolla.launch.local import LocalSwarm

REAL = dict(
    hidden_size=7168,
    intermediate_size=18432,
    num_attention_heads=128,
    num_key_value_heads=128,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    qk_nope_head_dim=128,
    v_head_dim=128,
    moe_intermediate_size=2048,
    n_routed_experts=256,
    num_experts_per_tok=8,
)
REAL_LAYERS = 61
CACHE_BUDGET = 4 * 2**30


def save_model(folder: str, layers: int) -> None:
    from transformers import DeepseekV3Config

    config = DeepseekV3Config(
        **REAL, num_hidden_layers=layers, first_k_dense_replace=layers, vocab_size=1024, eos_token_id=None
    )
    save_random(config, folder)


def local_rate(folder: str, ids: torch.Tensor, new_tokens: int) -> float:
    from transformers import AutoConfig

    from corolla.models.lm_class import lm_class

    config = AutoConfig.from_pretrained(folder)  # a multimodal wrapper's causal LM too (GLM-5-Next)
    model = lm_class(config.get_text_config(), config).from_pretrained(folder, dtype=torch.bfloat16).eval()

    def generate(count: int) -> list[float]:
        stamps = Stamps()
        with torch.no_grad():
            model.generate(ids, do_sample=False, max_new_tokens=count, min_new_tokens=count, streamer=stamps)
        return stamps.times

    generate(2)  # warm-up
    return decode_rate(generate(new_tokens))


def serve_and_measure(folder: str, layers: int, new_tokens: int, cache_tokens: int = 4096) -> tuple:
    """The saved model on 2 servers of half its layers each (bfloat16, `cache_tokens` cache tokens), a fixed
    16-token prompt decoded greedily: (the servers' announced records, a result's figures: the servers, the
    swarm's decode tokens/s against transformers' on the same folder in this process, each server's RSS)."""
    ids = torch.randint(3, 1000, (1, 16), generator=torch.Generator().manual_seed(0))
    half = layers // 2
    server_args = ["--dtype", "bfloat16", "--max-cache-tokens", str(cache_tokens)]
    with LocalSwarm(folder, [(0, half), (half, layers)], server_args=server_args) as swarm:
        rss = [psutil.Process(server.pid).memory_info().rss for server in swarm.servers]
        config = swarm.client_config(dtype="bfloat16")
        with DistributedModelForCausalLM.from_pretrained(folder, config=config) as model:

            def generate(count: int) -> list[float]:
                stamps = Stamps()
                model.generate(ids, max_new_tokens=count, ignore_eos=True, streamer=stamps.stamp)
                return stamps.times

            generate(2)  # warm-up
            swarm_rate = decode_rate(generate(new_tokens))
            announced = model.runtime.run(model.client.swarm.view.refresh())
    local = local_rate(folder, ids, new_tokens)
    return announced, {
        "servers": [f"{s.start}:{s.end}" for s in announced],
        "decode_tokens_per_s": {"swarm": round(swarm_rate, 3), "local_transformers": round(local, 3)},
        "swarm_vs_local": round(swarm_rate / local, 3),
        "server_rss_gb": [round(r / 1e9, 2) for r in rss],
    }


def sessions_in(budget: int, bytes_per_token_per_layer: int, layers: int, context: int) -> float:
    return round(budget / (bytes_per_token_per_layer * layers * context), 2)


def main() -> None:
    args = parser(__doc__, shape_flags(layers=4, new_tokens=16)).parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="corolla-bench-mla-") as folder:
        save_model(folder, args.layers)
        announced, served = serve_and_measure(folder, args.layers, args.new_tokens)
    per_layer = announced[0].info.cache_bytes_per_token // (announced[0].end - announced[0].start)
    qk_head = REAL["qk_nope_head_dim"] + REAL["qk_rope_head_dim"]
    expanded = REAL["num_attention_heads"] * (qk_head + REAL["v_head_dim"]) * 2  # bfloat16
    result = {
        "model": f"DeepSeek-V3 shapes, {args.layers} dense layers, random bfloat16 weights",
        **served,
        "cache_bytes_per_token_per_layer": per_layer,
        "expanded_kv_bytes_per_token_per_layer": expanded,
        "expanded_vs_cached": round(expanded / per_layer, 1),
        f"sessions_of_{args.context}_tokens_in_4GiB": {
            f"these_{args.layers}_layers": sessions_in(CACHE_BUDGET, per_layer, args.layers, args.context),
            f"these_{args.layers}_layers_expanded": sessions_in(
                CACHE_BUDGET, expanded, args.layers, args.context
            ),
            "real_61_layers": sessions_in(CACHE_BUDGET, per_layer, REAL_LAYERS, args.context),
            "real_61_layers_expanded": sessions_in(CACHE_BUDGET, expanded, REAL_LAYERS, args.context),
        },
        "torch_threads_per_process": 1,
    }
    report(__file__, result)


if __name__ == "__main__":
    main()
