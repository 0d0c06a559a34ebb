"""The engine with a tiny model: paged caches, chunking, admission, preemption, abort; always correct."""

import pytest
import torch

from corolla.engine.sequence import SessionStatus, StepWork
from corolla.errors import CacheExhausted
from engine_helpers import assert_close, make_engine, observe_statuses, reference_outputs, run_sessions

H = 64


def steps(batch, prompt, decodes, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, prompt, H, generator=generator)] + [
        torch.randn(batch, 1, H, generator=generator) for _ in range(decodes)
    ]


def test_growth_across_block_boundaries_matches_a_contiguous_cache(tiny_models):
    engine = make_engine(tiny_models["llama"], page_size=4)
    plan = [torch.randn(2, 3, H), torch.randn(2, 1, H), torch.randn(2, 5, H), torch.randn(2, 1, H)]
    (outputs,) = run_sessions(engine, {"a": plan}).values()
    for actual, expected in zip(outputs, reference_outputs(engine.span, plan), strict=True):
        assert_close(actual, expected)
    assert len(engine.sessions["a"].page_tables[0]) == 3  # 10 positions in pages of 4


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "deepseek_v3", "deepseek_v32"])
def test_batched_sessions_match_each_session_alone(tiny_models, family):
    engine = make_engine(tiny_models[family], max_batch_tokens=24)
    plans = {
        f"s{i}": steps(batch, prompt, 4, seed=i)
        for i, (batch, prompt) in enumerate([(1, 13), (2, 5), (1, 1), (3, 9), (1, 30)])
    }
    results = run_sessions(engine, plans)
    assert engine.num_passes < sum(len(p) for p in plans.values())  # work really shared passes
    for name, plan in plans.items():
        for actual, expected in zip(results[name], reference_outputs(engine.span, plan), strict=True):
            assert_close(actual, expected)


def test_chunked_prefill_interleaves_with_decodes(tiny_models):
    engine = make_engine(tiny_models["llama"], max_batch_tokens=8)
    decoding = engine.open_session("decoding", (0, 6), 1, 256)
    prefill = engine.open_session("prefill", (0, 6), 1, 256)
    engine.add_step(StepWork(decoding, torch.randn(1, 4, H), decoding.position))
    engine.step()
    long_prompt = torch.randn(1, 30, H)
    engine.add_step(StepWork(prefill, long_prompt, 0))
    decode_passes = 0
    while prefill.pending:
        engine.add_step(StepWork(decoding, torch.randn(1, 1, H), decoding.position))
        completions = engine.step()
        decode_passes += 1
        assert any(c.outputs.shape[1] == 1 for c in completions)  # the decode step ran in this very pass
        assert engine.batched_rows == 2 or not prefill.pending
    assert decode_passes >= 4  # 30 prefill tokens at <= 7 per pass, next to a decode each time
    assert prefill.position == 30


def test_admission_waits_for_free_cache_then_fails_after_alloc_timeout(tiny_models):
    engine = make_engine(tiny_models["llama"], max_cache_tokens=16, page_size=4)  # 4 pages
    holder = engine.open_session("holder", (0, 6), 1, 256)
    engine.add_step(StepWork(holder, torch.randn(1, 12, H), holder.position))
    engine.step()
    assert engine.pages.num_free == 1
    newcomer = engine.open_session("newcomer", (0, 6), 1, 256)
    work = StepWork(newcomer, torch.randn(1, 8, H), newcomer.position, admit_deadline=float("inf"))
    engine.add_step(work)
    assert engine.step() == [] and newcomer.status == SessionStatus.WAITING  # waits: no preemption for it
    engine.close_session("holder")
    (completion,) = engine.step()
    assert completion.request_id == work.request_id and completion.outputs.shape == (1, 8, H)
    late = engine.open_session("late", (0, 6), 1, 256)
    engine.add_step(StepWork(late, torch.randn(1, 12, H), 0, admit_deadline=0.0))  # deadline already passed
    (failed,) = engine.step()
    assert isinstance(failed.error, CacheExhausted) and "within alloc_timeout" in str(failed.error)
    huge = engine.open_session("huge", (0, 6), 1, 256)
    engine.add_step(StepWork(huge, torch.randn(1, 40, H), huge.position))
    (never,) = engine.step()
    assert "more than this server's whole cache of 16 tokens" in str(never.error)


