"""An inference session over a chain of servers that together cover every block.

Each hop keeps its own server-side cache, so a step sends only the new tokens' hidden states. The
session remembers the last token it sampled but has not yet fed to the servers (`pending_token_ids`), so
a multi-turn chat continues where the previous `generate` call stopped. Async methods (`astep`,
`aclose`) run on the client's loop; the plain ones are the synchronous facade.

Failover: when a hop's server fails (error, timeout, lost connection, dead process), the session bans it,
routes its blocks again (possibly over several servers), replays the inputs that hop had received to the
replacement so that its cache matches, and retries the step there (at most `max_retries` times a step).
A server caught lying by a spot check is replaced the same way, from its first wrong position.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Sequence

import torch

from corolla.client.runtime import LoopThread
from corolla.client.span_session import SpanSession, StepRoute, hop_encodings
from corolla.client.spot_checks import Rewound
from corolla.client.swarm import RETRYABLE, SwarmClient
from corolla.errors import InvalidRequest, ServerUnavailable, counted
from corolla.models.tree import TokenTree
from corolla.swarm.routing import Hop
from corolla.wire.messages import NextServer

logger = logging.getLogger(__name__)


class InferenceSession:
    def __init__(self, swarm: SwarmClient, runtime: LoopThread, max_length: int, alloc_timeout: float = 0.0):
        if max_length < 1:
            raise InvalidRequest(f"max_length must be at least 1, got {max_length}")
        self.swarm, self.runtime, self.max_length = swarm, runtime, max_length
        self.alloc_timeout = alloc_timeout
        self.spans: list[SpanSession] = []
        self.position = 0
        self.pending_token_ids: torch.Tensor | None = None  # [B, 1]: sampled, not yet sent to the servers
        self.boundary_outputs: list[torch.Tensor] = []  # each hop's outputs of the last step (for checks)
        self.num_failovers = 0
        self._tree: tuple[int, TokenTree] | None = None  # the last step's token tree, until accepted
        self._steps, self._check_offsets = 0, []  # steps taken; per hop, its spot-check step in a window
        self._background: set[asyncio.Task] = set()
        self._opened = False
        self.closed = False

    @property
    def route(self) -> list[Hop]:
        return [span.hop for span in self.spans]

    @property
    def max_tree_tokens(self) -> int:
        """Tokens of one speculative tree step every server of the chain takes (0: some takes none)."""
        limits = [self.swarm.status_of(span.hop.peer_id) for span in self.spans]
        return min((0 if status is None else status.max_tree_tokens for status in limits), default=0)

    async def aopen(self) -> InferenceSession:
        self.spans = await self._open_chain(0, self.swarm.num_blocks)
        self._opened = True
        return self

    async def _open_chain(self, start: int, end: int) -> list[SpanSession]:
        """Span sessions over blocks [start, end), re-routing around servers that fail to open."""
        swarm = self.swarm
        for _ in range(swarm.config.max_retries + 1):
            hops = await swarm.route(start, end, needed_cache=self.max_length, max_length=self.max_length)
            swarm.estimates.acquire(hops)  # counted at once, so that concurrent sessions spread out
            spans = [
                SpanSession(
                    swarm.p2p,
                    hop,
                    swarm.dht_prefix,
                    self.max_length,
                    swarm.config.request_timeout,
                    self.alloc_timeout,
                    swarm.estimates.observe_step,
                    swarm.config.active_adapter,
                    encodings,
                    keep_outputs=swarm.spot_checker is not None,
                )
                for hop, encodings in zip(hops, hop_encodings(swarm, hops), strict=True)
            ]
            results = await asyncio.gather(*(span.open() for span in spans), return_exceptions=True)
            failed = [
                (span, r) for span, r in zip(spans, results, strict=True) if isinstance(r, BaseException)
            ]
            if not failed:
                return spans
            swarm.estimates.release(hops)
            await asyncio.gather(*(span.close() for span in spans), return_exceptions=True)
            for span, error in failed:
                if not isinstance(error, RETRYABLE):
                    raise error
                swarm.ban(span.hop.peer_id)
        raise ServerUnavailable(
            f"could not open sessions for blocks {start}:{end} after {swarm.config.max_retries + 1} tries"
        )

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
        await self._spot_check(every_hop=False)
        position = self.position if start_from_position is None else start_from_position
        if not 0 <= position <= self.position:
            raise InvalidRequest(f"start_from_position={position} must lie in [0, {self.position}]")
        if position + hidden.shape[1] > self.max_length:
            raise InvalidRequest(
                f"{hidden.shape[1]} more tokens at position {position} exceed the session's "
                f"max_length={self.max_length}"
            )
        if tree is not None:
            TokenTree(tree)  # checked here: a server refusing it would be taken for a faulty one
            if len(tree) != hidden.shape[1]:
                raise InvalidRequest(f"tree: {len(tree)} parents for {hidden.shape[1]} tokens")
        self.boundary_outputs = await self._through_chain(hidden, prompts, hypo_ids, position, tree)
        self._steps += 1
        self.position = position + hidden.shape[1]
        self._tree = (position, TokenTree(tree)) if tree is not None else None
        return self.boundary_outputs[-1]

    def accept(self, path: Sequence[int]) -> None:
        """Keep `path` (token indices of the last step's tree, root first, a path from a root): the session
        then holds the positions before the tree and that path's tokens, in order."""
        if self._tree is None:
            raise InvalidRequest("accept: the session's last step was not a token tree")
        start, tree = self._tree
        path = tuple(path)
        if not tree.is_path(path):
            raise InvalidRequest(f"accept: {list(path)} is not a path from a root of the tree {tree}")
        for span in self.spans:
            span.accept(path)
        self.position = start + len(path)
        self._tree = None

    async def _through_chain(
        self,
        hidden: torch.Tensor,
        prompts: torch.Tensor | None,
        hypo_ids: torch.Tensor | None,
        position: int,
        tree: tuple[int, ...] | None = None,
    ) -> list[torch.Tensor]:
        """Each hop's outputs for one step, replacing servers that fail on the way."""
        boundaries, index, failures, encoded = [], 0, 0, None
        deadline = time.monotonic() + self.swarm.config.failover_timeout
        step_id = uuid.uuid4().hex  # the same at every hop: a server runs a step once, pushed or not
        push = self.swarm.config.use_push and prompts is None and hypo_ids is None
        pushed_to: set[str] = set()  # sessions that the previous servers push this step to
        while index < len(self.spans):
            span = self.spans[index]
            span_prompts = prompts[span.hop.start : span.hop.end] if prompts is not None else None
            route = self._route(index, step_id, push, pushed_to)
            try:
                hidden = await span.step(hidden, span_prompts, hypo_ids, position, route, tree, encoded)
                encoded = span.reply  # sent on to the next server as it came: byte for byte its push
                pushed_to.update(s.session_id for s in route.next_servers)
            except RETRYABLE as e:
                failures += 1
                if failures > self.swarm.config.max_retries or time.monotonic() > deadline:
                    raise ServerUnavailable(
                        f"giving up after {counted(failures, 'failed server')}; last: {e}"
                    ) from e
                logger.warning("Server ...%s failed (%s); replacing it", span.hop.peer_id[-6:], e)
                await self._replace(index)
                # later servers may hold this step as pushed by the failed one: a new id makes the rest
                # of the chain run it again (servers refuse a step id reused for other inputs)
                step_id, encoded = uuid.uuid4().hex, None
                continue
            boundaries.append(hidden)
            index += 1
        return boundaries

    def _route(self, index: int, step_id: str, push: bool, pushed_to: set[str]) -> StepRoute:
        span = self.spans[index]
        later = self.spans[index + 1 :] if push else []
        return StepRoute(
            step_id,
            tuple(NextServer(s.hop.peer_id, s.session_id, s.hop.start, s.hop.end) for s in later),
            span.session_id in pushed_to,
            # the one peer this server may take pushed steps from (for this step or later ones)
            self.spans[index - 1].hop.peer_id if index and self.swarm.config.use_push else None,
        )

    async def _replace(self, index: int) -> None:
        """Swap the failed hop for a new chain over its blocks, brought to the same state."""
        failed = self.spans[index]
        self.swarm.ban(failed.hop.peer_id)
        self.swarm.estimates.release([failed.hop])
        # its server is gone or broken: do not wait for it (nor for the spot checks' shadow of it)
        closing = asyncio.ensure_future(asyncio.gather(failed.close(), self.swarm.release_checks([failed])))
        self._background.add(closing)
        closing.add_done_callback(self._background.discard)
        started = time.perf_counter()
        replacement = await self._open_chain(failed.hop.start, failed.hop.end)
        inputs, prompts, start = failed.inputs, failed.prompts, failed.hop.start
        for span in replacement:
            part = None if prompts is None else prompts[span.hop.start - start : span.hop.end - start]
            inputs = None if inputs is None else await span.replay(inputs, part)
        self.spans[index : index + 1] = replacement
        self.num_failovers += 1
        logger.info(
            "Replaced server ...%s with %s in %.2fs (replayed %d positions)",
            failed.hop.peer_id[-6:],
            ", ".join(f"...{s.hop.peer_id[-6:]}" for s in replacement),
            time.perf_counter() - started,
            0 if failed.inputs is None else failed.inputs.shape[1],
        )

    async def averify(self) -> None:
        """Spot-check every hop's outputs not yet verified (a generation's end: all its tokens checked)."""
        await self._spot_check(every_hop=True)

    async def _spot_check(self, every_hop: bool) -> None:
        """Check the hops due at this step (each once per window of steps), or every hop; a server caught
        lying is replaced and Rewound raised (the session goes back to its first wrong position)."""
        checker = self.swarm.spot_checker
        if checker is None or self._tree is not None:
            return
        if len(self._check_offsets) != len(self.spans):
            self._check_offsets = checker.offsets(len(self.spans))
        due = [every_hop or self._steps % checker.window == offset for offset in self._check_offsets]
        async for index, verdict in checker.check_spans(self.spans, due):
            await self._repair(verdict.faulty, index, verdict.wrong_from)

    async def _repair(self, faulty: tuple[str, ...], checked: int, wrong_from: int | None) -> None:
        """Back to the first position a faulty server of the chain may have got wrong; replace it."""
        starts = [
            wrong_from if index == checked and wrong_from is not None else span.verified
            for index, span in enumerate(self.spans)
            if span.hop.peer_id in faulty
        ]
        if not starts:
            return  # the faulty servers were checkers only
        position = min(starts)
        for span in self.spans:
            span.rewind(position)
        self.position, self._tree, self._check_offsets = position, None, []
        for index in reversed(range(len(self.spans))):  # from the end: a replacement may be several hops
            if self.spans[index].hop.peer_id in faulty:
                await self._replace(index)
        raise Rewound(position)

    async def aclose(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.swarm.estimates.release(span.hop for span in self.spans)
        closing = [*(span.close() for span in self.spans), self.swarm.release_checks(self.spans)]
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
