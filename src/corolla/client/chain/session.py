"""An inference session: a chain of servers that together cover every block, and its one position.

Each hop keeps its own server-side cache, so a step sends only the new tokens' hidden states. The
session remembers the last token chosen but not yet fed to the servers (`pending_token_ids`, written by
the generation loop only), so a multi-turn chat continues where the previous `generate` call stopped.
Async methods (`astep`, `aclose`) run on the client's loop; the plain ones are the synchronous facade.

Failover is the chain's (client/chain/chain.py); a spot check that finds a server of the chain lying makes its
owner call `arepair`: back to the first wrong position, the server replaced.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Collection, Sequence

import torch

from corolla.client.chain.chain import Chain
from corolla.client.chain.frames import FramePipe
from corolla.client.chain.opening import ChainSpec
from corolla.client.routing.swarm_access import SwarmAccess
from corolla.client.runtime import LoopThread
from corolla.errors import InvalidRequest
from corolla.models.tree import TokenTree
from corolla.swarm.policy.routing import Hop


class InferenceSession:
    def __init__(
        self,
        swarm: SwarmAccess,
        runtime: LoopThread,
        max_length: int,
        alloc_timeout: float = 0.0,
        servers: Collection[str] | None = None,
        keep_outputs: bool = False,
        keep: bool = False,
    ):
        """`servers`: route only through these peer ids (besides the client's own allowed_servers);
        `keep_outputs`: each hop's history keeps its replies too (for spot checks); `keep`: servers keep
        the session for later forks when it ends (client/generation/prefixes.py)."""
        if max_length < 1:
            raise InvalidRequest(f"max_length must be at least 1, got {max_length}")
        self.runtime = runtime
        self.max_length = max_length
        allowed = None if servers is None else frozenset(servers)
        spec = ChainSpec(max_length, alloc_timeout, keep_outputs, allowed=allowed, keep=keep)
        self.chain = Chain(swarm, spec)
        self.position = 0
        self._frontier = 0  # the end of what the servers may hold (frames past the position too)
        self.pending_token_ids: torch.Tensor | None = None  # [B, 1]: chosen, not yet sent to the servers
        self._tree: tuple[int, TokenTree] | None = None  # the last step's token tree, until accepted
        self._closers: list[Callable[[], Awaitable[None]]] = []
        self._opened = False
        self.closed = False

    @property
    def route(self) -> list[Hop]:
        return self.chain.route

    @property
    def num_failovers(self) -> int:
        return self.chain.num_failovers

    @property
    def max_tree_tokens(self) -> int:
        return self.chain.max_tree_tokens

    @property
    def has_pending_tree(self) -> bool:
        return self._tree is not None

    async def aopen(self) -> InferenceSession:
        await self.chain.open()
        self._opened = True
        return self

    @property
    def settled_position(self) -> int:
        """Positions every server holds as a plain sequence (before a token tree whose kept path the servers
        learn with the next step): what a fork may start from."""
        return self.chain.settled(self.position)

    @property
    def fresh(self) -> bool:
        """Open, and nothing sent or pending yet."""
        sent = any(link.history.length for link in self.chain.links)
        return (
            self._opened
            and not self.closed
            and not self.position
            and self.pending_token_ids is None
            and not sent
        )

    async def afork(self, source: InferenceSession, position: int, batch: int) -> InferenceSession:
        """Open on `source`'s servers, starting from its state at `position` (a settled one): nothing before
        it is sent again. `batch` rows: the source's, or its one row repeated. A fresh session moves there
        (its servers until then are left); ServerUnavailable if those may not be used now."""
        if not 0 < position <= source.settled_position:
            raise InvalidRequest(f"fork position {position} must lie in [1, {source.settled_position}]")
        if self._opened:
            if not self.fresh:
                raise InvalidRequest("only a session that has sent nothing yet can move to a fork")
            await self.chain.refork(source.chain, position, batch)
        else:
            await self.chain.fork(source.chain, position, batch)
        self.position = position
        self._opened = True
        return self

    async def astep(
        self,
        hidden: torch.Tensor,
        prompts: torch.Tensor | None = None,
        hypo_ids: torch.Tensor | None = None,
        start_from_position: int | None = None,
        tree: tuple[int, ...] | None = None,
    ) -> torch.Tensor:
        """Run hidden states [B, T, H] of the next tokens through every block; returns [B, T, H].

        The step goes at the session's position (or at `start_from_position`, which rolls back): this
        session is the one owner of the position, and every hop is told it with every step. With `tree`
        (parents, models/tree.py) the T tokens form a token tree, verified in one pass on every server;
        `accept` then names the path the session keeps.
        """
        if self.closed or not self._opened:
            raise InvalidRequest("the inference session is closed or was never opened")
        position = self.position if start_from_position is None else start_from_position
        if not 0 <= position <= self.position:
            raise InvalidRequest(f"start_from_position={position} must lie in [0, {self.position}]")
        if position + hidden.shape[1] > self.max_length:
            raise InvalidRequest(
                f"{hidden.shape[1]} more tokens at position {position} exceed the session's "
                f"max_length={self.max_length}"
            )
        # a tree is checked here: a server refusing it would be taken for a faulty one
        checked = None if tree is None else TokenTree(tree)
        if checked is not None and len(tree) != hidden.shape[1]:
            raise InvalidRequest(f"tree: {len(tree)} parents for {hidden.shape[1]} tokens")
        outputs = await self.chain.step(hidden, position, prompts, hypo_ids, tree)
        self.position = self._frontier = position + hidden.shape[1]  # what it rolled back is gone
        self._tree = None if checked is None else (position, checked)
        return outputs[-1]

    def frames(self) -> FramePipe:
        """A pipe for frames: steps sent without waiting for the replies to earlier ones (client/chain/
        frames.py). Once it is closed, `settle` says where the session stands."""
        if self.closed or not self._opened or self._tree is not None:
            raise InvalidRequest("frames need an open session with no token tree pending")
        return FramePipe(self.chain, max(self._frontier, self.position))

    def settle(self, pipe: FramePipe, position: int) -> None:
        """After `pipe` (closed): the session goes on from `position` (what was verified); the servers may
        hold more, which the next step rolls back."""
        if not 0 <= position <= pipe.frontier:
            raise InvalidRequest(f"settle: position={position} must lie in [0, {pipe.frontier}]")
        self.chain.rewind(position)
        self.position = position
        self._frontier = pipe.frontier

    def accept(self, path: Sequence[int]) -> None:
        """Keep `path` (token indices of the last step's tree, root first, a path from a root): the session
        then holds the positions before the tree and that path's tokens, in order."""
        if self._tree is None:
            raise InvalidRequest("accept: the session's last step was not a token tree")
        start, tree = self._tree
        path = tuple(path)
        if not tree.is_path(path):
            raise InvalidRequest(f"accept: {list(path)} is not a path from a root of the tree {tree}")
        self.chain.accept(path)
        self.position = start + len(path)
        self._tree = None

    async def arepair(self, position: int, faulty: Collection[str]) -> None:
        """Go back to `position` (the first one a faulty server may have got wrong) and replace the chain's
        `faulty` servers, each brought to the state before it; what followed must be computed again."""
        if not 0 <= position <= self.position:
            raise InvalidRequest(f"repair: position={position} must lie in [0, {self.position}]")
        self.chain.rewind(position)
        self.position = position
        self._tree = None
        await self.chain.replace(faulty)

    def close_with(self, closer: Callable[[], Awaitable[None]]) -> None:
        """Also run `closer` when this session closes (what others hold for it: spot checks' shadows)."""
        self._closers.append(closer)

    async def aclose(self) -> None:
        if self.closed:
            return
        self.closed = True
        closing = [self.chain.close(), *(closer() for closer in self._closers)]
        await asyncio.gather(*closing, return_exceptions=True)

    # --- synchronous facade ---------------------------------------------------------------------------------

    def open(self) -> InferenceSession:
        return self.runtime.run(self.aopen())

    def step(
        self,
        hidden: torch.Tensor,
        prompts: torch.Tensor | None = None,
        hypo_ids: torch.Tensor | None = None,
        start_from_position: int | None = None,
        tree: tuple[int, ...] | None = None,
    ) -> torch.Tensor:
        return self.runtime.run(self.astep(hidden, prompts, hypo_ids, start_from_position, tree))

    def close(self) -> None:
        if not self.closed and self.runtime.loop.is_running():
            self.runtime.run(self.aclose())

    def __enter__(self) -> InferenceSession:
        return self if self._opened else self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> InferenceSession:
        return self if self._opened else await self.aopen()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
