"""What the engine works on: sessions (their rows' caches and inputs) and units of work.

An `EngineSession` is one inference session on this server: B rows sharing positions, a page table per
row, and the inputs it has received so far (kept so that a session preempted to free memory can rebuild
its cache by itself). A `StepWork` is one inference step of a session at an absolute position,
processed in one or more chunks; a `ForwardWork` is one cache-free forward pass and a `BackwardWork` one
backward pass (training). Derived numbers are properties, not stored fields.
"""

from __future__ import annotations

import enum
import itertools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from corolla.models.recurrent import RowStates
from corolla.models.tree import TokenTree

_ids = itertools.count()

# seconds past its announced time that a step still counts as on its way (its previous server may have failed)
ANNOUNCED_GRACE = 0.5


class SessionStatus(enum.Enum):
    WAITING = "waiting"  # no cache yet: admitted at its first step when pages are free
    RUNNING = "running"  # its cache holds every position it has received
    PREEMPTED = "preempted"  # its pages were taken back; it recomputes its cache from its inputs


@dataclass(eq=False)
class EngineSession:
    session_id: str
    start: int  # absolute block (layer) range
    end: int
    batch_size: int
    max_length: int
    adapter: str | None = None  # the LoRA adapter its steps run with
    owner: str = ""  # the peer that opened it: cache and turns are shared fairly between peers
    page_tables: list[list[int]] = field(default_factory=list)  # per row: page ids
    inputs: torch.Tensor | None = None  # [B, position, H]: the hidden states received so far
    prompts: torch.Tensor | None = None  # deep prompts [blocks, B, P, H], if the session has them
    num_cached: int = 0  # positions whose keys and values are in the cache
    status: SessionStatus = SessionStatus.WAITING
    admitted_order: int = -1  # for preemption: the most recently admitted session goes first
    last_step_at: float = float("-inf")  # monotonic time its last step completed
    last_arrival: float | None = None  # monotonic time its last step arrived
    cycle: float | None = None  # a moving average of the time between its steps' arrivals
    # its steps are announced by the server before this one (push), and its next is expected then (monotonic)
    announced: bool = False
    announced_at: float | None = None
    pending: deque[StepWork] = field(default_factory=deque)
    # the token tree its last step stored at [start, start + T), until the next step keeps one path of it
    tree: tuple[int, TokenTree] | None = None
    # per row, the recurrent states of layers that keep one (engine/states.py), holding state_position;
    # the snapshot holds its current step's start
    states: list[RowStates] = field(default_factory=list)
    state_position: int = 0
    snapshot: tuple[int, list[RowStates]] | None = None
    state_table: list[int] = field(default_factory=list)  # cache pages charged for its states

    @property
    def position(self) -> int:
        """Positions whose inputs the engine holds (what the cache is, or will be rebuilt, from)."""
        return 0 if self.inputs is None else self.inputs.shape[1]

    @property
    def num_blocks(self) -> int:
        return self.end - self.start

    def append_inputs(self, hidden: torch.Tensor) -> None:
        """Keep a step's inputs [B, T, H] (what the cache is rebuilt from after a preemption)."""
        self.inputs = hidden if self.inputs is None else torch.cat([self.inputs, hidden], dim=1)

    def drop_states(self) -> None:
        """Its cache was taken back: it recomputes its states from position 0 too."""
        self.states = []
        self.state_position = 0
        self.snapshot = None

    @property
    def needs_recompute(self) -> bool:
        return self.num_cached < self.position

    def arrive(self, now: float) -> None:
        """A step of this session arrived: its cycle is measured from its arrivals."""
        if self.last_arrival is not None:
            gap = now - self.last_arrival
            self.cycle = gap if self.cycle is None else self.cycle + 0.3 * (gap - self.cycle)
        self.last_arrival = now
        self.announced_at = None

    def announce(self, at: float) -> None:
        """The previous server of its chain started computing its next step, expected here at `at`."""
        self.announced = True
        self.announced_at = at

    def due_at(self, now: float) -> float | None:
        """When its next step is expected (None: not known yet, or it is idle: overdue by a cycle).

        A session whose steps are announced is expected only once announced, and until ANNOUNCED_GRACE past
        the announced time (a step that is late is still on its way: the previous server is computing it);
        the others, a cycle after their last step arrived."""
        if self.announced:
            if self.announced_at is None or self.announced_at < now - ANNOUNCED_GRACE:
                return None
            return max(self.announced_at, now)
        if self.cycle is None or self.last_arrival is None:
            return None
        expected = self.last_arrival + self.cycle
        return expected if expected >= now - self.cycle else None


