"""One step of an inference session as the server sees it: off the wire, then checked against its session.

`read_inputs` checks a step against its session without changing anything (tensors, batch, position,
max_length, deep prompts, beam reordering, and the token tree and the path of the previous one it
keeps), so a step that fails a check can be refused while the session goes on.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TypeVar

import torch
from hivemind.proto import runtime_pb2

from corolla.config import ServerConfig
from corolla.errors import InvalidRequest, SessionTimeout
from corolla.models.handoff import WireLayout
from corolla.models.tree import TokenTree
from corolla.server import validation
from corolla.server.inference.sessions import ServerSession
from corolla.wire import tensors as wire_tensors
from corolla.wire.messages import InferenceStep

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class StepMessage:
    """One step as it came off the wire: the blocks it names, its metadata and its tensors; `refused`: why
    its metadata failed the wire's checks (then `meta` holds only its step_id, and the step is refused)."""

    uid: str
    meta: InferenceStep
    tensors: list[runtime_pb2.Tensor]
    refused: InvalidRequest | None = None


@dataclass(frozen=True, slots=True)
class StepInputs:
    """A step checked against its session: what the engine runs."""

    hidden: torch.Tensor  # [B, T, H]
    position: int  # absolute position of its first token
    prompts: torch.Tensor | None
    hypo_ids: torch.Tensor | None
    digest: bytes
    tree: TokenTree | None = None  # the step's tokens form this tree (speculative decoding)
    accepted: tuple[int, ...] | None = None  # the path of the session's last tree the step keeps

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


def read_inputs(
    session: ServerSession,
    step: StepMessage,
    inputs_digest: bytes,
    sizes: tuple[int, int],
    config: ServerConfig,
    hidden: torch.Tensor | None = None,
    wire: WireLayout | None = None,
) -> StepInputs:
    """Check a step's tensors, position and tree against its session (nothing here changes the session);
    `sizes`: the widths of hidden states on the wire and of deep prompts; `wire`: its layout, where the
    token ids it carries are checked."""
    tensors = step.tensors
    width, prompt_size = sizes
    if hidden is None:
        hidden = validation.read_hidden(tensors, width, config.max_batch_size, wire=wire)
    batch, length = hidden.shape[:2]
    if batch != session.batch_size:
        raise InvalidRequest(
            f"hidden_states: batch size {batch} differs from the session's {session.batch_size}"
        )
    position = step.meta.start_from_position
    position = session.position if position is None else position
    if position > session.position:
        raise InvalidRequest(
            f"start_from_position={position} is after the session's current position {session.position}"
        )
    if position + length > session.max_length:
        raise InvalidRequest(
            f"step of {length} tokens at position {position} goes past the session's "
            f"max_length={session.max_length}"
        )
    num_blocks = session.end - session.start
    prompts = validation.read_prompts(tensors, num_blocks, batch, prompt_size, session.max_length)
    hypo_ids = validation.read_hypo_ids(tensors, batch)
    tree = _read_tree(step.meta, batch, length, hypo_ids, config.max_tree_tokens)
    accepted = _kept_path(session, step.meta, position)
    return StepInputs(hidden, position, prompts, hypo_ids, inputs_digest, tree, accepted)


def _read_tree(
    meta: InferenceStep, batch: int, length: int, hypo_ids: torch.Tensor | None, max_tree_tokens: int
) -> TokenTree | None:
    if meta.tree is None:
        return None
    tree = TokenTree(meta.tree)  # parents out of range or cycles: InvalidRequest naming the token
    if len(meta.tree) != length:
        raise InvalidRequest(f"tree: {len(meta.tree)} parents for a step of {length} tokens")
    if batch * length > max_tree_tokens:
        raise InvalidRequest(
            f"tree: {batch} x {length} tokens exceed this server's max_tree_tokens={max_tree_tokens}"
        )
    if hypo_ids is not None:
        raise InvalidRequest("tree: a tree step cannot also reorder beams (hypo_ids)")
    return tree


