import json
from pathlib import Path

import pytest
import torch

from corolla.errors import InvalidRequest, UnsupportedModel
from corolla.models.attention import CacheShape
from corolla.models.head import ModelHead
from corolla.models.model_config import ModelConfig
from corolla.models.source import dht_prefix_for, resolve_model
from corolla.models.span import Span
from tiny_models import load_reference, save_tiny_model


def test_sharded_checkpoint_reads_only_the_blocks_asked_for(tmp_path, monkeypatch):
    path = save_tiny_model("qwen2", tmp_path / "sharded", max_shard_size="60KB")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 3  # really sharded
    opened = []
    import corolla.models.checkpoint as checkpoint_module

    real_open = checkpoint_module.safe_open
    monkeypatch.setattr(
        checkpoint_module, "safe_open", lambda file, **kw: opened.append(file.name) or real_open(file, **kw)
    )
    span = Span.load(path, 4, 6)
    block_files = {
        index["weight_map"][k]
        for k in index["weight_map"]
        if k.startswith(("model.layers.4.", "model.layers.5."))
    }
    assert set(opened) == block_files
    reference = load_reference(path)
    hidden = torch.randn(1, 4, 64)
    with torch.no_grad():
        expected = reference.model.layers[5](
            reference.model.layers[4](
                hidden, position_embeddings=reference.model.rotary_emb(hidden, torch.arange(4)[None])
            ),
            position_embeddings=reference.model.rotary_emb(hidden, torch.arange(4)[None]),
        )
    torch.testing.assert_close(span(hidden), expected, atol=1e-5, rtol=0)


def test_head_reads_no_block_and_ties_embeddings(tiny_models, monkeypatch):
    import corolla.models.checkpoint as checkpoint_module

    read = []
    real_read = checkpoint_module.Checkpoint.read
    monkeypatch.setattr(
        checkpoint_module.Checkpoint,
        "read",
        lambda self, names, *a, **k: read.extend(names) or real_read(self, names, *a, **k),
    )
    head = ModelHead.load(tiny_models["llama"])
    assert set(read) == {"model.embed_tokens.weight", "model.norm.weight"}
    assert head.lm_head.weight is head.embed_tokens.weight
    untied = ModelHead.load(tiny_models["mistral"])
    assert untied.lm_head.weight is not untied.embed_tokens.weight
    assert not [name for name, _ in untied.named_parameters() if "layers" in name]


def test_config_fields_come_from_transformers(tiny_models):
    llama = ModelConfig.from_folder(tiny_models["llama"])
    assert (llama.hf.rope_parameters["rope_type"], llama.tie_word_embeddings) == ("llama3", True)
    assert (llama.num_key_value_heads, llama.head_dim, llama.eos_token_ids) == (2, 16, (2,))
    mistral = ModelConfig.from_folder(tiny_models["mistral"])
    assert (mistral.hf.sliding_window, mistral.layer_types) == (7, ("full_attention",) * 6)


def test_unsupported_models_get_errors_naming_the_type():
    base = dict(
        model_type="llama",
        vocab_size=10,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
    )
    assert ModelConfig.from_dict(base).num_key_value_heads == 2
    with pytest.raises(UnsupportedModel, match="model_type 't5' is not a decoder-only causal LM"):
        ModelConfig.from_dict({**base, "model_type": "t5"})
    with pytest.raises(UnsupportedModel, match="model_type 'vit' is not a decoder-only causal LM"):
        ModelConfig.from_dict({**base, "model_type": "vit"})
    with pytest.raises(UnsupportedModel, match="model_type 'no-such' is not one transformers knows"):
        ModelConfig.from_dict({**base, "model_type": "no-such"})
    with pytest.raises(UnsupportedModel, match="config.json of a llama model is invalid"):
        ModelConfig.from_dict({**base, "hidden_size": 9})
    from transformers import AutoConfig

    # layers reusing an earlier layer's sparse-attention selection: served, never cut from it
    shared = AutoConfig.for_model("glm_moe_dsa", indexer_types=["full", "shared"] * 39)
    assert ModelConfig.from_hf(shared).kv_sharing.forbidden_cuts == frozenset(range(1, 78, 2))
    sharing = dict(num_hidden_layers=4, kv_source_layers=[0, 0, 2, 2])  # layers 1 and 3 rank keys themselves
    with pytest.raises(UnsupportedModel, match="mistral_large4_text: some layers attend with an earlier"):
        ModelConfig.from_hf(AutoConfig.for_model("mistral_large4", text_config=sharing))
    with pytest.raises(UnsupportedModel, match="layer types \\['window_attention'\\] are not supported"):
        ModelConfig.from_dict({**base, "layer_types": ["window_attention", "full_attention"]})


