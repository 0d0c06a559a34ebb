"""Tiny random-weight checkpoints of each supported family, saved the way users' models are saved."""

from __future__ import annotations

from pathlib import Path

import torch

COMMON = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    # a wide init makes logits peaked, so greedy decoding has no near-ties that float rounding could flip
    initializer_range=0.3,
)

LLAMA3_ROPE = dict(
    rope_type="llama3",
    rope_theta=10000.0,
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=64,
)
ALTERNATING = ["sliding_attention", "full_attention"] * 3
# multi-head latent attention (a 32-wide latent, rotary keys of 8) and MoE after a first dense block
LATENT_MOE = dict(
    num_key_value_heads=4,
    kv_lora_rank=32,
    q_lora_rank=48,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    moe_intermediate_size=32,
    n_routed_experts=4,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
)
# DeepSeek sparse attention: an indexer keeps 4 keys per query; 16 indexer heads, so that no two keys tie
# at a score of 0 (every head's ReLU'd score 0), which random weights with few heads often give
SPARSE = dict(index_topk=4, index_head_dim=16, index_n_heads=16)
# Gated DeltaNet linear attention (Qwen3.5, Qwen3-Next): a convolution and a recurrent state per layer
LINEAR = dict(
    linear_num_value_heads=4,
    linear_num_key_heads=2,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    head_dim=16,
    layer_types=["linear_attention", "linear_attention", "full_attention"] * 2,
)
COMPRESSED = ["heavily_compressed_attention", "compressed_sparse_attention"]  # DeepSeek-V4's
NO_ROTARY = "qk_rope_head_dim"  # GLM-5-Next's latent attention has no rotary part (0)
# family -> (config class, what sets the family apart), each exercising what its modeling code adds
LAYOUTS = {
    "llama": ("LlamaConfig", dict(tie_word_embeddings=True, rope_parameters=LLAMA3_ROPE)),
    "mistral": ("MistralConfig", dict(tie_word_embeddings=False, sliding_window=7)),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=False, use_sliding_window=False)),
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=5)),
    "qwen3": ("Qwen3Config", dict(head_dim=24, tie_word_embeddings=True)),  # q/k norms, head_dim != H / heads
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=48,
            mlp_only_layers=[0, 3],
            norm_topk_prob=True,
        ),
    ),
    "gemma2": (  # soft-capped attention and logits, alternating sliding/global layers, scaled embeddings
        "Gemma2Config",
        dict(
            head_dim=16,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=20.0,
            final_logit_softcapping=10.0,
            sliding_window=4,
            layer_types=ALTERNATING,
        ),
    ),
    "gemma3_text": (  # local and global rotary bases, q/k norms, sliding window pattern
        "Gemma3TextConfig",
        dict(
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=4,
            rope_local_base_freq=1000.0,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
        ),
    ),
    "phi3": ("Phi3Config", dict(tie_word_embeddings=False)),  # fused qkv and gate_up projections
    "olmo2": ("Olmo2Config", dict(tie_word_embeddings=False)),  # norms after attention and MLP, q/k norms
    "gpt_oss": (  # attention sinks, alternating sliding/global layers, its own fused experts
        "GptOssConfig",
        dict(num_local_experts=4, num_experts_per_tok=2, head_dim=16, sliding_window=4),
    ),
    "granite": (  # embedding, attention, residual and logit multipliers
        "GraniteConfig",
        dict(embedding_multiplier=6.0, attention_multiplier=0.2, residual_multiplier=0.5, logits_scaling=4.0),
    ),
    "deepseek_v3": (  # multi-head latent attention (a cached latent, expanded per head), grouped MoE routing
        "DeepseekV3Config",
        dict(**LATENT_MOE, n_shared_experts=1, n_group=2, topk_group=1),
    ),
    "minimax_m2": (  # MiniMax-M2: q/k norms over all heads, sigmoid-routed fused experts with a score bias
        "MiniMaxM2Config",
        dict(head_dim=16, num_local_experts=4, num_experts_per_tok=2),
    ),
    "mistral4": (  # latent attention and MoE; a causal LM transformers registers only behind its wrapper
        "Mistral4Config",
        dict(**LATENT_MOE, head_dim=24),
    ),
    "mistral_large4": (  # latent attention with an indexer (sparse), NoPE every 4th layer, learned rotary
        # scaling, soft-capped logits; its causal LM exists only in the multimodal wrapper (a tiny Pixtral)
        "MistralLarge4Config",
        dict(
            text_config=dict(**LATENT_MOE, **SPARSE, head_dim=8),
            vision_config=dict(
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=1,
                num_attention_heads=2,
                head_dim=16,
                image_size=32,
                patch_size=16,
            ),
        ),
    ),
    "hy_v4": (  # HY-V4: 4 hyper-connection streams between layers, sparse latent attention with learned
        # sinks, a last layer reusing the one before's selection
        "HYV4Config",
        dict(
            **{k: v for k, v in LATENT_MOE.items() if k != "first_k_dense_replace"},
            **SPARSE,
            n_shared_experts=1,
            hc_mult=4,
            mlp_layer_types=["dense"] + ["sparse"] * 5,
            indexer_types=["full"] * 5 + ["shared"],
        ),
    ),
    "glm5_next": (  # GLM-5-Next's text model: KDA linear attention 1:1 with sparse latent attention (no
        # rotary at all) whose indexer ranks pools of 2 keys plus the last incomplete pool, 4 hyper-connection
        # streams; its causal LM exists only in the multimodal wrapper (a tiny vision tower)
        "Glm5NextConfig",
        dict(
            text_config=dict(
                **{k: v for k, v in LATENT_MOE.items() if k not in ("first_k_dense_replace", NO_ROTARY)},
                **SPARSE,
                qk_rope_head_dim=0,
                index_kpool=2,
                n_shared_experts=1,
                hc_mult=4,
                linear_num_heads=4,
                linear_head_dim=16,
                layer_types=["linear_attention", "indexed_attention"] * 3,
                mlp_layer_types=["dense"] + ["sparse"] * 5,
                indexer_types=["full"] * 6,
            ),
            vision_config=dict(
                depth=1,
                hidden_size=32,
                num_heads=2,
                intermediate_size=64,
                out_hidden_size=64,
                projection_intermediate_size=64,
                image_size=28,
                patch_size=14,
            ),
        ),
    ),
    "deepseek_v32": (  # latent attention whose keys an indexer picks per query (DeepSeek sparse attention)
        "DeepseekV32Config",
        dict(**LATENT_MOE, **SPARSE, n_shared_experts=1, n_group=2, topk_group=1),
    ),
    "glm_moe_dsa": (  # GLM-5: the same sparse attention, its MoE router and layer layout
        "GlmMoeDsaConfig",
        dict(**LATENT_MOE, **SPARSE, n_shared_experts=1),
    ),
    "qwen3_5": ("Qwen3_5TextConfig", LINEAR),  # Qwen3.5's text model: linear attention 2:1 with full
    "qwen3_next": (  # linear attention and MoE with a shared expert
        "Qwen3NextConfig",
        dict(
            **LINEAR,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
        ),
    ),
    "kimi_linear": (  # Kimi Linear: KDA linear attention 2:1 with latent attention, MoE after a dense block
        "KimiLinearConfig",
        dict(
            num_key_value_heads=4,
            kv_lora_rank=32,
            q_lora_rank=None,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=16,
            head_dim=16,
            linear_head_dim=16,
            linear_num_heads=4,
            linear_conv_kernel_dim=4,
            num_experts=4,
            num_experts_per_token=2,
            moe_intermediate_size=32,
            num_shared_experts=1,
            layer_types=["linear_attention", "linear_attention", "full_attention"] * 2,
            mlp_layer_types=["dense"] + ["sparse"] * 5,
        ),
    ),
    "gemma4": (  # Gemma 4's text model: global layers with wider heads and keys as values, MoE beside the
        # MLP, and a last layer that attends with an earlier layer's keys and values (per-layer inputs off)
        "Gemma4TextConfig",
        dict(
            head_dim=16,
            global_head_dim=32,
            num_global_key_value_heads=1,
            attention_k_eq_v=True,
            sliding_window=4,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"]
            + ["sliding_attention", "full_attention", "full_attention"],
            num_kv_shared_layers=1,  # layer 5 reads layer 4's: blocks 4-5 are never split
            hidden_size_per_layer_input=0,
            enable_moe_block=True,
            num_experts=4,
            top_k_experts=2,
            moe_intermediate_size=32,
        ),
    ),
    "gemma3n": (  # Gemma 3n's text model: per-layer inputs, 4 parallel residual streams (AltUp), LAuReL,
        # sparse activations in the first MLPs, and a last layer that attends with an earlier layer's keys
        # and values
        "Gemma3nTextConfig",
        dict(
            head_dim=16,
            sliding_window=4,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"]
            + ["sliding_attention", "full_attention", "full_attention"],
            num_kv_shared_layers=1,  # layer 5 reads layer 4's: blocks 4-5 are never split
            hidden_size_per_layer_input=8,
            vocab_size_per_layer_input=320,
            laurel_rank=8,
            activation_sparsity_pattern=[0.95, 0.95, 0.0, 0.0, 0.0, 0.0],
        ),
    ),
    "llama4": (  # Llama 4's text model: chunked attention with rotary, and every third layer global without
        # it, its queries scaled by position (from 4 on here, 8,192 in the real models); MoE every other layer
        "Llama4TextConfig",
        dict(
            head_dim=16,
            attention_chunk_size=4,
            no_rope_layers=[1, 1, 0, 1, 1, 0],
            floor_scale=4,
            attn_scale=0.5,
            intermediate_size_mlp=128,
            num_local_experts=4,
            num_experts_per_tok=1,
            interleave_moe_layer_step=2,
        ),
    ),
    "longcat_flash": (  # LongCat-Flash: each layer two latent-attention sublayers (a cache each) and a MoE
        # with zero (identity) experts whose output skips to the layer's end; 6 layers of 12 sublayers
        "LongcatFlashConfig",
        dict(
            num_hidden_layers=12,
            kv_lora_rank=32,
            q_lora_rank=48,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=16,
            head_dim=8,
            num_key_value_heads=4,
            ffn_hidden_size=128,
            expert_ffn_hidden_size=32,
            n_routed_experts=4,
            zero_expert_num=2,
            moe_topk=2,
        ),
    ),
    "lfm2": ("Lfm2Config", dict(layer_types=["conv", "conv", "full_attention"] * 2, conv_L_cache=3)),
    "granite_swa": (  # sliding and global layers with a rotary base each, one global layer without rotary
        # (theta 0): its forward picks each layer's from a list of rotary embeddings
        "GraniteSWAConfig",
        dict(
            layer_types=["full_attention", "sliding_attention", "sliding_attention"] * 2,
            layer_rope_theta=[0.0, 10000.0, 10000.0, 500000.0, 10000.0, 10000.0],
            sliding_window=4,
            # its reference attention is eager (no SDPA), which rounds otherwise than corolla's; activations
            # grown to 100 by the wide init made that 2e-4
            initializer_range=0.1,
        ),
    ),
    "lfm3": (  # convolutions, full and sliding attention; its rotary computes only the attention types
        "Lfm3Config",
        dict(
            layer_types=["conv", "full_attention", "conv", "sliding_attention", "conv", "full_attention"],
            sliding_window=4,
            head_dim=16,
        ),
    ),
    "lara_mini": (  # Gated DeltaNet, sliding and global attention, MoE; its decoder's forward hands position
        # embeddings to the sliding layers only (its global layers have none)
        "LaraMiniConfig",
        dict(
            layer_types=["linear_attention", "sliding_attention", "full_attention"] * 2,
            sliding_window=4,
            head_dim=16,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
        ),
    ),
    "lfm2_moe": (  # LFM2's convolutions and attention with MoE after a dense block; its rotary is `pos_emb`
        "Lfm2MoeConfig",
        dict(
            layer_types=["conv", "conv", "full_attention"] * 2,
            conv_L_cache=3,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            num_dense_layers=1,
        ),
    ),
    "jamba": (  # Mamba layers (no position embeddings at all), attention every third layer, MoE
        "JambaConfig",
        dict(
            attn_layer_period=3,
            attn_layer_offset=2,
            expert_layer_period=2,
            expert_layer_offset=1,
            num_experts=4,
            num_experts_per_tok=2,
            mamba_d_state=8,
            mamba_d_conv=4,
            mamba_dt_rank=8,
        ),
    ),
    "zaya": (  # attention whose queries and keys are convolved and half its values delayed (a state),
        # sliding in every other layer, routers that add the previous layer's router state (handed on)
        "ZayaConfig",
        dict(
            layer_types=["hybrid", "hybrid_sliding"] * 3,
            sliding_window=4,
            head_dim=16,
            num_experts=4,
            num_experts_per_tok=1,
            moe_intermediate_size=32,
            router_hidden_size=16,
        ),
    ),
    "deepseek_v4": (  # compressed sparse (CSA, an indexer's top 3 of entries every 2 tokens), heavily
        # compressed (HCA: every 4) and sliding attention (window 8) with K = V and sinks, hyper-connection
        # streams, hash-routed experts picked by the token ids in the first 3 layers
        "DeepseekV4Config",
        dict(
            layer_types=["heavily_compressed_attention", "compressed_sparse_attention", "sliding_attention"]
            * 2,
            compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
            sliding_window=8,
            num_key_value_heads=1,
            head_dim=32,
            q_lora_rank=32,
            o_groups=2,
            o_lora_rank=16,
            index_n_heads=8,
            index_head_dim=16,
            index_topk=3,
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            hc_mult=2,
        ),
    ),
    "zamba2": (  # Mamba-2 layers, and hybrids whose shared attention blocks (2, each tied across layers,
        # with per-layer adapters) read the embeddings' output beside the hidden states
        "Zamba2Config",
        dict(
            layers_block_type=["mamba", "hybrid"] * 3,
            num_mem_blocks=2,
            use_shared_attention_adapter=True,
            adapter_rank=8,
            use_mem_rope=True,
            mamba_d_state=8,
            n_mamba_heads=4,
            chunk_size=8,
            num_key_value_heads=4,
            # transformers' Mamba-2 clamps its step size from below at time_step_min in its multi-token
            # form only (Nemotron-H too): a floor no step reaches keeps both forms the same computation
            time_step_min=1e-9,
            time_step_floor=1e-9,
        ),
    ),
    "falcon_h1": (  # every layer a hybrid: attention and a Mamba-2 mixer side by side, muP multipliers
        "FalconH1Config",
        dict(
            head_dim=16,
            mamba_d_ssm=64,
            mamba_n_heads=4,
            mamba_n_groups=1,
            mamba_d_state=8,
            mamba_d_conv=4,
            mamba_chunk_size=8,
            attention_in_multiplier=0.8,
            ssm_out_multiplier=1.2,
            embedding_multiplier=2.0,
        ),
    ),
    "nemotron_h": (  # Mamba-2 layers, attention, and layers that are an MLP or MoE alone
        "NemotronHConfig",
        dict(
            layers_block_type=["mamba", "mlp", "attention", "mamba", "moe", "attention"],
            mamba_num_heads=4,
            mamba_head_dim=16,
            ssm_state_size=8,
            n_groups=2,
            head_dim=16,
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            moe_shared_expert_intermediate_size=32,
        ),
    ),
}
FAMILIES = tuple(LAYOUTS)
MTP_FAMILIES = ("deepseek_v3",)  # saved with a multi-token prediction layer (save_tiny_mtp_model)
# families with layers that keep a recurrent state instead of keys and values (models/recurrent.py)
RECURRENT = (
    "qwen3_5",
    "qwen3_next",
    "kimi_linear",
    "lfm2",
    "lfm2_moe",
    "lfm3",
    "lara_mini",
    "jamba",
    "nemotron_h",
    "falcon_h1",
    "zaya",
    "zamba2",
    "deepseek_v4",  # its attention's own cache layers, kept per sequence like a state
)
# families whose checkpoint-set constants (transformers initializes them to zeros) are drawn at random: the
# other families' tiny checkpoints (and the tokens tests expect of them) stay as they were
DRAWN = ("deepseek_v4",)
LLAMA_LIKE = ("llama", "mistral", "qwen2")  # the families of the training, adapter and routing tests


