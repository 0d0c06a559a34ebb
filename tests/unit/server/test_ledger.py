"""The step ledger: a step is its id, position and inputs together; each step gets one reply."""

import torch

from corolla.server.inference.ledger import REMEMBERED_STEPS, StepLedger
from corolla.wire import tensors as wire_tensors
from corolla.wire.digest import step_digest


def test_a_second_copy_is_the_same_id_inputs_and_position():
    ledger = StepLedger()
    inputs = step_digest([wire_tensors.serialize(torch.ones(1, 2, 4))])
    other = step_digest([wire_tensors.serialize(torch.zeros(1, 2, 4))])
    assert inputs != other
    run = ledger.take("s1", 5, inputs)
    assert ledger.is_second_copy("s1", 5, inputs) and ledger.is_second_copy("s1", None, inputs)
    assert not ledger.is_second_copy("s1", 6, inputs)  # another position: another step
    assert not ledger.is_second_copy("s1", 5, other)  # other inputs: another step
    assert not ledger.is_second_copy(None, 5, inputs) and not ledger.is_second_copy("s2", 5, inputs)
    assert ledger.conflicts("s1") and not ledger.conflicts("s2") and not ledger.conflicts(None)
    assert ledger.claim_reply("s1", run) and not ledger.claim_reply("s1", run)  # one reply per step


def test_a_later_run_of_a_step_id_supersedes_the_earlier_one():
    ledger = StepLedger()
    first = ledger.take("s1", 5, b"a")
    second = ledger.take("s1", 5, b"b")
    assert not ledger.claim_reply("s1", first)  # the earlier run completes late: no reply
    assert ledger.claim_reply("s1", second)


def test_steps_without_an_id_always_reply_and_old_steps_are_forgotten():
    ledger = StepLedger()
    assert ledger.claim_reply(None, ledger.take(None, 0, b"x"))
    for i in range(REMEMBERED_STEPS + 1):
        ledger.take(f"s{i}", i, b"x")
    assert not ledger.conflicts("s0") and ledger.conflicts(f"s{REMEMBERED_STEPS}")


def test_the_digest_covers_what_changes_a_steps_outputs():
    """Each tensor (hidden states, deep prompts, beam order), the token tree and the kept path."""
    hidden = wire_tensors.serialize(torch.ones(1, 2, 4))
    hypo_ids = wire_tensors.serialize(torch.tensor([0]))
    base = step_digest([hidden])
    assert step_digest([wire_tensors.serialize(torch.ones(1, 2, 4))]) == base  # the same bytes
    others = [
        step_digest([wire_tensors.serialize(torch.ones(1, 4, 2))]),  # the same values, another shape
        step_digest([wire_tensors.serialize(torch.ones(1, 2, 4, dtype=torch.float16))]),
        step_digest([hidden, wire_tensors.empty(), hypo_ids]),
        step_digest([hidden], tree=(-1, 0)),
        step_digest([hidden], tree=(-1, -1)),
        step_digest([hidden], accepted=(0,)),
        step_digest([hidden], accepted=()),
    ]
    assert len({base, *others}) == len(others) + 1
    assert step_digest([hidden], tree=[-1, 0], accepted=[1]) == step_digest([hidden], (-1, 0), (1,))
