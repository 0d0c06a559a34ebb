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

    python bench/mla.py [--layers 4] [--new-tokens 16] [--context 4096]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import psutil
import torch

from corolla.client.model import DistributedModelForCausalLM
from corolla.launch.local import LocalSwarm
from stamp import report  # bench/stamp.py: stamped into bench/results/

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
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    config = DeepseekV3Config(
        **REAL, num_hidden_layers=layers, first_k_dense_replace=layers, vocab_size=1024, eos_token_id=None
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder)


def decode_rate(generate, ids: torch.Tensor, new_tokens: int) -> float:
    stamps: list[float] = []
    generate(ids, new_tokens, lambda *_: stamps.append(time.perf_counter()))
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def local_rate(folder: str, ids: torch.Tensor, new_tokens: int) -> float:
    from transformers import AutoConfig

    from corolla.models.lm_class import lm_class

    config = AutoConfig.from_pretrained(folder)  # a multimodal wrapper's causal LM too (GLM-5-Next)
    model = lm_class(config.get_text_config(), config).from_pretrained(folder, dtype=torch.bfloat16).eval()

    class Streamer:  # transformers' streamer protocol: the first put carries the prompt
        def __init__(self, stamp):
            self.stamp = stamp
            self.prompt_seen = False

        def put(self, value):
            if self.prompt_seen:
                self.stamp()
            self.prompt_seen = True

        def end(self):
            pass

    def generate(ids, count, stamp):
        with torch.no_grad():
            model.generate(
                ids, do_sample=False, max_new_tokens=count, min_new_tokens=count, streamer=Streamer(stamp)
            )

    generate(ids, 2, lambda *_: None)  # warm-up
    return decode_rate(generate, ids, new_tokens)


def serve_and_measure(folder: str, layers: int, ids: torch.Tensor, new_tokens: int, cache_tokens: int = 4096):
    """The saved model on 2 servers of half its layers each (bfloat16, `cache_tokens` cache tokens): each
    server's RSS, the swarm's decode tokens/s, the servers' announced records; then transformers' decode
    tokens/s on the same folder in this process."""
    half = layers // 2
    server_args = ["--dtype", "bfloat16", "--max-cache-tokens", str(cache_tokens)]
    with LocalSwarm(folder, [(0, half), (half, layers)], server_args=server_args) as swarm:
        rss = [psutil.Process(server.pid).memory_info().rss for server in swarm.servers]
        config = swarm.client_config(dtype="bfloat16")
        with DistributedModelForCausalLM.from_pretrained(folder, config=config) as model:

            def generate(ids, count, stamp):
                model.generate(ids, max_new_tokens=count, ignore_eos=True, streamer=stamp)

            generate(ids, 2, lambda *_: None)  # warm-up
            swarm_rate = decode_rate(generate, ids, new_tokens)
            announced = model.runtime.run(model.client.swarm.view.refresh())
    return rss, swarm_rate, announced, local_rate(folder, ids, new_tokens)


def sessions_in(budget: int, bytes_per_token_per_layer: int, layers: int, context: int) -> float:
    return round(budget / (bytes_per_token_per_layer * layers * context), 2)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--context", type=int, default=4096)
    args = parser.parse_args()
    torch.set_num_threads(1)
    ids = torch.randint(3, 1000, (1, 16), generator=torch.Generator().manual_seed(0))
    with tempfile.TemporaryDirectory(prefix="corolla-bench-mla-") as folder:
        save_model(folder, args.layers)
        rss, swarm_rate, announced, local = serve_and_measure(folder, args.layers, ids, args.new_tokens)
    per_layer = announced[0].info.cache_bytes_per_token // (announced[0].end - announced[0].start)
    qk_head = REAL["qk_nope_head_dim"] + REAL["qk_rope_head_dim"]
    expanded = REAL["num_attention_heads"] * (qk_head + REAL["v_head_dim"]) * 2  # bfloat16
    result = {
        "model": f"DeepSeek-V3 shapes, {args.layers} dense layers, random bfloat16 weights",
        "servers": [f"{s.start}:{s.end}" for s in announced],
        "decode_tokens_per_s": {"swarm": round(swarm_rate, 3), "local_transformers": round(local, 3)},
        "swarm_vs_local": round(swarm_rate / local, 3),
        "server_rss_gb": [round(r / 1e9, 2) for r in rss],
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