@pytest.mark.parametrize(
    ("model_type", "refusal"),
    [
        (  # a wrapper-only text model corolla has not checked against its wrapper
            "glm4v",
            r"'glm4v_text' is not a decoder-only causal LM \(transformers defines no \.\.\.ForCausalLM for "
            r"it; of such multimodal models corolla serves mistral_large4, glm5_next, qwen2_5_vl, qwen3_vl\)",
        ),
    ],
)
def test_this_years_families_that_cannot_be_served_are_refused_in_one_line(model_type, refusal):
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type)  # transformers' own defaults: the real model's shapes
    with pytest.raises(UnsupportedModel, match=refusal) as refused:
        ModelConfig.from_hf(config)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize(
    ("model_type", "served_as"),
    [
        ("kimi_k25", "deepseek_v3"),  # a multimodal wrapper of DeepSeek-V3's text model
        ("mistral4", "mistral4"),  # its causal LM is not in transformers' auto mapping
        ("qwen3_5", "qwen3_5_text"),  # Gated DeltaNet linear attention, 3:1 with full attention
        ("qwen3_5_moe", "qwen3_5_moe_text"),
        ("qwen3_next", "qwen3_next"),
        ("kimi_linear", "kimi_linear"),
        ("lfm3", "lfm3"),  # short convolutions, full and sliding attention
        ("deepseek_v32", "deepseek_v32"),  # latent attention whose keys an indexer picks (sparse)
        ("glm_moe_dsa", "glm_moe_dsa"),  # GLM-5: the same, each layer with its own indexer
        ("mistral_large4", "mistral_large4_text"),  # its causal LM only in the multimodal wrapper
        ("falcon_h1", "falcon_h1"),  # attention and Mamba side by side in every layer
        ("qwen3_vl", "qwen3_vl_text"),  # causal LMs only in their multimodal wrappers (text, M-RoPE)
        ("qwen2_5_vl", "qwen2_5_vl_text"),
        ("gemma4_unified", "gemma4_unified_text"),  # Gemma 4's shapes per layer type
        ("gemma4", "gemma4_text"),  # E2B/E4B's layout: per-layer inputs beside the hidden states
        ("gemma3n", "gemma3n_text"),  # per-layer inputs and 4 parallel streams (AltUp)
        ("hy_v4", "hy_v4"),  # 4 hyper-connection streams, sparse latent attention
        ("glm5_next", "glm5_next_text"),  # KDA linear attention, pooled sparse attention, hyper-connections
        ("llama4", "llama4_text"),  # chunked attention, NoPE layers scaled by position
        ("lfm2_moe", "lfm2_moe"),  # short convolutions, attention, MoE
    ],
)
def test_this_years_latent_and_linear_attention_families_are_accepted(model_type, served_as):
    from transformers import AutoConfig

    assert ModelConfig.from_hf(AutoConfig.for_model(model_type)).model_type == served_as


def test_what_travels_between_spans_of_gemma_3n_gemma_4_e2b_and_hy_v4():
    """Gemma's layers take per-layer inputs beside the hidden states, Gemma 3n's and HY-V4's 4 streams of
    them (AltUp, hyper-connections): the width on the wire per token, for the real models' shapes."""
    from transformers import AutoConfig

    gemma3n = ModelConfig.from_hf(AutoConfig.for_model("gemma3n")).wire
    assert (gemma3n.streams, gemma3n.per_layer, gemma3n.num_layers) == (4, 256, 35)
    assert gemma3n.width == 4 * 2048 + 35 * 256
    gemma4 = ModelConfig.from_hf(AutoConfig.for_model("gemma4")).wire
    assert gemma4.streams == 1 and gemma4.width == gemma4.hidden_size + gemma4.num_layers * gemma4.per_layer
    hyper = ModelConfig.from_hf(AutoConfig.for_model("hy_v4")).wire
    assert (hyper.streams, hyper.streams_first, hyper.width) == (4, False, 4 * 2816)
    assert ModelConfig.from_hf(AutoConfig.for_model("llama")).wire.plain
    v4 = ModelConfig.from_hf(AutoConfig.for_model("deepseek_v4"))  # streams, and the ids hash routing reads
    assert (v4.wire.streams, v4.wire.token_ids, v4.wire.width) == (4, 3, 4 * 4096 + 3)
    assert v4.wire.carries == ("input_ids",)


def test_a_token_costs_only_the_attention_layers_cache(tiny_models):
    from tiny_models import tiny_config

    llama, qwen = ModelConfig.from_hf(tiny_config("llama")), ModelConfig.from_hf(tiny_config("qwen3_5"))
    assert llama.kv_bytes_per_token_per_block(4) == 2 * 2 * 16 * 4  # 2 kv heads of 16, k and v
    assert qwen.kv_bytes_per_token_per_block(4) == 2 * 2 * 16 * 4 * 2 // 6  # 2 attention layers of 6
    span = Span.load(tiny_models["qwen3_5"], 0, 3)  # linear, linear, full attention
    assert span.cache_bytes_per_token == 2 * 2 * 16 * 4 and span.state_bytes_per_row > 0


