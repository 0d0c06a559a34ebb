"""DeepSeek sparse attention (DeepSeek-V3.2) in the engine: its indexer keys are cached in pages beside the
latent, each row's indexer ranks only its own keys (rows of a packed pass run one at a time through those
layers), and batched sessions, chunked prefills, token trees and their kept paths give what one session
alone gives (tests/unit/engine/test_engine.py batches it with the other families)."""

import torch

from corolla.engine.sequence import StepWork
from corolla.models.tree import TokenTree
from engine_helpers import assert_close, make_engine, reference_outputs, run_sessions, run_step

H = 64


def test_the_cache_holds_indexer_keys_beside_the_latent(tiny_models):
    engine = make_engine(tiny_models["deepseek_v32"])
    shape = engine.span.cache_shapes[0]
    assert (shape.key_dim, shape.value_dim, shape.index_dim, shape.gathers) == (32, 8, 16, True)
    assert engine.pool.layer(5).indexer.shape == (64, 4, 1, 16)  # pages, page size, one head of 16
    assert engine.span.cache_bytes_per_token == 6 * (32 + 8 + 16) * 4


def test_sessions_of_several_rows_match_each_session_alone(tiny_models):
    engine = make_engine(tiny_models["deepseek_v32"], max_batch_tokens=64)
    generator = torch.Generator().manual_seed(1)
    plans = {
        f"s{i}": [torch.randn(batch, prompt, H, generator=generator)]
        + [torch.randn(batch, 1, H, generator=generator) for _ in range(5)]
        for i, (batch, prompt) in enumerate([(1, 13), (2, 5), (1, 1), (3, 9)])
    }
    results = run_sessions(engine, plans)
    assert engine.num_passes < sum(len(p) for p in plans.values())
    for name, plan in plans.items():
        for actual, expected in zip(results[name], reference_outputs(engine.span, plan), strict=True):
            assert_close(actual, expected)


def test_a_tree_step_and_its_kept_path(tiny_models):
    engine = make_engine(tiny_models["deepseek_v32"], page_size=4)
    generator = torch.Generator().manual_seed(2)
    prefix, nodes, later = (torch.randn(1, n, H, generator=generator) for n in (9, 7, 2))
    session = engine.open_session("s", (0, 6), 1, 64)
    run_step(engine, StepWork(session, prefix, 0))
    tree_outputs = run_step(engine, StepWork(session, nodes, 9, tree=TokenTree([-1, 0, 0, 1, 2, 3, -1])))
    path = [0, 2, 4]
    outputs = run_step(engine, StepWork(session, later, 12, accepted=tuple(path)))
    expected = reference_outputs(engine.span, [prefix, nodes[:, path], later])
    assert_close(tree_outputs[:, path], expected[1])
    assert_close(outputs, expected[2])
