"""What one hop's server cache was built from: the inputs it was sent (and, for spot checks, its replies).

A hop's history follows its server's cache through rollbacks (a step at an earlier position), beam
reordering (hypo_ids) and speculative trees (once a tree's accepted path is known, only that path is
kept; until then the server holds the whole tree, and the next step names the path to keep). So if the
server fails, a replacement brought the same inputs from position 0 holds the same cache.
"""

from __future__ import annotations

import torch

from corolla.client.rpc.span_stream import Step
from corolla.errors import InvalidRequest


class HopHistory:
    def __init__(self, keep_outputs: bool = False):
        self.keep_outputs = keep_outputs
        self.inputs: torch.Tensor | None = None  # [B, position, H]
        self.outputs: torch.Tensor | None = None  # [B, position, H]: the server's replies, if kept
        self.prompts: torch.Tensor | None = None  # the deep prompts last sent
        # the server's pending token tree: (its start, the path to keep once known)
        self._tree: tuple[int, tuple[int, ...] | None] | None = None

    @property
    def length(self) -> int:
        return 0 if self.inputs is None else self.inputs.shape[1]

    def record(self, step: Step, outputs: torch.Tensor) -> None:
        """A step the server replied to: its inputs (and outputs) at its position, after rollback and
        reordering; a tree step leaves its tree pending."""
        self.inputs = _extended(self.inputs, step.hidden, step.hypo_ids, step.position)
        if self.keep_outputs:
            self.outputs = _extended(self.outputs, outputs, step.hypo_ids, step.position)
        if step.prompts is not None:
            self.prompts = step.prompts
        self._tree = (step.position, None) if step.tree is not None else None

    def accept(self, path: tuple[int, ...]) -> None:
        """The path (token indices, root first) of the last step's tree that the session keeps: the kept
        inputs become that path at once (a replacement replays it as a plain sequence); the server is told
        with the next step (`accepted_at`)."""
        if self._tree is None or self.inputs is None:
            raise InvalidRequest("accept: the last step was not a token tree")
        start = self._tree[0]
        kept = start + torch.tensor(path, dtype=torch.long)
        self.inputs = torch.cat([self.inputs[:, :start], self.inputs[:, kept]], dim=1)
        if self.outputs is not None:
            self.outputs = torch.cat([self.outputs[:, :start], self.outputs[:, kept]], dim=1)
        self._tree = (start, tuple(path))

    def accepted_at(self, position: int) -> tuple[int, ...] | None:
        """What a step at `position` tells the server to keep of its pending tree (None: nothing)."""
        if self._tree is None or self._tree[1] is None or position <= self._tree[0]:
            return None
        start, path = self._tree
        return path[: position - start]

    def settled(self, position: int) -> int:
        """Of the first `position` positions, those the server holds as a plain sequence (a pending tree's
        start: the server learns which path it keeps with the next step)."""
        return position if self._tree is None else min(position, self._tree[0])

    def fork(self, position: int, batch: int) -> HopHistory:
        """The history of a session forked from this one's server session at `position`, with `batch` rows
        (the same rows, or one row repeated)."""
        copy = HopHistory(self.keep_outputs)
        copy.inputs = _first(self.inputs, position, batch)
        copy.outputs = _first(self.outputs, position, batch)
        copy.prompts = self.prompts
        return copy

    def rewind(self, position: int) -> None:
        """Forget what came at and after `position` (a spot check found it wrong upstream or here)."""
        self.inputs = None if self.inputs is None or position == 0 else self.inputs[:, :position]
        self.outputs = None if self.outputs is None or position == 0 else self.outputs[:, :position]
        self._tree = None


def _extended(
    kept: torch.Tensor | None, new: torch.Tensor, hypo_ids: torch.Tensor | None, position: int
) -> torch.Tensor:
    """Kept per-position tensors [B, P, H] cut at `position`, rows reordered by hypo_ids, then `new`."""
    if kept is not None:
        kept = kept[:, :position]
    if kept is not None and hypo_ids is not None:
        kept = kept[hypo_ids]
    return new if kept is None or kept.shape[1] == 0 else torch.cat([kept, new], dim=1)


def _first(kept: torch.Tensor | None, position: int, batch: int) -> torch.Tensor | None:
    if kept is None or position == 0:
        return None
    return kept[:, :position].expand(batch, -1, -1) if kept.shape[0] != batch else kept[:, :position]
