"""Fair share between peers in the engine: one peer's many sessions cannot lock others out of the cache
or out of the passes, and whoever yields recomputes exactly."""

from __future__ import annotations

import torch

from corolla.engine.sequence import SessionStatus, StepWork
from corolla.errors import CacheExhausted
from engine_helpers import assert_close, make_engine, reference_outputs

H = 64


def run_step(engine, session, hidden, **kwargs):
    work = StepWork(session, hidden, session.position, **kwargs)
    engine.add_step(work)
    for _ in range(20):
        for done in engine.step():
            if done.request_id == work.request_id:
                return done
    raise AssertionError("the step never completed")


def test_a_newcomer_takes_the_cache_of_a_flooding_peers_longest_idle_session(tiny_models):
    engine = make_engine(tiny_models["llama"], max_cache_tokens=32, page_size=4)  # 8 pages
    flood = [engine.open_session(f"f{i}", (0, 6), 1, 64, owner="flooder") for i in range(4)]
    flood_inputs = [torch.randn(1, 8, H, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    for session, hidden in zip(flood, flood_inputs, strict=True):  # 2 pages each: the whole cache, idle
        run_step(engine, session, hidden)
    assert engine.pages.num_free == 0
    honest = engine.open_session("h", (0, 6), 1, 64, owner="honest")
    prompt = torch.randn(1, 8, H)
    done = run_step(engine, honest, prompt, admit_deadline=0.0)  # no waiting: it is within its share
    assert done.error is None and honest.status == SessionStatus.RUNNING
    assert_close(done.outputs, reference_outputs(engine.span, [prompt])[0])
    assert flood[0].status == SessionStatus.PREEMPTED  # the longest idle one yielded
    assert all(s.status == SessionStatus.RUNNING for s in flood[1:])
    more = torch.randn(1, 1, H)  # the victim recomputes its cache and answers exactly
    again = run_step(engine, flood[0], more)
    assert_close(again.outputs, reference_outputs(engine.span, [flood_inputs[0], more])[1])


def test_a_peer_over_its_share_takes_nothing_from_others(tiny_models):
    engine = make_engine(tiny_models["llama"], max_cache_tokens=32, page_size=4)  # 8 pages
    honest = engine.open_session("h", (0, 6), 1, 64, owner="honest")
    run_step(engine, honest, torch.randn(1, 8, H))  # 2 pages: well within a share of 4
    flood = [engine.open_session(f"f{i}", (0, 6), 1, 64, owner="flooder") for i in range(4)]
    results = [run_step(engine, s, torch.randn(1, 8, H), admit_deadline=0.0) for s in flood]
    assert [r.error is None for r in results] == [True, True, True, False]  # 6 free pages: 3 sessions
    assert isinstance(results[3].error, CacheExhausted)
    assert honest.status == SessionStatus.RUNNING and honest.num_cached == 8  # untouched


def test_passes_take_turns_between_peers(tiny_models):
    engine = make_engine(tiny_models["llama"], max_batch_rows=2)
    flood = [engine.open_session(f"f{i}", (0, 6), 1, 64, owner="flooder") for i in range(6)]
    honest = engine.open_session("h", (0, 6), 1, 64, owner="honest")
    for session in [*flood, honest]:  # the honest step arrives last, behind six of the flooder's
        engine.add_step(StepWork(session, torch.randn(1, 1, H), 0))
    first_pass = {c.request_id for c in engine.step()}
    assert honest.position == 1 and len(first_pass) == 2  # one row each
