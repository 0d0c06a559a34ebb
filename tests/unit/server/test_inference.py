"""The inference service without sockets: a real engine on a tiny model, steps fed as typed messages.

Each test opens one session (as rpc_inference would), sends the client's steps, pushes steps as the
previous server of a chain would, and checks what is replied and what the cache holds: every output
must equal a plain forward pass with a contiguous cache over the steps that should have run.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import replace

import pytest
import torch

from corolla.errors import InvalidRequest, ServerUnavailable
from corolla.server.inference.service import PIPELINE_DEPTH, StepMessage
from corolla.wire import tensors as wire_tensors
from corolla.wire.digest import step_digest
from corolla.wire.messages import NextServer
from engine_helpers import assert_close, reference_outputs
from service_helpers import CLIENT, PREVIOUS, UID, H, Session, inputs, message


async def test_a_step_pushed_before_the_clients_copy_runs_once_and_replies_at_once(service):
    first, second = inputs(0, 5, 1)
    session = Session(service, message(first, "a", 0, first=True))
    assert (await session.reply())[0] == "a"
    service.take_push(message(second, "b", 5, pushed=True), PREVIOUS)
    step_id, outputs = await session.reply()  # before the client has sent its own copy
    assert step_id == "b"
    await session.steps.put(message(second, "b", 5))  # the client's copy: nothing runs, no second reply
    assert await session.close() == []
    assert (service.steps_from_client, service.steps_from_push) == (1, 1)
    assert_close(outputs, reference_outputs(service.spans.primary.span, [first, second])[1])


async def test_a_second_copy_of_a_step_runs_nothing_and_replies_nothing(service):
    first, second = inputs(1, 3, 2)
    session = Session(service, message(first, "a", 0, first=True))
    await session.reply()
    await session.steps.put(message(second, "b", 3))
    await session.reply()
    service.take_push(
        message(second, "b", 3, pushed=True), PREVIOUS
    )  # a late push of "b": stale position, skipped
    await session.steps.put(message(second, "b", 3))  # the client's copy again: a second copy
    assert await session.close() == []  # no reply of its own
    assert service.steps_from_client == 2 and service.steps_from_push == 0


async def test_rollback_to_an_earlier_position(service):
    first, second, third = inputs(2, 6, 1, 2)
    session = Session(service, message(first, "a", 0, first=True))
    await session.reply()
    await session.steps.put(message(second, "b", 6))
    await session.reply()
    await session.steps.put(message(third, "c", 4))  # positions 4 and 5 again, 6 is dropped
    _, outputs = await session.reply()
    await session.close()
    span = service.spans.primary.span
    expected = reference_outputs(span, [first, second, third], rollbacks=[None, None, 4])
    assert_close(outputs, expected[2])


async def test_a_late_reply_to_an_abandoned_step_then_the_next_step_rolls_back(service):
    """The client gave up on step "x" after the first server, which still pushed it here: it runs and
    its reply goes out. The client's next step, at the same position, must replace it."""
    first, abandoned, honest = inputs(3, 4, 1, 1)
    session = Session(service, message(first, "a", 0, first=True))
    await session.reply()
    service.take_push(message(abandoned, "x", 4, pushed=True), PREVIOUS)
    assert (await session.reply())[0] == "x"
    await session.steps.put(message(honest, "y", 4))
    step_id, outputs = await session.reply()
    await session.close()
    assert step_id == "y"
    assert_close(outputs, reference_outputs(service.spans.primary.span, [first, honest])[1])


@pytest.mark.parametrize(
    ("step", "error"),
    [
        (lambda h: message(h, "b", 9), "start_from_position=9 is after the session's current position 3"),
        (lambda h: message(torch.randn(1, 30, H), "b", 3), "goes past the session's max_length=32"),
        (lambda h: message(torch.randn(2, 1, H), "b", 3), "batch size 2 differs from the session's 1"),
    ],
)
async def test_position_and_shape_errors_refuse_the_step_naming_the_field_and_the_session_goes_on(
    service, step, error
):
    (first, later) = inputs(4, 3, 1)
    session = Session(service, message(first, "a", 0, first=True))
    await session.reply()
    await session.steps.put(step(later))
    refused = await asyncio.wait_for(anext(session.replies), 10)
    assert refused.step_id == "b" and refused.outputs is None and error in refused.refused
    await session.steps.put(message(later, "c", 3))
    step_id, outputs = await session.reply()
    await session.close()
    assert step_id == "c"
    assert_close(outputs, reference_outputs(service.spans.primary.span, [first, later])[1])


