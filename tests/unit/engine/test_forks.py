"""Sessions that start from another session's state (engine/forks.py): shared, not computed again, and
exactly what the plain sequence gives, whichever session writes first."""

import pytest
import torch

from corolla.engine.sequence import StepWork
from corolla.errors import InvalidRequest, SessionNotFound
from corolla.models.tree import TokenTree
from engine_helpers import assert_close, make_engine, reference_outputs, run_step

H = 64


def computed_positions(engine) -> list[tuple[str, int]]:
    """Record every chunk a pass computes: (session, positions)."""
    seen: list[tuple[str, int]] = []
    original = engine.runner.run

    def run(chunks):
        seen.extend((chunk.session.session_id, chunk.num_tokens) for chunk in chunks)
        return original(chunks)

    engine.runner.run = run
    return seen


def steps(*lengths: int, rows: int = 1, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(rows, n, H, generator=generator) for n in lengths]


@pytest.mark.parametrize("at", [10, 6])  # the source's end (a partial page), and mid-page earlier
def test_a_fork_shares_the_prefix_and_both_go_on_exactly(tiny_models, at):
    engine = make_engine(tiny_models["llama"], page_size=4)
    prefix, mine, theirs = steps(10, 3, 2)
    source = engine.open_session("a", (0, 6), 1, 64, owner="peer")
    run_step(engine, StepWork(source, prefix, 0))
    free = engine.pages.num_free
    fork = engine.fork_session("a", "b", at, owner="peer")
    assert engine.pages.num_free == free  # its pages are the source's
    seen = computed_positions(engine)
    forked = run_step(engine, StepWork(fork, mine, at))
    continued = run_step(engine, StepWork(source, theirs, 10))
    assert seen == [("b", 3), ("a", 2)]  # nothing computed again
    assert_close(forked, reference_outputs(engine.span, [prefix[:, :at], mine])[1])
    assert_close(continued, reference_outputs(engine.span, [prefix, theirs])[1])
    engine.close_session("a")
    again = run_step(engine, StepWork(fork, theirs, at + 3))  # its pages outlive the source's session
    assert_close(again, reference_outputs(engine.span, [prefix[:, :at], mine, theirs])[2])


def test_a_fork_of_one_row_of_several(tiny_models):
    engine = make_engine(tiny_models["qwen2"], page_size=4)
    prefix, mine = steps(7, 2, rows=3)
    source = engine.open_session("a", (0, 6), 3, 64)
    run_step(engine, StepWork(source, prefix, 0))
    fork = engine.fork_session("a", "b", 7, rows=[2])
    out = run_step(engine, StepWork(fork, mine[2:], 7))
    assert_close(out, reference_outputs(engine.span, [prefix[2:], mine[2:]])[1])


def test_a_span_with_recurrent_states_recomputes_a_fork_from_the_kept_inputs(tiny_models):
    engine = make_engine(tiny_models["qwen3_5"], page_size=4, max_cache_tokens=2048)
    prefix, mine = steps(9, 2)
    source = engine.open_session("a", (0, 6), 1, 64)
    run_step(engine, StepWork(source, prefix, 0))
    fork = engine.fork_session("a", "b", 5)
    seen = computed_positions(engine)
    out = run_step(engine, StepWork(fork, mine, 5))
    assert sum(length for name, length in seen if name == "b") == 5 + 2  # its state rebuilt, exactly
    assert_close(out, reference_outputs(engine.span, [prefix[:, :5], mine])[1])


def test_forks_that_cannot_be_served_are_refused_clearly(tiny_models):
    engine = make_engine(tiny_models["llama"], page_size=4)
    prefix, nodes = steps(6, 3)
    source = engine.open_session("a", (0, 6), 1, 64, owner="peer")
    run_step(engine, StepWork(source, prefix, 0))
    with pytest.raises(SessionNotFound, match="session 'gone' to fork from is gone"):
        engine.fork_session("gone", "b", 3, owner="peer")
    with pytest.raises(SessionNotFound, match="session 'a' to fork from is gone"):
        engine.fork_session("a", "b", 3, owner="another peer")  # never another peer's state
    with pytest.raises(InvalidRequest, match="fork position 7 is outside the source session's 0..6"):
        engine.fork_session("a", "b", 7, owner="peer")
    with pytest.raises(InvalidRequest, match=r"fork rows \[1\] must name rows 0..0"):
        engine.fork_session("a", "b", 3, owner="peer", rows=[1])
    run_step(engine, StepWork(source, nodes, 6, tree=TokenTree([-1, 0, 0])))
    with pytest.raises(InvalidRequest, match="inside the source's token tree"):
        engine.fork_session("a", "b", 7, owner="peer")
    assert "b" not in engine.sessions
