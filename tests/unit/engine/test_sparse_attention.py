"""DeepSeek sparse attention (DeepSeek-V3.2) in the engine: its indexer keys are cached in pages beside the
latent, each row's indexer ranks only its own keys (rows of a packed pass run one at a time through those
layers), and batched sessions, chunked prefills, token trees and their kept paths give what one session
alone gives (tests/unit/engine/test_engine.py batches it with the other families)."""

from engine_helpers import check_batched_sessions_match_each_alone, check_tree_step_and_kept_path, make_engine


def test_the_cache_holds_indexer_keys_beside_the_latent(tiny_models):
    engine = make_engine(tiny_models["deepseek_v32"])
    shape = engine.span.cache_shapes[0]
    assert (shape.key_dim, shape.value_dim, shape.index_dim, shape.gathers) == (32, 8, 16, True)
    assert engine.pool.layer(5).indexer.shape == (64, 4, 1, 16)  # pages, page size, one head of 16
    assert engine.span.cache_bytes_per_token == 6 * (32 + 8 + 16) * 4


def test_sessions_of_several_rows_match_each_session_alone(tiny_models):
    engine = make_engine(tiny_models["deepseek_v32"], max_batch_tokens=64)
    check_batched_sessions_match_each_alone(engine, [(1, 13), (2, 5), (1, 1), (3, 9)])


def test_a_tree_step_and_its_kept_path(tiny_models):
    check_tree_step_and_kept_path(make_engine(tiny_models["deepseek_v32"], page_size=4))
