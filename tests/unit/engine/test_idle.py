"""Sessions kept after they ended, for forks (engine/idle.py): forkable while kept, the first taken back
when cache or session slots run short (so nobody waits for them), bounded per peer, and a fork of one
taken back is refused as gone."""

import pytest
import torch

from corolla.engine.sequence import StepWork
from corolla.errors import SessionNotFound
from engine_helpers import assert_close, make_engine, reference_outputs, run_step

H = 64


def hidden(length: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(1, length, H, generator=torch.Generator().manual_seed(seed))


def ended(engine, name: str, length: int, owner: str = "peer", seed: int = 0) -> torch.Tensor:
    """A session of `length` positions, run, then ended and kept."""
    session = engine.open_session(name, (0, 6), 1, 64, owner=owner)
    inputs = hidden(length, seed)
    run_step(engine, StepWork(session, inputs, 0))
    assert engine.keep_session(name)
    return inputs


def test_a_kept_session_is_forked_exactly_and_counted_apart(tiny_models):
    engine = make_engine(tiny_models["llama"])
    prefix = ended(engine, "a", 12)
    assert (engine.stats().num_sessions, engine.stats().num_idle) == (0, 1)
    fork = engine.fork_session("a", "b", 12, owner="peer")
    more = hidden(3, 1)
    out = run_step(engine, StepWork(fork, more, 12))
    assert_close(out, reference_outputs(engine.span, [prefix, more])[1])
    assert engine.stats().forked_tokens == 12 and engine.stats().computed_tokens == 12 + 3


def test_kept_sessions_go_first_when_a_new_session_needs_cache(tiny_models):
    """256 tokens of cache: two kept sessions hold 192; a new session of 128 is admitted at once (no
    alloc_timeout to wait through), the least recently used kept one closed for it."""
    engine = make_engine(tiny_models["llama"], max_cache_tokens=256)
    ended(engine, "old", 96)
    ended(engine, "recent", 96, seed=1)
    engine.fork_session("old", "peek", 4, owner="peer")  # a fork reads "old": now the most recent
    engine.close_session("peek")
    session = engine.open_session("new", (0, 6), 1, 256, owner="other")
    run_step(engine, StepWork(session, hidden(128, 2), 0))
    assert "recent" not in engine.sessions and "old" in engine.sessions
    with pytest.raises(SessionNotFound, match="gone"):
        engine.fork_session("recent", "late", 8, owner="peer")


def test_kept_sessions_are_bounded_per_peer(tiny_models):
    engine = make_engine(tiny_models["llama"], max_idle_sessions_per_peer=2)
    for i in range(3):
        ended(engine, f"s{i}", 4, seed=i)
    ended(engine, "t0", 4, owner="other")
    assert len(engine.idle) == 3 and "s0" not in engine.sessions  # the peer's oldest went


def test_kept_sessions_never_take_a_session_slot_from_a_new_one(tiny_models):
    engine = make_engine(tiny_models["llama"], max_sessions=4)
    ended(engine, "a", 4)
    ended(engine, "b", 4, seed=1)
    for name in ("c", "d", "e"):  # the third would be refused without the kept ones going
        engine.open_session(name, (0, 6), 1, 64, owner="other")
    assert set(engine.sessions) == {"b", "c", "d", "e"}


def test_a_session_with_work_pending_or_no_room_to_keep_is_closed(tiny_models):
    engine = make_engine(tiny_models["llama"], max_idle_sessions_per_peer=0)
    session = engine.open_session("a", (0, 6), 1, 64)
    run_step(engine, StepWork(session, hidden(4), 0))
    assert not engine.keep_session("a") and "a" not in engine.sessions
    assert engine.pages.num_free == engine.pages.num_pages
