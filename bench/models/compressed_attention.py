"""DeepSeek-V4's compressed attention at its real shapes: what a session's cache takes, and what it costs.

Builds a DeepSeek-V4 config with the real model's attention shapes (hidden 4096, 64 query heads of 512
sharing one key-and-value head, q_lora_rank 1024, grouped output projection 8 x 1024, a window of 128,
CSA every 4 tokens with a 64-head indexer of 128 keeping the top 512, HCA every 128, 4 hyper-connection
streams) but `--layers` layers alternating HCA and CSA as the real model does, small MoE layers (8
experts of 256: a real layer's 256 experts of 2048 would be 13 GB) and a small vocabulary, random weights
in bfloat16. Then:
- the cache: a session of `--context` - 1 tokens (fed in chunks of 512), and of 1,024 more, through
  transformers' own model with its own DynamicCache, and through corolla's span with the cache layers it
  keeps per session: bytes held by each at both lengths, the bytes a token adds (the difference, over
  1,024 tokens; both lengths leave every compressor's buffer full) and what corolla charges a session
  (its fixed part, the window and full buffers, and its bytes per token); then for the real model's 43
  layers, sessions of 4,096 and 65,536 tokens in 4 GiB, against DeepSeek-V3's latent cache (576 values a
  token a layer, 61 layers);
- decoding: 2 servers of half the layers each, one greedy session (a 16-token prompt, `--new-tokens`),
  against transformers running the same folder in this process, and each server's RSS.
One torch thread per process. JSON on stdout.

    python -m bench.models.compressed_attention [--layers 4] [--new-tokens 16] [--context 4096]
"""

from __future__ import annotations

import os
import tempfile

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch: one thread here and in every server

import torch

from bench.lib.checkpoints import save_random
from bench.lib.env import parser, shape_flags
from bench.lib.stamp import report
from bench.models.mla import serve_and_measure
from corolla.models.compressed_sizes import held_bytes
from corolla.models.contiguous import ContiguousCache
from corolla.models.layer_caches import hold
from corolla.models.span import Span

REAL = dict(
    hidden_size=4096,
    num_attention_heads=64,
    num_key_value_heads=1,
    head_dim=512,
    q_lora_rank=1024,
    o_groups=8,
    o_lora_rank=1024,
    sliding_window=128,
    index_n_heads=64,
    index_head_dim=128,
    index_topk=512,
    hc_mult=4,
)
SMALL_MOE = dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=256, vocab_size=1024)
REAL_LAYERS = 43
MORE = 1024  # tokens between the two measured lengths (a multiple of every compression rate)
CHUNK = 512
CACHE_BUDGET = 4 * 2**30
V3_LATENT_BYTES = (512 + 64) * 2 * 61  # DeepSeek-V3: a latent and a rotary key a token, 61 layers, bfloat16


def config(layers: int):
    from transformers import DeepseekV4Config

    kinds = ["heavily_compressed_attention", "compressed_sparse_attention"] * layers
    return DeepseekV4Config(**REAL, **SMALL_MOE, num_hidden_layers=layers, layer_types=kinds[:layers])


def transformers_bytes(folder: str, ids: torch.Tensor, lengths: list[int]) -> list[int]:
    """What transformers' own model keeps in its DynamicCache after each of `lengths` tokens of ids."""
    from transformers import DeepseekV4ForCausalLM, DynamicCache

    model = DeepseekV4ForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    cache = DynamicCache(config=model.config)
    held = []
    with torch.no_grad():
        for start, end in _chunks(lengths):
            model(ids[:, start:end], cache=cache, use_cache=True)
            if end in lengths:
                held.append(sum(hold(layer).nbytes for layer in cache.layers))
    return held


def corolla_bytes(folder: str, ids: torch.Tensor, lengths: list[int], layers: int) -> tuple[list[int], Span]:
    """What a span of every layer keeps for one session (models/layer_caches.py) after each length."""
    from corolla.models.head import ModelHead

    head, span = ModelHead.load(folder, torch.bfloat16), Span.load(folder, 0, layers, torch.bfloat16)
    cache = ContiguousCache.for_span(span, 1, max(lengths))
    held = []
    with torch.no_grad():
        for start, end in _chunks(lengths):
            span(head.embed(ids[:, start:end]), cache, position=start)
            cache.position = end
            if end in lengths:
                held.append(sum(hold(layer).nbytes for layer in cache.held_layers.values()))
    return held, span


def _chunks(lengths: list[int]) -> list[tuple[int, int]]:
    bounds = sorted({*range(0, max(lengths), CHUNK), *lengths, max(lengths)})
    return list(zip(bounds, bounds[1:], strict=False))


def real_model(context: int) -> dict:
    """A session of `context` tokens over the real model's 43 layers: bytes, and sessions in 4 GiB."""
    real = __import__("transformers").DeepseekV4Config()
    per_layer = [held_bytes(real, layer, 2) for layer in range(REAL_LAYERS)]
    session = sum(fixed + per_token * context for fixed, per_token in per_layer)
    return {
        "session_mb": round(session / 1e6, 1),
        "bytes_per_token": round(session / context),
        "sessions_in_4GiB": round(CACHE_BUDGET / session, 1),
        "sessions_in_4GiB_deepseek_v3_latent": round(CACHE_BUDGET / (V3_LATENT_BYTES * context), 1),
    }


def main() -> None:
    args = parser(__doc__, shape_flags(layers=4, new_tokens=16)).parse_args()
    torch.set_num_threads(1)
    # one token short of a multiple of 128: every compressor's buffer full, the most a session keeps
    lengths = [args.context - 1, args.context - 1 + MORE]
    ids = torch.randint(3, 1000, (1, lengths[-1]), generator=torch.Generator().manual_seed(1))
    with tempfile.TemporaryDirectory(prefix="corolla-bench-v4-") as folder:
        save_random(config(args.layers), folder)
        own = transformers_bytes(folder, ids, lengths)
        kept, span = corolla_bytes(folder, ids, lengths, args.layers)
        charged = [span.state_bytes_per_row + span.cache_bytes_per_token * n for n in lengths]
        # a token's cache is small beside a session's window and buffers: a cache of many tokens
        _, served = serve_and_measure(folder, args.layers, args.new_tokens, cache_tokens=2**18)
    result = {
        "model": f"DeepSeek-V4 attention shapes, {args.layers} layers (HCA, CSA, ...), small MoE, bfloat16",
        "cache": {
            "lengths": lengths,
            "transformers_bytes": own,
            "corolla_bytes": kept,
            "corolla_vs_transformers": [round(k / o, 4) for k, o in zip(kept, own, strict=True)],
            "bytes_per_token_transformers": round((own[1] - own[0]) / MORE, 1),
            "bytes_per_token_corolla_charges": span.cache_bytes_per_token,
            "fixed_bytes_corolla_charges": span.state_bytes_per_row,
            "charged_vs_transformers": [round(c / o, 4) for c, o in zip(charged, own, strict=True)],
        },
        "real_43_layers": {f"context_{n}": real_model(n) for n in (4096, 65536)},
        **served,
        "torch_threads_per_process": 1,
    }
    report(__file__, result)


if __name__ == "__main__":
    main()
