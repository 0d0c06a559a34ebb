"""Layers that keep a recurrent state (linear attention, Mamba, convolutions) in the engine: decode rows
of many sessions run as one batch through them, and rollbacks, token trees, beam reordering and
preemption leave each session with exactly the state of the sequence it has kept, as a whole-sequence
pass computes it."""

import pytest
import torch

from corolla.engine.sequence import SessionStatus, StepWork
from corolla.models.tree import TokenTree
from engine_helpers import make_engine, observe_statuses, run_sessions, run_step
from tiny_models import RECURRENT

H = 64


def whole_sequences(span, plan, hypo_ids=None, rollbacks=None) -> list[torch.Tensor]:
    """Each step's outputs recomputed from position 0 over the sequence each row has kept by then."""
    kept = None
    outputs = []
    for i, step in enumerate(plan):
        if kept is not None and rollbacks and rollbacks[i] is not None:
            kept = kept[:, : rollbacks[i]]
        if kept is not None and hypo_ids and hypo_ids[i] is not None:
            kept = kept[hypo_ids[i]]
        kept = step if kept is None else torch.cat([kept, step], dim=1)
        with torch.no_grad():
            outputs.append(span(kept)[:, -step.shape[1] :])
    return outputs


def assert_close(actual, expected):
    """Equal up to 1e-3 of the scale: a recurrent layer's whole-sequence form (a chunked scan) and its
    token-by-token form round differently (transformers' own Nemotron-H: 7e-5 of the scale after 5 layers
    between its cached decoding and one pass). A wrong or stale state changes outputs by whole units."""
    scale = float(expected.abs().max())
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-3 * scale)


def test_spans_know_which_blocks_keep_states(tiny_models):
    engine = make_engine(tiny_models["qwen3_5"])
    assert engine.span.state_blocks == (0, 1, 3, 4) and engine.span.kv_blocks == (2, 5)
    assert engine.pool.layers == (2, 5)  # keys and values only for the attention layers
    nemotron = make_engine(tiny_models["nemotron_h"]).span  # Mamba, MLP alone, attention
    assert nemotron.state_blocks == (0, 3) and nemotron.kv_blocks == (2, 5)
    assert nemotron.state_bytes_per_row > 0


def test_a_rows_states_are_charged_cache_pages_until_it_closes(tiny_models):
    engine = make_engine(tiny_models["qwen3_5"], max_cache_tokens=256, page_size=4)  # 64 pages
    # 2 rows x 24 KiB of states, twice (current and snapshot), in pages of 4 tokens x 512 bytes
    assert engine.scheduler.state_pages == 2 * 24576 // (4 * 512) == 24
    session = engine.open_session("s", (0, 6), 2, 64)
    run_step(engine, StepWork(session, torch.randn(2, 5, H), 0))
    assert engine.pages.num_free == 64 - 2 * 24 - 2 * 2  # states, and 5 positions in 2 pages per row
    engine.close_session("s")
    assert engine.pages.num_free == 64
    wide = engine.open_session("wide", (0, 6), 3, 64)  # 3 x 24 pages of states: more than the cache
    engine.add_step(StepWork(wide, torch.randn(3, 1, H), 0))
    (refused,) = engine.step()
    assert "more than this server's whole cache" in str(refused.error)


@pytest.mark.parametrize("family", RECURRENT)
def test_batched_decoding_matches_whole_sequences(tiny_models, family):
    engine = make_engine(tiny_models[family], max_batch_tokens=24, max_cache_tokens=2048)
    generator = torch.Generator().manual_seed(1)
    # (ZAYA: the router state a layer hands the next beside; DeepSeek-V4: the token ids)
    wire = engine.span.config.wire
    plans = {
        f"s{i}": [wire.sample(batch, prompt, generator=generator)]
        + [wire.sample(batch, 1, generator=generator) for _ in range(4)]
        for i, (batch, prompt) in enumerate([(1, 13), (2, 5), (1, 1), (1, 30)])
    }
    passes = []
    original = engine.runner.run
    engine.runner.run = lambda chunks: passes.append(len(chunks)) or original(chunks)
    results = run_sessions(engine, plans)
    assert max(passes) >= 3  # decode rows of several sessions shared passes
    for name, plan in plans.items():
        for actual, expected in zip(results[name], whole_sequences(engine.span, plan), strict=True):
            assert_close(actual, expected)


