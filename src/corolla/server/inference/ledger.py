"""The step ledger of one inference session: which steps it has taken, and which it has replied to.

With push, a step can reach a server twice: pushed by the previous server and sent by the client. A step
is identified by its session, its `step_id`, its position and its inputs together (their digest,
wire/digest.py), so the ledger can tell a second copy of a step (run nothing, reply nothing more) from a
different step that reuses an id (never trusted as the same step): a pushed copy that reuses a taken id
is refused, the client's copy of a step whose pushed copy differed runs again (the session's owner
decides what its cache holds), and a client reusing one of its own step ids for other inputs gets an
error. Each step gets exactly one reply, whichever copy ran it; a step id gets a second reply only when
the client's copy ran after a pushed copy with other inputs had its reply, and each reply names the
inputs it ran (the client takes the one to its own). Only the most recent steps are remembered: a copy
can lag behind its twin by a step or two, never by REMEMBERED_STEPS.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

REMEMBERED_STEPS = 8


@dataclass
class TakenStep:
    position: int
    inputs: bytes  # their digest (wire/digest.py)
    run: int  # which run of this step id replies (a client's copy can supersede a pushed one)
    pushed: bool  # the copy that ran was pushed here (not the client's own)
    replied: bool = False


class StepLedger:
    def __init__(self) -> None:
        self._steps: OrderedDict[str, TakenStep] = OrderedDict()
        self._runs = 0

    def is_second_copy(self, step_id: str | None, position: int | None, inputs: bytes) -> bool:
        """Whether this is another copy of a step already taken: same id, same inputs, and the same
        position (or none named). Such a copy runs nothing and gets no reply of its own."""
        taken = self._steps.get(step_id) if step_id else None
        return taken is not None and taken.inputs == inputs and position in (None, taken.position)

    def conflicts(self, step_id: str | None, *, with_clients_copy: bool = False) -> bool:
        """Whether `step_id` names a step already taken (with other inputs or at another position, when
        `is_second_copy` said no); with `with_clients_copy`, only a step whose client's copy ran."""
        taken = self._steps.get(step_id) if step_id else None
        return taken is not None and not (with_clients_copy and taken.pushed)

    def take(self, step_id: str | None, position: int, inputs: bytes, pushed: bool = False) -> int:
        """Record a step that runs now; returns its run number (which its completion must name)."""
        self._runs += 1
        if step_id:
            self._steps[step_id] = TakenStep(position, inputs, self._runs, pushed)
            self._steps.move_to_end(step_id)
            while len(self._steps) > REMEMBERED_STEPS:
                self._steps.popitem(last=False)
        return self._runs

    def claim_reply(self, step_id: str | None, run: int) -> bool:
        """Whether the completed run `run` of this step is the one to reply with (once per step)."""
        if not step_id:
            return True
        taken = self._steps.get(step_id)
        if taken is None:
            return True  # forgotten already: a reply too many is skipped by the client, a missing one hangs
        if taken.run != run or taken.replied:
            return False  # superseded by a later copy of the step, or already replied to
        taken.replied = True
        return True