async def test_garbage_pushes_right_after_an_honest_step_change_nothing(service):
    """A push is taken only at the session's position, and an honest step moves that position in the
    very turn it is taken: a push aimed at the position the step is running at can never join it."""
    first, *decodes = inputs(5, 4, 1, 1, 1)
    session = Session(service, message(first, "a", 0, first=True))
    await session.reply()
    outputs, state = [], service.spans.find_session(CLIENT, "s")
    for i, hidden in enumerate(decodes):
        position = 4 + i
        await session.steps.put(message(hidden, f"d{i}", position))
        replying = asyncio.ensure_future(session.reply())
        while not state.num_unreported:  # until the honest step is taken; the engine runs it meanwhile
            await asyncio.sleep(0)
        for garbage in range(3):  # aimed at the step's own position: stale now, skipped
            service.take_push(
                message(torch.randn(1, 1, H) * 100, f"g{i}{garbage}", position, pushed=True), PREVIOUS
            )
        step_id, output = await replying
        assert step_id == f"d{i}"
        outputs.append(output)
    await session.close()
    expected = reference_outputs(service.spans.primary.span, [first, *decodes])
    for actual, reference in zip(outputs, expected[1:], strict=True):
        assert_close(actual, reference)
    assert service.steps_from_push == 0


async def test_a_step_id_is_never_trusted_for_other_inputs(service):
    first, second, other = inputs(6, 3, 1, 1)
    session = Session(service, message(first, "a", 0, first=True))
    await session.reply()
    await session.steps.put(message(second, "b", 3))
    await session.reply()
    # a pushed copy naming "b" at the session's position with other inputs is refused, with an error
    with pytest.raises(InvalidRequest, match="step_id 'b' was already taken here with other inputs"):
        service.take_push(message(other, "b", 4, pushed=True), PREVIOUS)
    # the owner reusing "b" for another step gets an error reply (it used to be dropped without one); the
    # step never ran, and the session goes on
    await session.steps.put(message(other, "b", 4))
    refused = await asyncio.wait_for(anext(session.replies), 10)
    assert "step_id 'b' was already used by this session" in refused.refused
    await session.steps.put(message(other, "c", 4))
    _, outputs = await session.reply()
    await session.close()
    assert_close(outputs, reference_outputs(service.spans.primary.span, [first, second, other])[2])


async def test_pushes_count_only_from_the_named_previous_hop_for_the_sessions_owner(service):
    """Session ids are no secret: a push naming one must come from the peer the owner named as its
    previous hop, relaying that same owner's chain, or it has no effect."""
    first, hostile, honest = inputs(11, 3, 1, 1)
    session = Session(service, message(first, "a", 0, first=True))
    await session.reply()
    service.take_push(message(hostile, "x1", 3, pushed=True), "attacker-peer")  # not the named hop
    relayed = message(hostile, "x2", 3, pushed=True)  # the named hop, relaying another client's chain
    relayed = StepMessage(relayed.uid, replace(relayed.meta, origin="attacker-peer"), relayed.tensors)
    service.take_push(relayed, PREVIOUS)
    state = service.spans.find_session(CLIENT, "s")
    assert state.position == 3 and state.num_unreported == 0  # neither ran
    with pytest.raises(InvalidRequest, match="hidden_states only"):
        prompts = wire_tensors.serialize(torch.zeros(6, 1, 1, H))
        service.take_push(StepMessage(UID, relayed.meta, [relayed.tensors[0], prompts]), PREVIOUS)
    await session.steps.put(message(honest, "b", 3))
    step_id, outputs = await session.reply()
    await session.close()
    assert step_id == "b" and service.steps_from_push == 0
    assert_close(outputs, reference_outputs(service.spans.primary.span, [first, honest])[1])


async def test_another_peer_naming_a_session_id_gets_a_session_of_its_own(service):
    first, other, second = inputs(12, 3, 2, 1)
    victim = Session(service, message(first, "a", 0, first=True))
    await victim.reply()
    intruder = Session(service, message(other, "i", 0, first=True), owner="attacker-peer")
    await intruder.reply()  # its own session "s": a fresh cache, nothing of the victim's
    assert service.spans.find_session("attacker-peer", "s").position == 2
    await victim.steps.put(message(second, "b", 3))
    _, outputs = await victim.reply()
    await victim.close(), await intruder.close()
    assert_close(outputs, reference_outputs(service.spans.primary.span, [first, second])[1])


