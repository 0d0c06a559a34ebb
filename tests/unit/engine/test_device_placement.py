"""Every tensor the engine and the draft model make while computing names the span's device.

A server on a GPU keeps its weights, cache and passes there; one tensor made without `device=` (a page
table, positions, a mask) would be made on the CPU and fail to mix with the GPU's. This machine has no
GPU, so the tests make torch's default device `meta` while passes run on a CPU span: any tensor made
without naming its device lands on `meta`, where mixing it with the span's raises at once, and the
outputs must still equal those computed without the trap.
"""

import pytest
import torch

from corolla.decoding.draft_model import DraftModel
from corolla.engine.sequence import BackwardWork, ForwardWork, StepWork
from corolla.models.devices import resolve_device
from corolla.models.tree import TokenTree
from engine_helpers import assert_close, make_engine

H = 64


def drive(engine, works):
    """Submit the works in order, each after the previous completed; returns their outputs."""
    results = []
    for work in works:
        (engine.add_forward if isinstance(work, ForwardWork) else engine.add_step)(work)
        done = None
        while done is None:
            done = next((c for c in engine.step() if c.request_id == work.request_id), None)
        if done.error is not None:
            raise done.error
        results.append(done.outputs)
    return results


def plan(engine, generator):
    """A prefill in chunks, a batch of decode rows, a token tree, its accepted path, a rollback, and a
    forward and a backward pass (deep prompts included)."""
    session = engine.open_session("s", (0, 6), 2, 64)
    prompts = torch.randn(6, 2, 3, H, generator=generator)
    session.prompts = prompts
    hidden = [torch.randn(2, n, H, generator=generator) for n in (11, 1, 4, 2, 1)]
    tree = TokenTree([-1, 0, 0, 1])
    return [
        StepWork(session, hidden[0], 0),
        StepWork(session, hidden[1], 11),
        StepWork(session, hidden[2], 12, tree=tree),
        StepWork(session, hidden[3], 15, accepted=(0, 1, 3)),
        StepWork(session, hidden[4], 9),  # rolls back
        ForwardWork(torch.randn(2, 5, H, generator=generator), (1, 5), prompts[1:5]),
        BackwardWork(
            torch.randn(2, 5, H, generator=generator),
            (0, 6),
            prompts,
            grad_outputs=torch.randn(2, 5, H, generator=generator),
        ),
    ]


@pytest.mark.parametrize("family", ["llama", "gemma2", "gpt_oss", "deepseek_v3"])
def test_an_engines_passes_make_every_tensor_on_the_spans_device(tiny_models, family):
    reference = make_engine(tiny_models[family], page_size=4, max_batch_tokens=8)
    expected = drive(reference, plan(reference, torch.Generator().manual_seed(0)))
    engine = make_engine(tiny_models[family], page_size=4, max_batch_tokens=8)
    works = plan(engine, torch.Generator().manual_seed(0))
    with torch.device("meta"):
        actual = drive(engine, works)
    for got, want in zip(actual, expected, strict=True):
        if isinstance(got, torch.Tensor):
            assert got.device.type == "cpu"
            assert_close(got, want)
        else:
            assert_close(got.inputs, want.inputs)
            assert_close(got.prompts, want.prompts)


def test_a_draft_model_makes_every_tensor_on_its_device(tiny_models):
    draft = DraftModel.load(tiny_models["llama"], width=2, device=resolve_device("cpu"))
    context = [5, 9, 2, 7, 7, 1]
    expected = [draft.start(64).propose(context, depth=3, max_tokens=6) for _ in range(2)]
    session = draft.start(64)
    with torch.device("meta"):
        first = session.propose(context, depth=3, max_tokens=6)
        later = session.propose(context + first.tokens[:1], depth=3, max_tokens=6)
    assert (first.tokens, first.parents) == (expected[0].tokens, expected[0].parents)
    fresh = draft.start(64).propose(context + first.tokens[:1], depth=3, max_tokens=6)
    assert (later.tokens, later.parents) == (fresh.tokens, fresh.parents)