def test_span_range_is_checked(tiny_models):
    with pytest.raises(InvalidRequest, match="blocks 4:9"):
        Span.load(tiny_models["llama"], 4, 9)


def test_model_sources(tiny_models, tmp_path):
    source = resolve_model(str(tiny_models["llama"]))
    assert source.path == tiny_models["llama"] and source.name == "tiny-llama"
    assert dht_prefix_for("Org/My Model.v2") == "Org-My-Model-v2"
    with pytest.raises(UnsupportedModel, match="neither a folder"):
        resolve_model("no-such-model")
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(UnsupportedModel, match="not a .gguf"):
        resolve_model(str(tmp_path / "weights.bin"))


def test_heads_and_spans_load_at_once_in_several_threads(tiny_models):
    """accelerate's init_empty_weights patches torch.nn.Module process-wide: without the lock in
    models/loading.py, a head loading in one thread got meta weights from another thread's build."""
    from concurrent.futures import ThreadPoolExecutor

    path = tiny_models["mistral"]
    loads = [lambda: ModelHead.load(path), lambda: Span.load(path, 0, 6)] * 4
    with ThreadPoolExecutor(4) as pool:
        loaded = list(pool.map(lambda load: load(), loads))
    assert all(p.device.type == "cpu" for module in loaded for p in module.parameters())


def test_spans_and_heads_load_in_the_dtype_asked_for(tiny_models):
    span = Span.load(tiny_models["qwen3"], 0, 2, torch.bfloat16)
    head = ModelHead.load(tiny_models["qwen3"], torch.bfloat16)
    assert {p.dtype for p in [*span.parameters(), *head.parameters()]} == {torch.bfloat16}
    assert span.rotary.inv_freq.dtype == torch.float32  # as transformers keeps it
    assert span(head.embed(torch.tensor([[5, 6, 7]]))).dtype == torch.bfloat16


def test_latent_attention_caches_its_latent_and_is_handed_its_history(tiny_models):
    """DeepSeek-V3's attention caches a compressed latent (32) and a rotary key (8), one head each, and
    expands them into 4 heads of keys (16 + 8) and values (16) after reading them back."""
    span = Span.load(tiny_models["deepseek_v3"], 0, 2)
    assert span.cache_shapes == dict.fromkeys((0, 1), CacheShape(1, 32, 1, 8, gathers=True))
    assert span.cache_bytes_per_token == 2 * (32 + 8) * 4  # 2 blocks, float32
    expanded = 4 * ((16 + 8) + 16) * 4
    assert span.config.kv_bytes_per_token_per_block(4) == (32 + 8) * 4 < expanded


def test_glm_5_next_announces_the_latent_and_pooled_indexer_keys_of_its_sparse_layers(tiny_models):
    """Half the tiny GLM-5-Next's layers are sparse latent attention (a 32-wide latent, no rotary part, and
    indexer keys of 16 with their pooling gate and a valid flag); the others keep a recurrent state."""
    span = Span.load(tiny_models["glm5_next"], 0, 6)
    assert span.config.pooled_indexer and span.kv_blocks == (1, 3, 5)
    assert span.cache_bytes_per_token == 3 * (32 + 2 * 16 + 1) * 4
    assert span.config.kv_bytes_per_token_per_block(4) == span.cache_bytes_per_token // 6
    from transformers import AutoConfig

    real = ModelConfig.from_hf(AutoConfig.for_model("glm5_next"))  # bf16: 11 of 45 layers sparse
    assert real.layer_types.count("indexed_attention") == 11
    assert real.kv_bytes_per_token_per_block(2) == (512 + 2 * 128 + 1) * 2 * 11 // 45


def test_layers_that_take_the_token_ids_or_a_shared_module_are_refused():
    """Qwen4-exp's layers embed n-grams of the token ids themselves (`ple_input_ids`), which a span that
    receives hidden states lacks; Zamba v1's hybrid layers call one attention module object (Zamba2's
    tie copies' weights): refused when the span is built, in one line."""
    from transformers import AutoConfig

    zamba = ModelConfig.from_hf(AutoConfig.for_model("zamba"))
    with pytest.raises(UnsupportedModel, match=r"zamba: its layers \(Zamba\w+Layer\) take original_hidden"):
        Span(zamba, 0, 1)

    sparse = dict(
        indexer_n_heads=4,
        indexer_kv_heads=1,
        indexer_head_dim=256,
        indexer_budget=2048,
        indexer_compress_ratio=4,
    )
    config = ModelConfig.from_hf(AutoConfig.for_model("qwen4_exp", text_config=sparse))
    with pytest.raises(
        UnsupportedModel, match=r"qwen4_exp_text: its layers \(Qwen4ExpTextDecoderLayer\) take ple"
    ):
        Span(config, 0, 1)