async def test_next_servers_must_lie_within_the_model(service):
    (first,) = inputs(13, 2)
    hop = NextServer("next-peer", "next-session", 0, 2_000_000)
    with pytest.raises(InvalidRequest, match=r"next_servers\[0\]: blocks 0:2000000 lie outside"):
        await anext(Session(service, message(first, "a", 0, first=True, next_servers=(hop,))).replies)
    assert service.spans.num_sessions == 0


async def test_a_session_takes_only_a_few_steps_ahead_of_its_replies(service):
    """Steps sent all at once are taken at most PIPELINE_DEPTH ahead of their replies: the rest wait in
    the stream, so one client cannot queue unbounded work."""
    first, *later = inputs(14, 2, *[1] * 12)
    service.spans.primary.engine.pass_delay = 0.05  # replies come slower than steps
    session = Session(service, message(first, "a", 0, first=True))
    for i, hidden in enumerate(later):
        await session.steps.put(message(hidden, f"s{i}", 2 + i))

    async def read_all():
        return [await session.reply() for _ in range(len(later) + 1)]

    replies = asyncio.ensure_future(read_all())
    most = 0
    while not replies.done():
        state = service.spans.find_session(CLIENT, "s")
        most = max(most, state.num_unreported if state is not None else 0)
        await asyncio.sleep(0)
    await session.close()
    assert [step_id for step_id, _ in replies.result()] == ["a", *[f"s{i}" for i in range(len(later))]]
    assert 1 <= most <= PIPELINE_DEPTH


async def test_the_owners_copy_supersedes_a_pushed_copy_with_other_inputs(service):
    """A pushed copy of "b" ran first; the client's copy of "b" at the same position differs (its previous
    server failed over, or the pusher lied): the client's copy is what the cache must hold."""
    first, pushed, owners, after = inputs(7, 3, 1, 1, 1)
    session = Session(service, message(first, "a", 0, first=True))
    await session.reply()
    service.take_push(message(pushed, "b", 3, pushed=True), PREVIOUS)
    await session.reply()
    await session.steps.put(message(owners, "b", 3))
    await session.reply()  # the rerun's reply (skipped by a client that already read the first one)
    await session.steps.put(message(after, "c", 4))
    _, outputs = await session.reply()
    await session.close()
    assert_close(outputs, reference_outputs(service.spans.primary.span, [first, owners, after])[2])


async def test_each_reply_names_the_position_and_the_inputs_it_ran(service):
    """A forged push of "b" runs and replies before the owner's copy arrives; the owner's copy runs too.
    Each reply names what it ran, so the client takes the one to its own inputs; an honest push's reply
    names the client's inputs (the same bytes), and the client's copy then runs nothing."""
    first, forged, owners, honest = inputs(15, 3, 1, 1, 1)
    session = Session(service, message(first, "a", 0, first=True))
    assert (await anext(session.replies)).inputs == step_digest(message(first).tensors).hex()
    service.take_push(message(forged, "b", 3, pushed=True), PREVIOUS)
    forged_reply = await asyncio.wait_for(anext(session.replies), 10)
    await session.steps.put(message(owners, "b", 3))
    owners_reply = await asyncio.wait_for(anext(session.replies), 10)
    service.take_push(message(honest, "c", 4, pushed=True), PREVIOUS)
    honest_reply = await asyncio.wait_for(anext(session.replies), 10)
    await session.steps.put(message(honest, "c", 4))
    assert await session.close() == []  # one reply for "c"
    assert (forged_reply.step_id, forged_reply.position) == ("b", 3)
    assert forged_reply.inputs == step_digest(message(forged).tensors).hex()
    assert (owners_reply.step_id, owners_reply.position) == ("b", 3)
    assert owners_reply.inputs == step_digest(message(owners).tensors).hex()
    assert (honest_reply.position, honest_reply.inputs) == (4, step_digest(message(honest).tensors).hex())
    expected = reference_outputs(service.spans.primary.span, [first, owners, honest])
    assert_close(wire_tensors.deserialize(owners_reply.outputs, "outputs"), expected[1])
    assert_close(wire_tensors.deserialize(honest_reply.outputs, "outputs"), expected[2])


