"""Token-tree steps in the engine: a tree runs whole in one pass next to other sessions' steps, the next step
keeps one path of it (its keys and values moved into place, the rest freed), and the session then goes
on exactly like a plain sequence of that path, also after preemption and rollbacks."""

import torch

from corolla.engine.sequence import StepWork
from corolla.models.tree import TokenTree
from engine_helpers import assert_close, make_engine, reference_outputs, run_step

H = 64
PARENTS = [-1, 0, 0, 1, 2, 3, -1]  # paths 0-1-3-5, 0-2-4, 6


def test_a_tree_step_then_its_accepted_path_equals_the_plain_sequence(tiny_models):
    engine = make_engine(tiny_models["llama"], page_size=4, max_batch_tokens=16)
    generator = torch.Generator().manual_seed(1)
    prefix, nodes, later = (torch.randn(1, n, H, generator=generator) for n in (6, 7, 3))
    session = engine.open_session("s", (0, 6), 1, 64)
    other = engine.open_session("o", (0, 6), 1, 64)
    run_step(engine, StepWork(session, prefix, 0))
    run_step(engine, StepWork(other, torch.randn(1, 4, H), 0))
    engine.add_step(StepWork(other, torch.randn(1, 1, H), 4))  # a decode step of another session
    tree_outputs = run_step(engine, StepWork(session, nodes, 6, tree=TokenTree(PARENTS)))
    assert engine.batched_rows == 2  # the tree shared its pass with the other session's decode step
    assert len(session.page_tables[0]) == 4  # 13 positions stored, in pages of 4
    path = [0, 2, 4]
    outputs = run_step(engine, StepWork(session, later, 9, accepted=tuple(path)))
    assert session.position == 12 and len(session.page_tables[0]) == 3  # the rest is freed
    (expected_path, expected_later) = reference_outputs(
        engine.span, [torch.cat([prefix, nodes[:, path]], 1), later]
    )
    assert_close(tree_outputs[:, path], expected_path[:, 6:])
    assert_close(outputs, expected_later)


def test_without_a_named_path_the_trees_first_tokens_are_kept_as_a_chain(tiny_models):
    engine = make_engine(tiny_models["mistral"], page_size=4)
    generator = torch.Generator().manual_seed(2)
    prefix, nodes, later = (torch.randn(1, n, H, generator=generator) for n in (5, 4, 2))
    session = engine.open_session("s", (0, 6), 1, 64)
    run_step(engine, StepWork(session, prefix, 0))
    run_step(engine, StepWork(session, nodes, 5, tree=TokenTree.chain(4)))
    outputs = run_step(engine, StepWork(session, later, 7))  # keeps tokens 0 and 1
    expected = reference_outputs(engine.span, [torch.cat([prefix, nodes[:, :2], later], 1)])[0][:, -2:]
    assert_close(outputs, expected)


def test_a_rollback_to_before_the_tree_drops_it(tiny_models):
    engine = make_engine(tiny_models["llama"])
    generator = torch.Generator().manual_seed(3)
    prefix, nodes, later = (torch.randn(1, n, H, generator=generator) for n in (5, 7, 2))
    session = engine.open_session("s", (0, 6), 1, 64)
    run_step(engine, StepWork(session, prefix, 0))
    run_step(engine, StepWork(session, nodes, 5, tree=TokenTree(PARENTS)))
    outputs = run_step(engine, StepWork(session, later, 3))
    expected = reference_outputs(engine.span, [torch.cat([prefix[:, :3], later], 1)])[0][:, -2:]
    assert_close(outputs, expected)
    assert session.tree is None


def test_a_session_preempted_after_its_tree_recomputes_the_accepted_path(tiny_models):
    """The pool fits one of two sessions: the other session's growth takes the idle tree session's pages;
    its next step keeps the path from the inputs it kept and recomputes, with the same outputs."""
    engine = make_engine(tiny_models["llama"], page_size=4, max_cache_tokens=24)
    generator = torch.Generator().manual_seed(4)
    prefix, nodes, later = (torch.randn(1, n, H, generator=generator) for n in (6, 7, 2))
    session = engine.open_session("s", (0, 6), 1, 64)
    run_step(engine, StepWork(session, prefix, 0))
    run_step(engine, StepWork(session, nodes, 6, tree=TokenTree(PARENTS)))
    hog = engine.open_session("hog", (0, 6), 1, 64)
    run_step(engine, StepWork(hog, torch.randn(1, 2, H, generator=generator), 0))
    run_step(engine, StepWork(hog, torch.randn(1, 18, H, generator=generator), 2))  # grows into s's pages
    assert session.num_cached == 0  # preempted
    engine.close_session("hog")
    path = (0, 1, 3, 5)
    outputs = run_step(engine, StepWork(session, later, 10, accepted=path))
    expected = reference_outputs(engine.span, [torch.cat([prefix, nodes[:, list(path)], later], 1)])[0][
        :, -2:
    ]
    assert_close(outputs, expected)


def test_a_tree_larger_than_what_is_left_of_a_pass_waits_for_a_pass_of_its_own(tiny_models):
    engine = make_engine(tiny_models["llama"], max_batch_tokens=8)
    a = engine.open_session("a", (0, 6), 1, 64)
    b = engine.open_session("b", (0, 6), 1, 64)
    run_step(engine, StepWork(a, torch.randn(1, 2, H), 0))
    run_step(engine, StepWork(b, torch.randn(1, 2, H), 0))
    engine.add_step(StepWork(a, torch.randn(1, 3, H), 2))
    tree = StepWork(b, torch.randn(1, 7, H), 2, tree=TokenTree(PARENTS))
    engine.add_step(tree)
    first = engine.step()
    assert [c.outputs.shape[1] for c in first] == [3]  # 3 + 7 > 8: the tree is not split
    assert [c.outputs.shape[1] for c in engine.step()] == [7]
