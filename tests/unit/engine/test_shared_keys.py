"""Gemma 4's attention in the engine: layers of different cache shapes (sliding layers' heads of 16, global
layers' one head of 32, keys as values) in one paged pool, and a last layer that attends with the layer
before's keys and values (models/kv_sharing.py): it has no pages of its own, and no span or session
separates it from its source."""

import pytest
from transformers import AutoConfig

from corolla.errors import InvalidRequest
from corolla.models.attention import CacheShape
from corolla.models.kv_sharing import KVSharing
from corolla.models.model_config import ModelConfig
from corolla.models.span import Span
from engine_helpers import check_batched_sessions_match_each_alone, check_tree_step_and_kept_path, make_engine

SLIDING, GLOBAL = CacheShape(2, 16, 2, 16), CacheShape(1, 32, 1, 32)


def test_each_layer_caches_its_own_shape_and_the_reusing_layer_none(tiny_models):
    engine = make_engine(tiny_models["gemma4"])
    span = engine.span
    assert span.kv_sources == {5: 4} and span.kv_blocks == (0, 1, 2, 3, 4)
    assert span.cache_shapes == {0: SLIDING, 1: SLIDING, 2: GLOBAL, 3: SLIDING, 4: GLOBAL}
    assert span.cache_bytes_per_token == (3 * 2 * 2 * 16 + 2 * 2 * 32) * 4
    assert span.config.kv_bytes_per_token_per_block(4) == span.cache_bytes_per_token // 6
    pool = engine.pool
    assert pool.layers == (0, 1, 2, 3, 4)
    assert pool.layer(5) is pool.layer(4)  # block 5 reads block 4's pages
    assert pool.layer(2).keys.shape == (64, 4, 1, 32) and pool.layer(3).keys.shape == (64, 4, 2, 16)


def test_sessions_of_several_rows_match_each_session_alone(tiny_models):
    engine = make_engine(tiny_models["gemma4"], max_batch_tokens=64)
    check_batched_sessions_match_each_alone(engine, [(1, 13), (2, 5), (1, 1), (3, 9)])


def test_a_tree_step_and_its_kept_path(tiny_models):
    check_tree_step_and_kept_path(make_engine(tiny_models["gemma4"], page_size=4))


def test_no_span_or_session_separates_a_layer_from_the_keys_it_reads(tiny_models):
    path = tiny_models["gemma4"]
    for start, end in [(0, 5), (5, 6)]:
        with pytest.raises(
            InvalidRequest, match=r"cut gemma4_text's layers 4-5: layer 5 uses layer 4's keys and values"
        ):
            Span.load(path, start, end)
    assert Span.load(path, 4, 6).kv_sources == {1: 0}
    engine = make_engine(path)
    with pytest.raises(InvalidRequest, match=r"blocks 0:5 cut gemma4_text's layers 4-5"):
        engine.open_session("s", (0, 5), 1, 16)
    engine.open_session("s", (0, 4), 1, 16)  # a session may end before the group


def test_gemma_3n_s_sharing_groups_as_transformers_declares_them():
    """Gemma 3n's real layout (transformers' defaults): 35 layers, the last 15 reading layers 18 (sliding)
    and 19 (global)."""
    config = AutoConfig.for_model("gemma3n").get_text_config()
    sharing = KVSharing.of(config, tuple(config.layer_types))
    assert sharing.groups == [(18, 33), (19, 34)]
    assert sharing.forbidden_cuts == frozenset(range(19, 35))
    assert sharing.allows(19 - 1) and sharing.allows(0) and sharing.allows(35)
    assert sharing.local_sources(10, 35)[24] == 9 and len(sharing.local_sources(10, 35)) == 15
    with pytest.raises(InvalidRequest, match="layers 18-33: layers 19-33 use layer 18's keys and values"):
        sharing.check_span(0, 25, "gemma3n_text")
    assert ModelConfig.from_hf(AutoConfig.for_model("llama")).kv_sharing.forbidden_cuts == frozenset()
