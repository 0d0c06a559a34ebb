"""Layers that take more than the previous layer's hidden states (models/handoff.py): Gemma 3n's 4 parallel
streams (AltUp) and per-layer inputs, Gemma 4 E2B/E4B's per-layer inputs, HY-V4's and GLM-5-Next's 4
hyper-connection streams. What travels between spans is one [B, T, width] tensor; the engine batches, pages
and rolls it back like any hidden states."""

import pytest
import torch

from corolla.models.handoff import WireLayout
from corolla.models.head import ModelHead
from corolla.models.span import Span
from engine_helpers import check_batched_sessions_match_each_alone, check_tree_step_and_kept_path, make_engine
from tiny_models import load_reference, save_tiny_model


def test_pack_and_unpack_are_inverse():
    wire = WireLayout(hidden_size=4, streams=3, per_layer=2, num_layers=5)
    assert wire.width == 3 * 4 + 5 * 2
    streams, per_layer = torch.randn(3, 2, 7, 4), torch.randn(2, 7, 5, 2)
    packed = wire.pack(streams, per_layer)
    assert packed.shape == (2, 7, wire.width)
    unpacked_streams, unpacked_per_layer = wire.unpack(packed)
    assert torch.equal(unpacked_streams, streams) and torch.equal(unpacked_per_layer, per_layer)
    plain = WireLayout(hidden_size=4)
    hidden = torch.randn(2, 7, 4)
    assert plain.pack(hidden, None) is hidden and plain.unpack(hidden) == (hidden, None)


def test_a_span_passes_per_layer_inputs_on_unchanged(tiny_models):
    path = tiny_models["gemma3n"]
    head, span = ModelHead.load(path), Span.load(path, 0, 4)
    assert head.wire == span.config.wire == WireLayout(64, streams=4, per_layer=8, num_layers=6)
    wire = head.embed(torch.randint(3, 300, (2, 5), generator=torch.Generator().manual_seed(0)))
    with torch.no_grad():
        out = span(wire)
    assert out.shape == wire.shape == (2, 5, 4 * 64 + 6 * 8)
    assert torch.equal(head.wire.unpack(out)[1], head.wire.unpack(wire)[1])
    assert not torch.allclose(head.wire.unpack(out)[0], head.wire.unpack(wire)[0])


@pytest.mark.parametrize("family", ["gemma3n", "hy_v4", "glm5_next"])
def test_sessions_of_several_rows_match_each_session_alone(tiny_models, family):
    """HY-V4's and GLM-5-Next's sparse attention runs one row at a time: its streams are taken per row like
    hidden states. GLM-5-Next's linear attention keeps a state per row (21 KB each: a bigger cache)."""
    engine = make_engine(tiny_models[family], max_batch_tokens=64, max_cache_tokens=2048)
    check_batched_sessions_match_each_alone(engine, [(1, 13), (2, 5), (1, 1), (3, 9)])


@pytest.mark.parametrize("family", ["gemma3n", "hy_v4", "glm5_next"])
def test_a_tree_step_and_its_kept_path(tiny_models, family):
    """GLM-5-Next's indexer finds causality from positions: its trees run path by path."""
    check_tree_step_and_kept_path(make_engine(tiny_models[family], page_size=4))


def test_gemma_4_with_per_layer_inputs_split_in_spans_is_transformers(tmp_path):
    """Gemma 4 E2B/E4B's layout: per-layer inputs, one stream, the last layer reading an earlier one's keys
    and values."""
    path = save_tiny_model("gemma4", tmp_path / "gemma4", hidden_size_per_layer_input=8)
    reference = load_reference(path)
    head = ModelHead.load(path)
    assert head.wire == WireLayout(64, streams=1, per_layer=8, num_layers=6)
    input_ids = torch.randint(3, 300, (2, 9), generator=torch.Generator().manual_seed(1))
    wire = head.embed(input_ids)
    with torch.no_grad():
        for start, end in [(0, 2), (2, 6)]:
            wire = Span.load(path, start, end)(wire)
        expected = reference(input_ids).logits
    torch.testing.assert_close(head.logits(wire), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", ["gemma3n", "gemma4"])
def test_every_cut_placement_allows_gives_transformers_logits(tiny_models, family):
    """Two spans cut wherever the layers' sharing allows (not between layer 5 and the layer 4 it reads)."""
    path = tiny_models[family]
    reference, head = load_reference(path), ModelHead.load(path)
    config = head.config
    cuts = [cut for cut in range(1, 6) if cut not in config.kv_sharing.forbidden_cuts]
    assert cuts == [1, 2, 3, 4]
    input_ids = torch.randint(3, 300, (1, 11), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = reference(input_ids).logits
        for cut in cuts:
            wire = head.embed(input_ids)
            for start, end in [(0, cut), (cut, 6)]:
                wire = Span.load(path, start, end)(wire)
            torch.testing.assert_close(head.logits(wire), expected, atol=1e-4, rtol=0)


def test_a_contiguous_cache_refuses_a_tree_for_glm_5_next_in_one_line(tiny_models):
    """Its indexer finds causality from positions: only the engine runs a tree through it (path by path)."""
    from corolla.errors import UnsupportedModel
    from corolla.models.contiguous import ContiguousCache
    from corolla.models.tree import TokenTree

    span = Span.load(tiny_models["glm5_next"], 0, 2)  # a linear-attention layer, then a sparse one
    cache = ContiguousCache.for_span(span, 1, 16)
    cache.tree = TokenTree([-1, 0, 0])
    with torch.no_grad(), pytest.raises(UnsupportedModel, match="runs token trees in the engine only"):
        span(torch.randn(1, 3, span.config.wire.width), cache)