async def test_a_pushed_copy_without_the_clients_beam_order_is_not_its_twin(service):
    """The previous hop pushes the step's hidden states as they are, but the client's copy also reorders
    the beams (hypo_ids): the pushed copy ran something else, so the client's copy runs and replies too."""
    generator = torch.Generator().manual_seed(16)
    first, second = torch.randn(2, 3, H, generator=generator), torch.randn(2, 1, H, generator=generator)
    session = Session(service, message(first, "a", 0, first=True))
    await session.reply()
    service.take_push(message(second, "b", 3, pushed=True), PREVIOUS)
    await session.reply()
    own = message(second, "b", 3)
    hypo_ids = torch.tensor([1, 0])
    tensors = [own.tensors[0], wire_tensors.empty(), wire_tensors.serialize(hypo_ids)]
    await session.steps.put(StepMessage(UID, own.meta, tensors))
    reply = await asyncio.wait_for(anext(session.replies), 10)
    await session.close()
    assert reply.inputs == step_digest(tensors).hex()
    expected = reference_outputs(service.spans.primary.span, [first, second], hypo_ids=[None, hypo_ids])
    assert_close(wire_tensors.deserialize(reply.outputs, "outputs"), expected[1])


async def test_pushes_go_on_before_the_reply(service):
    first, second = inputs(8, 2, 1)
    hop = NextServer("next-peer", "next-session", 6, 8)
    session = Session(service, message(first, "a", 0, first=True))
    await session.reply()
    await session.steps.put(message(second, "b", 2, next_servers=(hop,)))
    await session.reply()
    assert service.pusher.pushed == [("b", 2)]
    await session.close()


async def test_a_step_is_announced_to_the_next_server_as_its_pass_starts(service):
    first, second = inputs(8, 2, 1)
    hop = NextServer("next-peer", "next-session", 6, 8)
    session = Session(service, message(first, "a", 0, first=True))
    await session.reply()
    assert service.pusher.announced == []  # a step with no next server announces nothing
    await session.steps.put(message(second, "b", 2, next_servers=(hop,)))
    await session.reply()
    ((step_id, position, due_in),) = service.pusher.announced
    assert (step_id, position) == ("b", 2) and due_in > 0  # the engine's measured pass time
    await session.close()


async def test_announcements_from_the_named_previous_hop_tell_the_engine_when_the_next_step_comes(service):
    """A push without tensors announces the session's next step (engine/batching.py): taken only from
    the previous hop its owner named, for the position where the session stands; nothing runs."""
    first, second = inputs(9, 3, 1)
    session = Session(service, message(first, "a", 0, first=True))
    await session.reply()
    state = service.spans.find_session(CLIENT, "s")

    def announcement(position, **meta):
        step = message(first, "b", position, pushed=True, **meta)
        return StepMessage(UID, replace(step.meta, due_in=0.5), [])

    async def announced_at():
        return await state.engine.call(lambda: state.engine_session.announced_at)

    service.take_push(announcement(3), "attacker-peer")  # not the named hop
    service.take_push(announcement(2), PREVIOUS)  # not where the session stands
    assert await announced_at() is None and not state.engine_session.announced
    before = time.monotonic()
    service.take_push(announcement(3), PREVIOUS)
    assert before + 0.5 <= await announced_at() <= time.monotonic() + 0.5
    assert state.position == 3 and state.num_unreported == 0  # nothing ran
    service.take_push(message(second, "b", 3, pushed=True), PREVIOUS)  # the step itself
    step_id, outputs = await session.reply()
    assert step_id == "b" and await announced_at() is None  # it came: no longer expected
    await session.close()
    assert_close(outputs, reference_outputs(service.spans.primary.span, [first, second])[1])


async def test_a_step_that_fails_in_the_engine_ends_the_session(service):
    first, second = inputs(9, 2, 1)
    session = Session(service, message(first, "a", 0, first=True))
    await session.reply()
    runner = service.spans.primary.engine.engine.runner
    real_run = runner.run
    runner.run = lambda chunks: (_ for _ in ()).throw(RuntimeError("boom"))
    try:
        await session.steps.put(message(second, "b", 2))
        with pytest.raises(ServerUnavailable, match="RuntimeError: boom"):
            await session.reply()
    finally:
        runner.run = real_run
    assert service.spans.num_sessions == 0


async def test_the_end_of_the_clients_stream_still_replies_to_the_steps_taken(service):
    (first,) = inputs(10, 7)
    session = Session(service, message(first, "a", 0, first=True))
    await session.steps.put(None)  # the client sends one step and closes its side at once
    replies = [r async for r in session.replies]
    assert [r.step_id for r in replies] == ["a"]