@dataclass(eq=False)
class StepWork:
    """One step: hidden states for positions [position, position + T) of every row.

    `position` is absolute and required: the session's current position appends, an earlier one rolls
    the session back first (its later positions are dropped). The caller decides which; the engine only
    applies it. With `tree`, the step's tokens form a token tree (models/tree.py), run in one chunk; the
    session's next step keeps one path of it: `accepted` (checked by the caller), else the tree's first
    tokens up to that step's position (a chain).
    """

    session: EngineSession
    hidden: torch.Tensor  # [B, T, H], in the dtype the client sent
    position: int
    prompts: torch.Tensor | None = None
    hypo_ids: torch.Tensor | None = None
    tree: TokenTree | None = None
    accepted: tuple[int, ...] | None = None  # the path of the session's last tree to keep, root first
    admit_deadline: float = float("inf")  # monotonic time; past it, a waiting first step fails
    # called (on the loop thread) when the pass that completes it starts, with its expected seconds
    announce: Callable[[float], None] | None = None
    request_id: int = field(default_factory=lambda: next(_ids))
    arrived_at: float = field(default_factory=time.monotonic)
    done_tokens: int = 0
    started: bool = False  # rollback and reordering are applied once, when the first chunk is scheduled
    outputs: list[torch.Tensor] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return self.hidden.shape[1]

    @property
    def remaining(self) -> int:
        return self.num_tokens - self.done_tokens


@dataclass(frozen=True, slots=True)
class Gradients:
    """The result of a backward pass: gradients wrt the span's inputs [B, T, H] and its deep prompts
    (in the shape they were sent, or None without prompts)."""

    inputs: torch.Tensor
    prompts: torch.Tensor | None = None


@dataclass(eq=False)
class ForwardWork:
    """A cache-free forward pass over `blocks` (rpc_forward); its result is the outputs [B, T, H]."""

    hidden: torch.Tensor  # [B, T, H]
    blocks: tuple[int, int]
    prompts: torch.Tensor | None = None
    adapter: str | None = None  # the LoRA adapter to run with
    request_id: int = field(default_factory=lambda: next(_ids))
    arrived_at: float = field(default_factory=time.monotonic)
    done_rows: int = 0  # rows run so far: big requests run a slice of rows at a time, between inference
    results: list = field(default_factory=list)  # each slice's result

    def rows(self, first: int, end: int) -> ForwardWork:
        """The same work for rows [first, end) only."""
        return ForwardWork(self.hidden[first:end], self.blocks, self._prompt_rows(first, end), self.adapter)

    def _prompt_rows(self, first: int, end: int) -> torch.Tensor | None:
        prompts = self.prompts
        if prompts is not None and prompts.shape[1] != 1:  # [blocks, 1, P, H] is shared by every row
            prompts = prompts[:, first:end]
        return prompts

    def result(self) -> torch.Tensor:
        return torch.cat(self.results)


@dataclass(eq=False, kw_only=True)
class BackwardWork(ForwardWork):
    """A backward pass (rpc_backward): the forward recomputed with autograd, then the gradients of
    sum(outputs * grad_outputs); its result is `Gradients`."""

    grad_outputs: torch.Tensor  # [B, T, H]

    def rows(self, first: int, end: int) -> BackwardWork:
        return BackwardWork(
            hidden=self.hidden[first:end],
            blocks=self.blocks,
            prompts=self._prompt_rows(first, end),
            adapter=self.adapter,
            grad_outputs=self.grad_outputs[first:end],
        )

    def result(self) -> Gradients:
        grad_inputs = torch.cat([g.inputs for g in self.results])
        grad_prompts = None
        if self.prompts is not None:
            parts = [g.prompts for g in self.results]
            grad_prompts = sum(parts) if self.prompts.shape[1] == 1 else torch.cat(parts, dim=1)
        return Gradients(grad_inputs, grad_prompts)


@dataclass(frozen=True, slots=True)
class Chunk:
    """Part of a session's work in one pass: `num_tokens` positions from `position`, for every row.

    `work` is None for a recompute chunk (rebuilding a preempted session's cache from its inputs).
    """

    session: EngineSession
    work: StepWork | None
    position: int
    num_tokens: int

    @property
    def num_rows(self) -> int:
        return self.session.batch_size


@dataclass(frozen=True, slots=True)
class Completion:
    """The result of one request (outputs [B, T, H], or Gradients of a backward pass), or its error."""

    request_id: int
    outputs: torch.Tensor | Gradients | None = None
    error: Exception | None = None
