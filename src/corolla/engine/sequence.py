"""What the engine works on: sessions (their rows' caches and inputs) and units of work.

An `EngineSession` is one inference session on this server: B rows sharing positions, a block table per
row, and the inputs it has received so far (kept so that a session preempted to free memory can rebuild
its cache by itself). A `StepWork` is one `rpc_inference` step of a session, processed in one or more
chunks; a `ForwardWork` is one `rpc_forward` request. Derived numbers are properties, not stored fields.
"""

from __future__ import annotations

import enum
import itertools
import time
from collections import deque
from dataclasses import dataclass, field

import torch

_ids = itertools.count()


class SessionStatus(enum.Enum):
    WAITING = "waiting"  # no cache yet: admitted at its first step when blocks are free
    RUNNING = "running"  # its cache holds every position it has received
    PREEMPTED = "preempted"  # its blocks were taken back; it recomputes its cache from its inputs


@dataclass(eq=False)
class EngineSession:
    session_id: str
    start: int  # absolute block range
    end: int
    batch_size: int
    max_length: int
    adapter: str | None = None  # the LoRA adapter its steps run with
    tables: list[list[int]] = field(default_factory=list)  # per row: block ids
    inputs: torch.Tensor | None = None  # [B, position, H]: the hidden states received so far
    prompts: torch.Tensor | None = None  # deep prompts [blocks, B, P, H], if the session has them
    num_cached: int = 0  # positions whose keys and values are in the cache
    status: SessionStatus = SessionStatus.WAITING
    admitted_order: int = -1  # for preemption: the most recently admitted session goes first
    last_step_at: float = float("-inf")  # monotonic time its last step completed
    pending: deque[StepWork] = field(default_factory=deque)

    @property
    def position(self) -> int:
        return 0 if self.inputs is None else self.inputs.shape[1]

    @property
    def num_blocks(self) -> int:
        return self.end - self.start

    @property
    def needs_recompute(self) -> bool:
        return self.num_cached < self.position


@dataclass(eq=False)
class StepWork:
    session: EngineSession
    hidden: torch.Tensor  # [B, T, H], in the dtype the client sent
    prompts: torch.Tensor | None = None
    hypo_ids: torch.Tensor | None = None
    start_from_position: int | None = None
    admit_deadline: float = float("inf")  # monotonic time; past it, a waiting first step fails
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


@dataclass(eq=False)
class ForwardWork:
    """A cache-free pass over `blocks` (rpc_forward); with `grad_outputs`, a backward pass (rpc_backward)
    whose result is (grad wrt hidden, grad wrt prompts or None)."""

    hidden: torch.Tensor  # [B, T, H]
    blocks: tuple[int, int]
    prompts: torch.Tensor | None = None
    grad_outputs: torch.Tensor | None = None  # [B, T, H]
    adapter: str | None = None  # the LoRA adapter to run with
    request_id: int = field(default_factory=lambda: next(_ids))
    arrived_at: float = field(default_factory=time.monotonic)
    done_rows: int = 0  # rows run so far: big requests run a slice of rows at a time, between inference
    results: list = field(default_factory=list)  # each slice's result

    def rows(self, first: int, end: int) -> ForwardWork:
        """The same work for rows [first, end) only."""
        prompts = self.prompts
        if prompts is not None and prompts.shape[1] != 1:
            prompts = prompts[:, first:end]
        grad = None if self.grad_outputs is None else self.grad_outputs[first:end]
        return ForwardWork(self.hidden[first:end], self.blocks, prompts, grad, self.adapter, self.request_id)


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
    """The result of one request: outputs [B, T, H], or the error that ended it."""

    request_id: int
    outputs: torch.Tensor | None = None
    error: Exception | None = None
