"""A chain of servers that together cover blocks [start, end): one stream and one history per hop.

Each hop's server keeps its own cache, so a step sends only the new tokens' hidden states; each hop's
history (client/chain/hop_history.py) keeps what that cache was built from. With push, each step names the
later servers of the chain (`next_servers`): a server sends its outputs straight to the next one, which
runs the step once, whichever copy (pushed or the client's) arrives first (forged pushes: push_trust.py).

Failover: when a hop's server fails (error, timeout, lost connection, dead process), the chain bans it,
routes its blocks again (possibly over several servers), replays the inputs the hop had received to the
replacement in chunks, so that its cache matches, and retries the step there, within a retry budget.
A server a spot check caught lying is replaced the same way (`replace`), after a rewind. A decode step
unanswered for a few times the server's recent decode steps (client/routing/estimates.py `silence_limit`,
at least a second) whose server then misses a ping counts as a failure (client/chain/silent_hops.py): a
frozen server is replaced without waiting for the request timeout; a busy one that answers is waited for.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from collections.abc import Collection

import torch
from hivemind.proto import runtime_pb2

from corolla.client.chain.opening import ChainSpec, Link, fork_links, open_links
from corolla.client.chain.pipeline import PIPELINE_CHUNK, run_pipelined
from corolla.client.chain.push_trust import PushTrust
from corolla.client.chain.relayed import relay_cut, relay_limit_ahead
from corolla.client.chain.retries import RetryBudget
from corolla.client.chain.silent_hops import PACED_TOKENS, SilentHops
from corolla.client.routing.swarm_access import SwarmAccess
from corolla.client.rpc.span_stream import ForgedPush, ForkGone, Reply, SpanStream, Step, StepRoute
from corolla.errors import RETRYABLE
from corolla.swarm.policy.routing import Hop
from corolla.wire.messages import NextServer

logger = logging.getLogger(__name__)

REPLAY_CHUNK = 512  # tokens per message when replaying a failed server's inputs to its replacement


class Chain:
    def __init__(self, swarm: SwarmAccess, spec: ChainSpec):
        self.swarm = swarm
        self.spec = spec
        self.links: list[Link] = []
        self.num_failovers = 0
        self._background: set[asyncio.Task] = set()
        self.push_trust = PushTrust()
        self.silent_hops = SilentHops(swarm)

    @property
    def route(self) -> list[Hop]:
        return [link.hop for link in self.links]

    @property
    def max_tree_tokens(self) -> int:
        """Tokens of one speculative tree step every server of the chain takes (0: some takes none)."""
        statuses = [self.swarm.view.status_of(hop.peer_id) for hop in self.route]
        return min((0 if status is None else status.max_tree_tokens for status in statuses), default=0)

    async def open(self, start: int = 0, end: int | None = None) -> Chain:
        end = self.swarm.num_blocks if end is None else end
        self.links = await open_links(self.swarm, self.spec, start, end)
        return self

    async def fork(self, source: Chain, position: int, batch: int) -> Chain:
        """Open on `source`'s servers, each session starting from its source session at `position` (nothing
        sent again, client/generation/prefixes.py). A server that lost that session answers the first step
        with ForkGone, and its hop is rebuilt from the copied history like a failed one, without a ban."""
        self.links = await fork_links(self.swarm, self.spec, source.links, position, batch)
        return self

    async def refork(self, source: Chain, position: int, batch: int) -> None:
        """`fork`, for a chain opened elsewhere that has sent nothing yet: its streams closed once the fork
        opened (if it cannot, ServerUnavailable, and the chain stays as it was)."""
        old = self.links
        await self.fork(source, position, batch)
        self.swarm.estimates.release([link.hop for link in old])
        await asyncio.gather(*(link.stream.close() for link in old), return_exceptions=True)

    def settled(self, position: int) -> int:
        """Of the first `position` positions, those every server holds as a plain sequence."""
        return min((link.history.settled(position) for link in self.links), default=position)

    async def step(
        self,
        hidden: torch.Tensor,
        position: int,
        prompts: torch.Tensor | None = None,
        hypo_ids: torch.Tensor | None = None,
        tree: tuple[int, ...] | None = None,
    ) -> list[torch.Tensor]:
        """Run hidden states [B, T, H] at `position` through every hop, replacing servers that fail on the
        way; returns each hop's outputs [B, T, H] (the last: the chain's)."""
        if self._pipelines(hidden, prompts, hypo_ids, tree, position):
            outputs = await run_pipelined(self, hidden, position)
            if outputs is not None:  # else a server failed: the whole step again, with failover
                return outputs
        budget = RetryBudget(self.swarm.config)
        outputs = []
        index = 0
        encoded = None
        step_id = uuid.uuid4().hex  # the same at every hop: a server runs a step once, pushed or not
        push = self.swarm.config.use_push and prompts is None and hypo_ids is None
        pushed_to: set[str] = set()  # sessions that the previous servers push this step to
        forged = False  # a hop of this step got a forged push (later hops got it passed on)
        while index < len(self.links):
            link = self.links[index]
            hop_prompts = None if prompts is None else prompts[link.hop.start : link.hop.end]
            step = Step(hidden, position, hop_prompts, hypo_ids, tree, link.history.accepted_at(position))
            route = self.step_route(index, step_id, push, pushed_to)
            if await self._move_before_relay_limit(index, step, budget):
                step_id = uuid.uuid4().hex  # as after a failover (below)
                encoded = None
                continue
            try:
                reply = await self.send(link, step, route, encoded)
            except RETRYABLE as e:
                forged = await self._failed(index, e, route, forged, budget)
                # later servers may hold this step as pushed by the failed one: a new id makes the rest
                # of the chain run it again (servers refuse a step id reused for other inputs)
                step_id = uuid.uuid4().hex
                encoded = None
                continue
            pushed_to.update(server.session_id for server in route.next_servers)
            forged = self.push_trust.met(forged, reply.num_foreign > 0, route.push_from, link.hop.peer_id)
            outputs.append(reply.outputs)
            hidden = reply.outputs
            encoded = reply.encoded  # sent on as it came: byte for byte its push
            index += 1
        return outputs

    def _pipelines(self, hidden, prompts, hypo_ids, tree, position: int) -> bool:
        """Whether a step runs as a pipeline of chunks (client/chain/pipeline.py): a long plain one (a prompt)
        through several hops, with no path of a token tree to keep first."""
        plain = prompts is None and hypo_ids is None and tree is None
        settled = all(link.history.accepted_at(position) is None for link in self.links)
        return plain and settled and len(self.links) > 1 and hidden.shape[1] >= 2 * PIPELINE_CHUNK

    async def feed(self, inputs: torch.Tensor, start: int) -> torch.Tensor:
        """Positions [start, T) of `inputs` [B, T, H] through the chain, in chunks; their outputs."""
        outputs = []
        for offset in range(start, inputs.shape[1], REPLAY_CHUNK):
            outputs.append((await self.step(inputs[:, offset : offset + REPLAY_CHUNK], offset))[-1])
        return torch.cat(outputs, dim=1)

    def accept(self, path: tuple[int, ...]) -> None:
        for link in self.links:
            link.history.accept(path)

    def rewind(self, position: int) -> None:
        for link in self.links:
            link.history.rewind(position)

    async def replace(self, peer_ids: Collection[str]) -> None:
        """Replace every hop whose server is one of `peer_ids` (from the end: a replacement may be several
        hops), each brought to its predecessor's state."""
        budget = RetryBudget(self.swarm.config)
        for index in reversed(range(len(self.links))):
            if self.links[index].hop.peer_id in peer_ids:
                await self._recover(index, None, budget)

    async def close(self) -> None:
        self.swarm.estimates.release(self.route)
        await asyncio.gather(*(link.stream.close() for link in self.links), return_exceptions=True)

    async def send(
        self, link: Link, step: Step, route: StepRoute, encoded: runtime_pb2.Tensor | None
    ) -> Reply:
        started = time.perf_counter()
        hop = link.hop
        decode = step.hidden.shape[1] == 1
        work = functools.partial(link.stream.step, step, route, encoded)
        reply = await self.silent_hops.watch(work, hop.peer_id, step.hidden.shape[1] <= PACED_TOKENS)
        if decode and not route.pushed:  # a decode step's time says how fast it is
            seconds = time.perf_counter() - started
            self.swarm.estimates.observe_step(hop.peer_id, seconds, hop.end - hop.start)
        link.history.record(step, reply.outputs)
        return reply

    def step_route(self, index: int, step_id: str, push: bool, pushed_to: set[str]) -> StepRoute:
        link = self.links[index]
        end = index + 1
        while push and end < len(self.links) and self._push_from(end) is not None:
            end += 1  # pushes go on down the chain as far as each server takes them
        later = self.links[index + 1 : end]
        return StepRoute(
            step_id,
            tuple(NextServer(s.hop.peer_id, s.stream.session_id, s.hop.start, s.hop.end) for s in later),
            link.stream.session_id in pushed_to,
            self._push_from(index),
        )

    def _push_from(self, index: int) -> str | None:
        """The one peer the server at `index` may take pushed steps from (for this step or later ones): the
        previous hop's, unless it was caught pushing other inputs than this client's there."""
        if not index or not self.swarm.config.use_push:
            return None
        previous = self.links[index - 1].hop.peer_id
        return previous if self.push_trust.allows(previous, self.links[index].hop.peer_id) else None

    async def _recover(
        self, index: int, error: Exception | None, budget: RetryBudget, ban: bool = True
    ) -> None:
        """Replace the hop at `index` (its server failed with `error`, or lied: None; `ban`: avoid it for a
        while), trying other servers while the budget lasts."""
        failed = self.links[index]
        if ban:
            self.swarm.bans.failed(failed.hop.peer_id, error)
        self.swarm.estimates.release([failed.hop])
        self._close_in_background(failed.stream)  # its server is gone or broken: do not wait for it
        short = failed.hop.peer_id[-6:]
        while True:
            if isinstance(error, ForkGone):
                budget.spend(error)
                logger.info("Server ...%s no longer holds the prefix (%s); sending it again", short, error)
            elif error is not None:
                budget.spend(error)
                logger.warning("Server ...%s failed (%s); replacing it", short, error)
            try:
                self.links[index : index + 1] = await self._replacement(failed, self._neighbours(index))
                self.num_failovers += 1
                return
            except RETRYABLE as e:  # a replacement failed too: another one
                logger.warning("A replacement for server ...%s failed (%s); trying another", short, e)
                error = e

    async def _failed(
        self, index: int, error: Exception, route: StepRoute, forged: bool, budget: RetryBudget
    ) -> bool:
        """Replace the hop at `index`, whose server failed a step with `error`; whether the step met a
        forged push so far. A server that a forged push (here or upstream in this step) made refuse is not
        at fault, nor one whose relay ended the connection (at its time or data limit; a new one is made)."""
        link = self.links[index]
        forged = self.push_trust.met(forged, isinstance(error, ForgedPush), route.push_from, link.hop.peer_id)
        excused = forged and self.push_trust.excuse(link.hop.peer_id)
        excused = excused or isinstance(error, ForkGone) or relay_cut(self.swarm, link.hop.peer_id, error)
        await self._recover(index, error, budget, ban=not excused)
        return forged

    async def _move_before_relay_limit(self, index: int, step: Step, budget: RetryBudget) -> bool:
        """Whether the hop at `index` was moved to a new connection (replayed there, without a ban) because
        the relay between the client and its server would soon cut the one it has."""
        moved = await relay_limit_ahead(self.swarm, self.links[index].hop.peer_id, step.hidden)
        if moved:
            await self._recover(index, None, budget, ban=False)
        return moved

    def _neighbours(self, index: int) -> set[str]:
        """The servers of the hops before and after the one at `index`."""
        return {self.links[i].hop.peer_id for i in (index - 1, index + 1) if 0 <= i < len(self.links)}

    async def _replacement(self, failed: Link, neighbours: set[str]) -> list[Link]:
        """A new chain over the failed hop's blocks (not through `neighbours` where others serve them),
        brought to the same state by replaying its inputs."""
        started = time.perf_counter()
        links = await open_links(self.swarm, self.spec, failed.hop.start, failed.hop.end, neighbours)
        inputs = failed.history.inputs
        prompts = failed.history.prompts
        start = failed.hop.start
        for link in links:
            part = None if prompts is None else prompts[link.hop.start - start : link.hop.end - start]
            try:
                inputs = inputs if inputs is None else await self._replay(link, inputs, part)
            except RETRYABLE as e:
                self.swarm.bans.failed(link.hop.peer_id, e)
                self.swarm.estimates.release([other.hop for other in links])
                await asyncio.gather(*(other.stream.close() for other in links), return_exceptions=True)
                raise
        logger.info(
            "Replaced server ...%s with %s in %.2fs (replayed %d positions)",
            failed.hop.peer_id[-6:],
            ", ".join(f"...{link.hop.peer_id[-6:]}" for link in links),
            time.perf_counter() - started,
            failed.history.length,
        )
        return links

    async def _replay(self, link: Link, inputs: torch.Tensor, prompts: torch.Tensor | None) -> torch.Tensor:
        """Rebuild another server's state on `link`: its inputs [B, T, H] from position 0, in chunks;
        returns this hop's outputs (the next hop's inputs)."""
        outputs = []
        for start in range(0, inputs.shape[1], REPLAY_CHUNK):
            step = Step(inputs[:, start : start + REPLAY_CHUNK], start, prompts if start == 0 else None)
            outputs.append((await self.send(link, step, StepRoute(), None)).outputs)
        return torch.cat(outputs, dim=1)

    def _close_in_background(self, stream: SpanStream) -> None:
        closing = asyncio.ensure_future(stream.close())
        self._background.add(closing)
        closing.add_done_callback(self._background.discard)
