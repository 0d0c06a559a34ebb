"""One step of an inference session as the server sees it: off the wire, then checked against its session."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TypeVar

import torch
from hivemind.proto import runtime_pb2

from corolla.errors import SessionTimeout
from corolla.wire.messages import InferenceStep

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class StepMessage:
    """One step as it came off the wire: the blocks it names, its metadata and its tensors."""

    uid: str
    meta: InferenceStep
    tensors: list[runtime_pb2.Tensor]


@dataclass(frozen=True, slots=True)
class StepInputs:
    """A step checked against its session: what the engine runs."""

    hidden: torch.Tensor  # [B, T, H]
    position: int  # absolute position of its first token
    prompts: torch.Tensor | None
    hypo_ids: torch.Tensor | None
    digest: bytes

    @property
    def length(self) -> int:
        return self.hidden.shape[1]


async def next_within(messages: AsyncIterator[T], timeout: float) -> T | None:
    """The next message of a session's stream (None at its end), or SessionTimeout after `timeout`."""
    try:
        return await asyncio.wait_for(anext(messages), timeout)
    except StopAsyncIteration:
        return None
    except (asyncio.TimeoutError, TimeoutError):
        raise SessionTimeout(f"no request arrived within step_timeout={timeout:.1f}s") from None
