"""Driving the engine directly in unit tests, and the contiguous-cache reference it must agree with."""

from __future__ import annotations

import torch

from corolla.config import EngineConfig
from corolla.engine.engine import Engine
from corolla.engine.sequence import StepWork
from corolla.models.contiguous import ContiguousCache
from corolla.models.span import Span


def make_engine(path, **overrides) -> Engine:
    config = dict(max_cache_tokens=256, page_size=4, max_batch_tokens=64, max_batch_rows=64)
    config["max_batch_wait_ms"] = 0  # tests drive passes themselves
    return Engine(Span.load(path, 0, 6), EngineConfig(**{**config, **overrides}))


def reference_outputs(
    span: Span, steps: list[torch.Tensor], hypo_ids=None, rollbacks=None
) -> list[torch.Tensor]:
    """What each step returns with a plain contiguous cache (hypo_ids / rollbacks: per step, or None)."""
    batch = steps[0].shape[0]
    cache = ContiguousCache.for_span(span, batch, 256)
    outputs = []
    for i, hidden in enumerate(steps):
        if rollbacks and rollbacks[i] is not None:
            cache.position = rollbacks[i]
        if hypo_ids and hypo_ids[i] is not None:
            cache.reorder(hypo_ids[i])
        with torch.no_grad():
            outputs.append(span(hidden, cache, position=cache.position))
        cache.position += hidden.shape[1]
    return outputs


def run_sessions(engine: Engine, plans: dict[str, list[torch.Tensor]], **step_kwargs) -> dict[str, list]:
    """Open one session per plan, submit each session's next step when its previous one completes,
    and step the engine until all are done. Returns each session's outputs (or errors), in order.

    `step_kwargs` give per-step StepWork fields by session (None: the default); a step's `position`
    defaults to the session's current one (append)."""
    sessions = {
        name: engine.open_session(name, (0, 6), steps[0].shape[0], 256) for name, steps in plans.items()
    }
    results: dict[str, list] = {name: [] for name in plans}
    owners = {}

    def submit(name):
        index = len(results[name])
        if index < len(plans[name]):
            extra = {k: v[name][index] for k, v in step_kwargs.items() if name in v}
            position = extra.pop("position", None)
            session = sessions[name]
            position = session.position if position is None else position
            work = StepWork(session, plans[name][index], position, **extra)
            owners[work.request_id] = name
            engine.add_step(work)

    for name in plans:
        submit(name)
    while engine.has_work():
        for completion in engine.step():
            name = owners.pop(completion.request_id)
            results[name].append(completion.outputs if completion.error is None else completion.error)
            if completion.error is None:
                submit(name)
    return results


def run_step(engine: Engine, work: StepWork) -> torch.Tensor:
    """Submit one step and pass until it completes; its outputs (its error raised)."""
    engine.add_step(work)
    for _ in range(100):
        for completion in engine.step():
            if completion.request_id == work.request_id:
                if completion.error is not None:
                    raise completion.error
                return completion.outputs
    raise AssertionError("the step did not complete within 100 passes")


def observe_statuses(engine: Engine) -> list:
    """Every session's status after each of the engine's passes from now on (the list fills as it runs)."""
    statuses = []
    original_step = engine.step

    def observing_step():
        completions = original_step()
        statuses.extend(s.status for s in engine.sessions.values())
        return completions

    engine.step = observing_step
    return statuses


def assert_close(actual, expected):
    """Equal up to float32 rounding: batching picks other matmul kernels, and a prefill split into chunks
    attends to its keys in other pieces. The tiny random models have activations near 100, and the
    rounding reaches 1.8e-5 of that scale when a busy machine makes the engine cut chunks at unusual
    places (measured: 1.3e-3 on a scale of 75), so the bound is 1e-4 of the scale. A wrong position,
    mask or cache entry changes outputs by whole units."""
    scale = float(expected.abs().max())
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4 * scale)


def check_batched_sessions_match_each_alone(engine: Engine, shapes, steps: int = 5, seed: int = 1) -> None:
    """Sessions of (rows, prompt length) `shapes`, each a prompt then `steps` decode steps, run together:
    every output is the one a plain contiguous cache gives the session alone, and passes were shared."""
    hidden_size = engine.span.config.wire.width
    generator = torch.Generator().manual_seed(seed)
    plans = {
        f"s{i}": [torch.randn(batch, prompt, hidden_size, generator=generator)]
        + [torch.randn(batch, 1, hidden_size, generator=generator) for _ in range(steps)]
        for i, (batch, prompt) in enumerate(shapes)
    }
    results = run_sessions(engine, plans)
    assert engine.num_passes < sum(len(p) for p in plans.values())  # batched
    for name, plan in plans.items():
        for actual, expected in zip(results[name], reference_outputs(engine.span, plan), strict=True):
            assert_close(actual, expected)


def check_tree_step_and_kept_path(engine: Engine, seed: int = 2) -> None:
    """A 9-token prefix, a 7-node tree of two roots, then 2 tokens after keeping the path 0-2-4: the tree's
    path and the tokens after it get what the plain sequence gets."""
    from corolla.models.tree import TokenTree

    hidden_size = engine.span.config.wire.width
    generator = torch.Generator().manual_seed(seed)
    prefix, nodes, later = (torch.randn(1, n, hidden_size, generator=generator) for n in (9, 7, 2))
    session = engine.open_session("tree", (0, 6), 1, 64)
    run_step(engine, StepWork(session, prefix, 0))
    tree_outputs = run_step(engine, StepWork(session, nodes, 9, tree=TokenTree([-1, 0, 0, 1, 2, 3, -1])))
    path = [0, 2, 4]
    outputs = run_step(engine, StepWork(session, later, 12, accepted=tuple(path)))
    expected = reference_outputs(engine.span, [prefix, nodes[:, path], later])
    assert_close(tree_outputs[:, path], expected[1])
    assert_close(outputs, expected[2])