def tiny_config(family: str, **changes):
    """The family's tiny config; `changes`: config fields to set besides (a variant of the layout)."""
    import transformers

    class_name, extra = LAYOUTS[family]
    if "text_config" in changes:  # a multimodal wrapper's language model: changed field by field
        changes = {**changes, "text_config": {**extra["text_config"], **changes["text_config"]}}
    extra = {**extra, **changes}
    if "text_config" in extra:  # a multimodal wrapper: the common shapes are its language model's
        text = {**COMMON, **extra["text_config"]}
        return getattr(transformers, class_name)(**{**extra, "text_config": text})
    return getattr(transformers, class_name)(**{**COMMON, **extra})


def save_tiny_model(
    family: str, path: Path, *, seed: int = 0, max_shard_size: str | None = None, **changes
) -> Path:
    from corolla.models.lm_class import lm_class

    torch.manual_seed(seed)
    config = tiny_config(family, **changes)
    model_class = lm_class(config.get_text_config(), config)  # transformers' own class
    model = model_class._from_config(config, dtype=torch.float32)
    if family in DRAWN:
        _draw_constants(model)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    return path


def _draw_constants(model) -> None:
    """Random values where transformers initializes to a constant what a checkpoint's training sets
    (DeepSeek-V4's token-to-expert table, attention sinks, compressors' position biases), so that
    what depends on them is tested."""
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, tensor in [*model.named_buffers(), *model.named_parameters()]:
            if name.endswith("tid2eid"):
                tensor.copy_(
                    torch.randint(0, model.config.n_routed_experts, tensor.shape, generator=generator)
                )
            elif name.endswith(("self_attn.sinks", "position_bias")):
                tensor.copy_(torch.randn(tensor.shape, generator=generator))


