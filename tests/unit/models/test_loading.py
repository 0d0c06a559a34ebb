import json

import pytest
import torch

from corolla.errors import InvalidRequest, UnsupportedModel
from corolla.models.checkpoint import Checkpoint
from corolla.models.config import ModelConfig
from corolla.models.head import ModelHead
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


def test_head_reads_no_block_and_ties_embeddings(tiny_models):
    checkpoint = Checkpoint(tiny_models["llama"])
    tensors = checkpoint.read_head(tie_word_embeddings=True, dtype=torch.float32)
    assert set(tensors) == {"embed_tokens.weight", "norm.weight", "lm_head.weight"}
    head = ModelHead.load(tiny_models["llama"])
    assert head.lm_head.weight is head.embed_tokens.weight
    untied = ModelHead.load(tiny_models["mistral"])
    assert untied.lm_head.weight is not untied.embed_tokens.weight


def test_config_fields_per_family(tiny_models):
    llama = ModelConfig.from_folder(tiny_models["llama"])
    assert (llama.rope.kind, llama.rope.factor, llama.tie_word_embeddings) == ("llama3", 8.0, True)
    assert ModelConfig.from_folder(tiny_models["qwen2"]).qkv_bias is True
    assert ModelConfig.from_folder(tiny_models["mistral"]).sliding_windows == (7,) * 6


def test_legacy_rope_scaling_and_unsupported_models():
    base = dict(
        model_type="llama",
        vocab_size=10,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        rope_theta=500000.0,
        rope_scaling={"type": "linear", "factor": 2.0},
    )
    config = ModelConfig.from_dict(base)
    assert (config.rope.theta, config.rope.kind, config.rope.factor, config.num_key_value_heads) == (
        500000.0,
        "linear",
        2.0,
        2,
    )
    with pytest.raises(UnsupportedModel, match="model_type 'gpt2' is not supported"):
        ModelConfig.from_dict({**base, "model_type": "gpt2"})
    with pytest.raises(UnsupportedModel, match="rope type 'yarn'"):
        ModelConfig.from_dict({**base, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(UnsupportedModel, match="missing or has an invalid field"):
        ModelConfig.from_dict({"model_type": "llama"})


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