@pytest.mark.parametrize("family", ["qwen3_5", "jamba", "lfm2", "falcon_h1", "deepseek_v4"])
def test_rollbacks_and_beam_reordering_restore_exact_states(tiny_models, family):
    engine = make_engine(tiny_models[family], page_size=4, max_cache_tokens=2048)
    generator = torch.Generator().manual_seed(2)
    sizes = [7, 1, 3, 2, 1, 2, 1]
    plan = [engine.span.config.wire.sample(3, n, generator=generator) for n in sizes]
    # a 3-token draft at 8 keeps 1 token (rollback to 9), then a rollback to 4 (before the last snapshot)
    rollbacks = [None, None, None, 9, None, 4, None]
    hypo = [None, torch.tensor([2, 2, 0]), None, None, torch.tensor([1, 0, 2]), None, None]
    results = run_sessions(engine, {"s": plan}, hypo_ids={"s": hypo}, position={"s": rollbacks})
    expected = whole_sequences(engine.span, plan, hypo, rollbacks)
    for actual, reference in zip(results["s"], expected, strict=True):
        assert_close(actual, reference)


@pytest.mark.parametrize("family", ["qwen3_next", "nemotron_h", "falcon_h1", "deepseek_v4"])
def test_a_tree_runs_each_path_from_the_state_and_its_kept_path_goes_on(tiny_models, family):
    engine = make_engine(tiny_models[family], page_size=4, max_batch_tokens=16, max_cache_tokens=2048)
    generator = torch.Generator().manual_seed(3)
    wire = engine.span.config.wire
    prefix, nodes, later = (wire.sample(1, n, generator=generator) for n in (6, 7, 3))
    session = engine.open_session("s", (0, 6), 1, 64)
    run_step(engine, StepWork(session, prefix, 0))
    tree_outputs = run_step(engine, StepWork(session, nodes, 6, tree=TokenTree([-1, 0, 0, 1, 2, 3, -1])))
    for path in ([0, 1, 3, 5], [0, 2, 4], [6]):  # every path's outputs: as if it were the sequence
        (expected,) = whole_sequences(engine.span, [torch.cat([prefix, nodes[:, path]], 1)])
        assert_close(tree_outputs[:, path], expected[:, 6:])
    path = [0, 2, 4]
    outputs = run_step(engine, StepWork(session, later, 9, accepted=tuple(path)))
    (expected,) = whole_sequences(engine.span, [torch.cat([prefix, nodes[:, path], later], 1)])
    assert_close(outputs, expected[:, -3:])


def test_preempted_sessions_recompute_their_states(tiny_models):
    # each row is charged 24 pages for its states: 84 pages admit three 9-token prompts (3 x (24 + 3)), and
    # three rows growing to 25 positions (3 x (24 + 7)) do not fit: someone must yield
    engine = make_engine(tiny_models["qwen3_5"], max_cache_tokens=336, page_size=4, max_batch_tokens=16)
    assert engine.scheduler.state_pages == 24
    generator = torch.Generator().manual_seed(4)
    plans = {
        f"s{i}": [torch.randn(1, 9, H, generator=generator)]
        + [torch.randn(1, 1, H, generator=generator) for _ in range(16)]
        for i in range(3)
    }
    statuses = observe_statuses(engine)
    results = run_sessions(engine, plans)
    assert SessionStatus.PREEMPTED in statuses
    for name, plan in plans.items():
        for actual, expected in zip(results[name], whole_sequences(engine.span, plan), strict=True):
            assert_close(actual, expected)