def save_tiny_mtp_model(family: str, path: Path, *, seed: int = 0, **changes) -> Path:
    """A tiny checkpoint with one multi-token prediction layer stored as DeepSeek-V3 and GLM-4.5 store it:
    block N's tensors (N = num_hidden_layers) and the layer's own (enorm, hnorm, eh_proj, shared_head.norm),
    which transformers leaves out when it loads the model."""
    import json

    from safetensors.torch import load_file, save_file

    blocks = tiny_config(family, **changes).num_hidden_layers
    save_tiny_model(family, path, seed=seed, num_hidden_layers=blocks + 1, num_mtp_layers=1, **changes)
    (file,) = path.glob("*.safetensors")
    tensors = load_file(file)
    width = tiny_config(family).hidden_size
    generator = torch.Generator().manual_seed(seed + 1)
    layer = f"model.layers.{blocks}."
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        tensors[f"{layer}{norm}.weight"] = 1 + 0.1 * torch.randn(width, generator=generator)
    tensors[f"{layer}eh_proj.weight"] = 0.3 * torch.randn(width, 2 * width, generator=generator)
    save_file(tensors, file, metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": blocks}, indent=2))
    return path


def load_mtp_reference(path: Path):
    """transformers' own model and MTP layers of a `save_tiny_mtp_model` checkpoint (transformers finds a
    real checkpoint's MTP tensors by the real model's block count; a tiny one's are named here)."""
    from transformers.modeling_layers import MtpModel

    reference = load_reference(path)
    blocks = reference.config.num_hidden_layers
    reference._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{blocks}\..*"]
    return reference, MtpModel.from_pretrained(reference).eval()


def load_reference(path: Path):
    from transformers import AutoConfig

    from corolla.models.lm_class import lm_class

    config = AutoConfig.from_pretrained(path)
    causal_lm = lm_class(config.get_text_config(), config)  # Mistral 4's is not in the auto mapping
    try:
        model = causal_lm.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    except ValueError:  # families without an SDPA implementation (Gemma 2's soft-capping)
        model = causal_lm.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    if getattr(model.config, "num_kv_shared_layers", 0) and not model.config.hidden_size_per_layer_input:
        # transformers' shortcut through Gemma's reusing layers (only the kept logits' tokens) indexes
        # per-layer inputs, which this tiny layout has none of; recording hidden states turns it off,
        # leaving the plain computation of every token
        model.config.output_hidden_states = True
    return model.eval()


def hidden_states(reference, ids: torch.Tensor) -> list[torch.Tensor]:
    """transformers' hidden states of ids [B, T] at every block boundary (the last one after the final
    norm, as transformers gives it)."""
    with torch.no_grad():
        return list(reference(ids, output_hidden_states=True).hidden_states)
