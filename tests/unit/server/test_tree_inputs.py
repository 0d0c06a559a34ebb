"""Speculative tree steps in the inference service: a tree and the path the next step keeps, from the
client or pushed by the previous server; every malformed tree or path is refused with the field named,
and the session stays usable."""

from __future__ import annotations

import asyncio

import pytest
import torch

from engine_helpers import assert_close, reference_outputs
from service_helpers import Session, inputs, message

PARENTS = (-1, 0, 0, 1, 2)  # paths 0-1-3 and 0-2-4


async def refused(session) -> str:
    done = await asyncio.wait_for(anext(session.replies), 10)
    assert done.outputs is None, "the step ran"
    return done.refused


async def test_a_tree_then_its_accepted_path_equals_the_plain_sequence(service):
    first, nodes, later = inputs(1, 4, 5, 2)
    session = Session(service, message(first, "a", 0, first=True))
    await session.reply()
    await session.steps.put(message(nodes, "t", 4, tree=PARENTS))
    _, tree_outputs = await session.reply()
    await session.steps.put(message(later, "n", 7, accepted=(0, 2, 4)))
    _, outputs = await session.reply()
    await session.close()
    span = service.spans.primary.span
    path = torch.cat([first, nodes[:, [0, 2, 4]]], dim=1)
    expected_path, expected_later = reference_outputs(span, [path, later])
    assert_close(tree_outputs[:, [0, 2, 4]], expected_path[:, 4:])
    assert_close(outputs, expected_later)


async def test_a_pushed_tree_step_and_its_path_run_like_the_clients(service):
    first, nodes, later = inputs(2, 4, 5, 1)
    session = Session(service, message(first, "a", 0, first=True))
    await session.reply()
    service.take_push(message(nodes, "t", 4, pushed=True, tree=PARENTS), "previous-server")
    assert (await session.reply())[0] == "t"
    await session.steps.put(message(nodes, "t", 4, tree=PARENTS))  # the client's copy: runs nothing
    service.take_push(message(later, "n", 6, pushed=True, accepted=(0, 1)), "previous-server")
    step_id, outputs = await session.reply()
    await session.close()
    assert step_id == "n"
    path = torch.cat([first, nodes[:, [0, 1]]], dim=1)
    assert_close(outputs, reference_outputs(service.spans.primary.span, [path, later])[1])


async def test_a_tree_step_retried_after_a_failover_may_name_the_path_it_kept_again(service):
    """The previous server pushed tree step "t2" (keeping path (0, 2) of tree "t1") and died before the
    client heard of it; the client retries the step under a new id, naming that path again, not knowing
    that this session took the step already: a rollback to the tree's start, then the same tree."""
    first, nodes, more = inputs(3, 4, 5, 5)
    session = Session(service, message(first, "a", 0, first=True))
    await session.reply()
    await session.steps.put(message(nodes, "t1", 4, tree=PARENTS))
    await session.reply()
    service.take_push(message(more, "t2", 6, pushed=True, tree=PARENTS, accepted=(0, 2)), "previous-server")
    assert (await session.reply())[0] == "t2"
    await session.steps.put(message(more, "t2-again", 6, tree=PARENTS, accepted=(0, 2)))
    step_id, outputs = await session.reply()
    await session.close()
    assert step_id == "t2-again" and outputs is not None
    path = torch.cat([first, nodes[:, [0, 2]]], dim=1)
    tree_again = reference_outputs(service.spans.primary.span, [path, more[:, [0, 1, 3]]])[1]
    assert_close(outputs[:, [0, 1, 3]], tree_again)  # the path 0-1-3 of the tree, after the kept path


@pytest.mark.parametrize(
    ("meta", "length", "error"),
    [
        (dict(tree=(-1, 0)), 3, "tree: 2 parents for a step of 3 tokens"),
        (dict(tree=tuple(range(-1, 69))), 70, "tree: 1 x 70 tokens exceed this server's max_tree_tokens=64"),
        (dict(accepted=(0,)), 1, "accepted: this session holds no token tree"),
    ],
)
async def test_malformed_trees_are_refused_and_the_session_goes_on(service, meta, length, error):
    first, good = inputs(3, 4, 1)
    session = Session(service, message(first, "a", 0, first=True, max_length=128))
    await session.reply()
    await session.steps.put(
        message(torch.randn(1, length, 64), "bad", 4 - (meta.get("accepted") is not None), **meta)
    )
    assert error in await refused(session)
    await session.steps.put(message(good, "good", 4))
    step_id, outputs = await session.reply()
    await session.close()
    assert step_id == "good"
    assert_close(outputs, reference_outputs(service.spans.primary.span, [first, good])[1])


@pytest.mark.parametrize(
    ("accepted", "position", "error"),
    [
        ((0, 3), 6, "accepted=[0, 3] is not a path from a root of the session's last tree"),
        ((0, 1, 3), 6, "start_from_position=6 must be the last tree's start 4 + the 3 tokens"),
        ((0, 9), 6, "accepted=[0, 9] is not a path"),
        (None, 7, "the tree's first 3 tokens=[0, 1, 2] is not a path"),
        ((0,), 2, "accepted: start_from_position=2 rolls back to before the tree at 4"),
    ],
)
async def test_a_path_that_the_last_tree_does_not_have_is_refused_and_a_right_one_then_runs(
    service, accepted, position, error
):
    first, nodes, later = inputs(5, 4, 5, 1)
    session = Session(service, message(first, "a", 0, first=True))
    await session.reply()
    await session.steps.put(message(nodes, "t", 4, tree=PARENTS))
    await session.reply()
    extra = {} if accepted is None else {"accepted": accepted}
    await session.steps.put(message(later, "bad", position, **extra))
    assert error in await refused(session)
    await session.steps.put(message(later, "n", 7, accepted=(0, 1, 3)))
    _, outputs = await session.reply()
    await session.close()
    path = torch.cat([first, nodes[:, [0, 1, 3]]], dim=1)
    assert_close(outputs, reference_outputs(service.spans.primary.span, [path, later])[1])