def test_preempted_sessions_recompute_and_stay_correct(tiny_models):
    # 12 pages of 4 = 48 positions for three sessions that grow to 25 positions each: someone must yield
    engine = make_engine(tiny_models["llama"], max_cache_tokens=48, page_size=4, max_batch_tokens=16)
    plans = {f"s{i}": steps(1, 9, 16, seed=10 + i) for i in range(3)}
    statuses = observe_statuses(engine)
    results = run_sessions(engine, plans)
    assert SessionStatus.PREEMPTED in statuses
    for name, plan in plans.items():
        for actual, expected in zip(results[name], reference_outputs(engine.span, plan), strict=True):
            assert_close(actual, expected)


def test_beam_reordering_and_rollback_on_paged_caches(tiny_models):
    engine = make_engine(tiny_models["qwen2"], page_size=4)
    plan = [torch.randn(3, 6, H), torch.randn(3, 1, H), torch.randn(3, 2, H), torch.randn(3, 1, H)]
    hypo = [None, torch.tensor([2, 2, 0]), None, torch.tensor([1, 0, 0])]
    rollbacks = [None, None, 5, None]
    results = run_sessions(engine, {"beam": plan}, hypo_ids={"beam": hypo}, position={"beam": rollbacks})
    expected = reference_outputs(engine.span, plan, hypo_ids=hypo, rollbacks=rollbacks)
    for actual, reference in zip(results["beam"], expected, strict=True):
        assert_close(actual, reference)


def test_abort_and_close_free_blocks_at_the_next_pass(tiny_models):
    engine = make_engine(tiny_models["llama"], max_batch_tokens=8)
    session = engine.open_session("s", (0, 6), 1, 256)
    work = StepWork(session, torch.randn(1, 40, H), session.position)
    engine.add_step(work)
    engine.step()  # the first chunk of a long prefill
    assert engine.pages.num_free < engine.pages.num_pages
    assert engine.abort(work.request_id)
    engine.close_session("s")
    assert engine.pages.num_free == engine.pages.num_pages
    assert not engine.has_work() and engine.step() == []


def test_hundred_sessions_leave_the_pool_as_full_as_before(tiny_models):
    engine = make_engine(tiny_models["llama"])
    before = engine.pages.num_free
    for i in range(100):
        session = engine.open_session(f"s{i}", (0, 6), 1 + i % 3, 256)
        engine.add_step(StepWork(session, torch.randn(1 + i % 3, 1 + i % 7, H), session.position))
        if i % 2:
            engine.step()
        engine.close_session(f"s{i}")
    assert engine.pages.num_free == before and not engine.sessions


def test_forward_requests_yield_to_inference_steps_but_are_not_starved(tiny_models):
    from corolla.engine.scheduler import FORWARD_MAX_SKIPS
    from corolla.engine.sequence import ForwardWork

    engine = make_engine(tiny_models["llama"], max_batch_tokens=4)
    session = engine.open_session("chat", (0, 6), 1, 256)
    engine.add_step(StepWork(session, torch.randn(1, 40, H), session.position))  # 10 passes of 4 tokens
    forward = ForwardWork(torch.randn(2, 5, H), (0, 6))
    engine.add_forward(forward)
    passes_before_forward = 0
    while True:
        completions = engine.step()
        if any(c.request_id == forward.request_id for c in completions):
            break
        passes_before_forward += 1
    assert passes_before_forward == FORWARD_MAX_SKIPS  # inference first, but the forward got its turn
    assert session.pending  # the long prefill was still going on
    (result,) = [c for c in completions if c.request_id == forward.request_id]
    assert_close(result.outputs, engine.span(forward.hidden))