def _kept_path(session: ServerSession, meta: InferenceStep, position: int) -> tuple[int, ...] | None:
    """Which tokens of the session's last tree step this step keeps (None: no tree to keep a path of).

    A step after a tree step starts at the tree's start + the length of the path it keeps: `accepted`,
    or, when none is named, the tree's first tokens (which must then form a chain). With no tree pending
    (a server that joined the chain after the tree: it was given the path itself), `accepted` may only
    name where the session already is. A step at a tree's start drops the tree (a rollback); it may name
    the path kept before that tree again (a client retrying the tree step after a failover, while this
    session took the tree step by push)."""
    accepted = meta.accepted
    if session.tree is None:
        if accepted is not None and position != session.position:
            raise InvalidRequest(
                f"accepted: this session holds no token tree (its last step was not one), and "
                f"start_from_position={position} is not its position {session.position}"
            )
        return None
    start, tree = session.tree
    if position <= start:
        # the tree step retried after a failover may name the path this session kept before it again
        already_kept = position == start and accepted == session.path_before_tree
        if accepted and not already_kept:
            raise InvalidRequest(
                f"accepted: start_from_position={position} rolls back to before the tree at {start}"
            )
        return None  # a rollback to before the tree drops all of it
    kept = accepted if accepted is not None else tuple(range(position - start))
    if start + len(kept) != position:
        raise InvalidRequest(
            f"start_from_position={position} must be the last tree's start {start} + the "
            f"{len(kept)} tokens of its path that the step keeps (accepted)"
        )
    if not tree.is_path(kept):
        named = "accepted" if accepted is not None else f"the tree's first {len(kept)} tokens"
        raise InvalidRequest(
            f"{named}={list(kept)[:16]} is not a path from a root of the session's last tree "
            f"(parents {list(tree.parents)[:32]})"
        )
    return kept


def takes_push(session: ServerSession, meta: InferenceStep) -> bool:
    """Whether a pushed step lands where the session stands: at its next position, in its epoch; or opening
    a later epoch, at or before its position (a rollback of pipelined frames: what it goes back over is
    dropped). A push of a later epoch's other steps is skipped: before its epoch is opened here it could
    sit where the dropped frames left the session, and run on their keys; the client's copy comes after
    the one that opens it. A push of an earlier epoch is a frame past a rejected draft: skipped."""
    if meta.epoch == session.epoch:
        return meta.start_from_position == next_position(session, meta)
    opens = meta.epoch > session.epoch and meta.opens_epoch and session.tree is None
    return opens and meta.start_from_position <= session.position


def next_position(session: ServerSession, meta: InferenceStep) -> int:
    """Where the session's next step goes: its position, or after a token tree, the tree's start + the
    path the step keeps."""
    if session.tree is not None and meta.accepted is not None:
        return session.tree[0] + len(meta.accepted)
    return session.position


def check_hops(meta: InferenceStep, num_blocks: int) -> None:
    """A step's next_servers must name block ranges of the model (checked before anything uses them)."""
    for i, hop in enumerate(meta.next_servers):
        if hop.end > num_blocks:
            raise InvalidRequest(
                f"next_servers[{i}]: blocks {hop.start}:{hop.end} lie outside the model's {num_blocks} blocks"
            )


def read_opening(
    first: StepMessage, config: ServerConfig, width: int, num_blocks: int, wire: WireLayout | None = None
) -> tuple[torch.Tensor, str]:
    """A session's first step checked before it opens: its max_length, hidden states, blocks and the
    encoding its replies are asked in. Returns (hidden states, output encoding)."""
    meta = first.meta
    if meta.max_length > config.inference_max_length:
        raise InvalidRequest(
            f"max_length={meta.max_length} exceeds this server's inference_max_length="
            f"{config.inference_max_length}"
        )
    hidden = validation.read_hidden(first.tensors, width, config.max_batch_size, wire=wire)
    check_hops(meta, num_blocks)
    encoding = meta.output_encoding or "lossless"
    if encoding not in wire_tensors.supported_encodings():
        supported = ", ".join(wire_tensors.supported_encodings())
        raise InvalidRequest(f"output_encoding {encoding!r} is not one this server writes ({supported})")
    return hidden, encoding