@pytest.mark.parametrize(
    ("model_type", "handed", "given"),
    [
        ("zaya", 256, "prev_router_hidden_states"),  # each layer's router state, for the next
        ("zamba2", 2560, "original_hidden_states"),  # the embeddings' output, for every shared block
    ],
)
def test_what_layers_take_beside_the_hidden_states_travels_with_them(model_type, handed, given):
    """ZAYA's routers add the previous layer's router state, Zamba's shared attention blocks read the
    embeddings' output: it is handed on after the hidden states (at the real models' shapes), and a span's
    layers take it."""
    from transformers import AutoConfig

    config = ModelConfig.from_hf(AutoConfig.for_model(model_type))
    assert (config.wire.width, config.wire.carries) == (config.hidden_size + handed, (given,))
    assert Span(config, 1, 2).config.wire.handed == handed


def test_layers_holding_two_attention_sublayers_are_blocks_with_two_caches(tiny_models):
    """LongCat-Flash's config counts attention sublayers as num_hidden_layers (two per decoder layer,
    cached by transformers as 2i and 2i + 1): its blocks are its layers, each with two cache layers."""
    config = ModelConfig.from_folder(tiny_models["longcat_flash"])
    assert (config.num_hidden_layers, config.cache_layers_per_block) == (6, 2)
    span = Span.load(tiny_models["longcat_flash"], 2, 5)
    assert span.kv_blocks == tuple(range(6)) and span.cache_shapes[0] == span.cache_shapes[5]
    assert span.cache_bytes_per_token == 6 * (32 + 8) * 4  # a latent of 32 and a rotary key of 8 each
    assert config.kv_bytes_per_token_per_block(4) == 2 * (32 + 8) * 4


def test_a_loaded_span_keeps_no_mapping_of_its_checkpoint(tiny_models):
    """A block's tensors are copied out of the safetensors mapping: a MoE span (experts fused from
    per-expert tensors, the rest kept as stored) would otherwise keep the file mapped, and every page that
    loading read resident beside its weights (2.1x its weights' bytes at Qwen3-30B-A3B's shapes)."""
    path = tiny_models["qwen3_moe"]
    span = Span.load(path, 0, 6)
    mapped = Path("/proc/self/maps").read_text()
    assert str(path.resolve()) not in mapped
    head = ModelHead.load(path)  # the head's tensors stay mapped: rows never looked up are never read
    assert str(path.resolve()) in Path("/proc/self/maps").read_text()
    del head, span


def test_a_big_moe_block_is_built_without_allocating_its_experts():
    """DeepSeek-V3's fused experts take 30 GB a layer in float32: made on the CPU before they reach the meta
    device, their allocation was refused on machines with less memory (this one has 24 GB). They are made
    on meta at once; small tensors and buffers (the rotary frequencies) stay real."""
    from transformers import AutoConfig

    from corolla.models.loading import HUGE_BYTES, _HugeOnMeta

    span = Span(ModelConfig.from_hf(AutoConfig.for_model("deepseek_v3")), 3, 4, torch.float32)
    assert span.blocks[0].mlp.experts.gate_up_proj.is_meta
    assert not span.rotary.inv_freq.is_meta and span.rotary.inv_freq[0] == 1
    with _HugeOnMeta():
        assert torch.empty(HUGE_BYTES // 4, dtype=torch.float32).is_meta
        assert torch.zeros(2, HUGE_BYTES // 4, dtype=torch.bfloat16).is_meta
        assert not torch.empty(HUGE_BYTES // 8, dtype=torch.float32).is_meta  # half as large
        assert not torch.empty(4, 4, device="cpu").is_meta


def test_a_span_holds_one_copy_of_a_shared_block_however_many_layers_use_it(tiny_models):
    """Zamba2's shared attention blocks are stored once and tied to later layers: a span reads them once
    and every block of it using one holds the same tensors (quantized, each holds its own)."""
    path = tiny_models["zamba2"]  # hybrid layers 1, 3, 5 use shared blocks 0, 1, 0

    def tensors(span, block):
        module = span.blocks[block - span.start].shared_transformer
        return [p.data_ptr() for p in module.parameters()]

    whole = Span.load(path, 0, 6)
    assert tensors(whole, 5) == tensors(whole, 1) != tensors(whole, 3)
    later = Span.load(path, 3, 6)  # block 5 reads shared block 0 from where block 1 stores it
    assert tensors(later, 5) != tensors(later, 3)
    quantized = Span.load(path, 0, 6, quantize="int8")
    assert tensors(quantized, 5) != tensors(quantized, 1)