async def test_epochs_a_pushed_rollback_opens_one_and_frames_of_older_or_unopened_epochs_run_nothing(service):
    """Pipelined frames (client/chain/frames.py): a stale frame "s" ran by push; the next epoch's second
    frame "f" is pushed ahead of the rollback "r" that opens it, at the very position "s" left the session:
    it must not run there (it would attend to the stale frame's keys). The rollback is taken from its
    push; the client's late copy of "s" gets a skipped reply and runs nothing; "f" runs from its client
    copy, on the rolled-back cache."""
    first, stale, root, later = inputs(11, 4, 1, 1, 2)
    session = Session(service, message(first, "a", 0, first=True))
    await session.reply()
    service.take_push(message(stale, "s", 4, pushed=True), PREVIOUS)
    assert (await session.reply())[0] == "s"
    service.take_push(message(later, "f", 5, pushed=True, epoch=1), PREVIOUS)  # its epoch is not open here
    service.take_push(message(root, "r", 4, pushed=True, epoch=1, opens_epoch=True), PREVIOUS)
    assert (await session.reply())[0] == "r"
    await session.steps.put(message(stale, "s", 4))  # the client's copy, sent before it knew
    skipped = await asyncio.wait_for(anext(session.replies), 10)
    assert skipped.step_id == "s" and skipped.skipped and skipped.outputs is None
    service.take_push(message(stale, "s2", 6, pushed=True), PREVIOUS)  # a push of the dropped epoch
    await session.steps.put(message(root, "r", 4, epoch=1, opens_epoch=True))  # a second copy: no reply
    await session.steps.put(message(later, "f", 5, epoch=1))
    step_id, outputs = await session.reply()
    assert await session.close() == []
    assert step_id == "f"
    assert (service.steps_from_client, service.steps_from_push) == (2, 2)  # "a", "f"; "s", "r"
    expected = reference_outputs(service.spans.primary.span, [first, root, later])
    assert_close(outputs, expected[2])


async def test_a_pushed_rollback_is_taken_only_when_it_opens_a_later_epoch_at_a_position_held(service):
    first, second, again = inputs(12, 3, 2, 1)
    session = Session(service, message(first, "a", 0, first=True))
    await session.reply()
    await session.steps.put(message(second, "b", 3))
    await session.reply()
    service.take_push(message(again, "x", 2, pushed=True), PREVIOUS)  # a rollback in the same epoch
    service.take_push(message(again, "y", 6, pushed=True, epoch=1, opens_epoch=True), PREVIOUS)  # a gap
    await session.steps.put(message(again, "z", 2, epoch=1, opens_epoch=True))
    step_id, outputs = await session.reply()
    assert await session.close() == []
    assert step_id == "z" and service.steps_from_push == 0
    expected = reference_outputs(
        service.spans.primary.span, [first, second, again], rollbacks=[None, None, 2]
    )
    assert_close(outputs, expected[2])


async def test_a_rollback_drops_the_frames_of_the_epoch_it_ends_that_have_not_run(service):
    """Pipelined frames still queued behind a busy engine when the rollback ending their epoch arrives are
    dropped unrun: their replies say skipped, and the rollback runs on what the frames before them left."""
    first, ran, queued, more, root = inputs(13, 4, 2, 2, 2, 1)
    session = Session(service, message(first, "a", 0, first=True))
    await session.reply()
    await session.steps.put(message(ran, "f1", 4))
    assert (await session.reply())[0] == "f1"
    hold, holding = threading.Event(), threading.Event()

    def busy():
        holding.set()
        hold.wait()

    held = asyncio.ensure_future(service.spans.primary.engine.call(busy))  # steps queue behind it
    while not holding.is_set():  # the engine is busy before the frames arrive (a loaded machine's too)
        await asyncio.sleep(0.01)

    async def three():
        return [await anext(session.replies) for _ in range(3)]

    replies = asyncio.ensure_future(three())
    await session.steps.put(message(queued, "f2", 6))
    await session.steps.put(message(more, "f3", 8))
    await session.steps.put(message(root, "r", 5, epoch=1, opens_epoch=True))  # f1's 2nd token rejected
    taken = service.spans.find_session(CLIENT, "s")
    while taken.num_unreported < 3:
        await asyncio.sleep(0.01)
    hold.set()
    await held
    got = await asyncio.wait_for(replies, 10)
    assert [(r.step_id, r.skipped) for r in got] == [("f2", True), ("f3", True), ("r", False)]
    assert service.frames_dropped == 2
    expected = reference_outputs(service.spans.primary.span, [first, ran, root], rollbacks=[None, None, 5])
    assert_close(wire_tensors.deserialize(got[2].outputs, "outputs"), expected[2])
    assert await session.close() == []
