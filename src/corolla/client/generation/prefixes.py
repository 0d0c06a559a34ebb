"""The client's prefix index: which tokens the servers of its sessions hold, so that a generation starts
from the longest prefix they already hold and sends only the rest (issue 30: reused prefixes).

Each entry is a one-row session of this client (live, or ended and kept by its servers: `keep`) and the
token ids its servers hold at positions 0..L-1. A new generation looks up the longest common prefix of
its prompt (all but its last token: that one is always sent, its logits choose the next) with every
entry, and, when it is at least MIN_REUSE tokens, opens its session on the same servers, each forked
from the entry's session at that position (client/chain/chain.py `fork`): nothing before it is sent or
computed again. A prompt whose prefix (at least half of it) is still being computed by another
generation (many users with one system prompt, arriving together) waits for that prefill instead of
computing it again. `n` rows of one prompt run one prefill (a one-row session, itself an entry) and
fork it n times.

Reuse never changes tokens: a fork holds exactly the keys and values its source computed from the same
tokens (the same adapter: the client has one; sessions with trained prompts are never indexed). A server
that may not be used now (banned, gone from routing) means a plain session elsewhere; one that lost the
session answers ForkGone and its hop is rebuilt from the copied history, like a failed one.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from corolla.client.chain.session import InferenceSession
from corolla.client.generation.prefix_cost import AnswerLengths, holding_chain_pays
from corolla.errors import ServerUnavailable

MIN_REUSE = 16  # shorter common prefixes are sent again (a fork costs a page copy and a lookup)
# the kept hop histories of ended entries (a failed server's replacement is rebuilt from them), at most
HISTORY_BYTES = 1 << 30
ENTRY_TTL = 540.0  # seconds an ended entry is looked up (servers keep idle sessions 600 s by default)

MakeSession = Callable[[int, bool], InferenceSession]  # (max_length, keep) -> a session, not yet open


@dataclass(eq=False)
class Prefix:
    tokens: torch.Tensor  # [L] the token ids the session's servers hold at positions 0..L-1
    session: InferenceSession  # whose chain names the servers and their sessions to fork from
    ready: asyncio.Event = field(default_factory=asyncio.Event)  # its tokens are in the servers' caches
    used: float = field(default_factory=time.monotonic)
    ended: bool = False


@dataclass
class Opened:
    """A generation's session: `start` positions it already holds, `cached` of them reused from earlier
    generations (the rest, for n rows, prefilled once here); `entry`: the session's own, if indexed."""

    session: InferenceSession
    start: int = 0
    cached: int = 0
    entry: Prefix | None = None
    prompt: int = 0  # the prompt's length (what the generation decodes is counted from it)

    def prompt_ran(self) -> None:
        """The generation's prompt is in its servers' caches: other generations may fork from it."""
        if self.entry is not None:
            self.entry.ready.set()


@dataclass
class PrefixStats:
    lookups: int = 0  # generations that looked for a prefix
    hits: int = 0  # and started from one
    reused_tokens: int = 0  # prompt positions not sent or computed again


class PrefixCache:
    def __init__(self, capacity: int = 16):
        self.capacity = capacity
        self.entries: list[Prefix] = []
        self.stats = PrefixStats()
        self.answers = AnswerLengths()  # how much forking a slower chain would cost (prefix_cost.py)

    def longest(self, ids: torch.Tensor, ready_only: bool = False) -> tuple[Prefix | None, int]:
        """The entry (`ready_only`: whose prompt has run) sharing the longest prefix with `ids` [T], and
        its length."""
        now = time.monotonic()
        self.entries = [e for e in self.entries if not (e.ended and now - e.used > ENTRY_TTL)]
        entries = [e for e in self.entries if e.ready.is_set() or not ready_only]
        best = max(entries, key=lambda entry: _common(ids, entry.tokens), default=None)
        length = 0 if best is None else _common(ids, best.tokens)
        return (best, length) if length else (None, 0)

    async def find(self, ids: torch.Tensor) -> tuple[Prefix | None, int]:
        """The ready entry sharing the longest prefix with `ids` [T] (from MIN_REUSE tokens), after waiting
        for an entry whose prompt is still running if it shares more, and at least half of `ids` (a long
        shared system prompt; not a template's few tokens, for which a prompt would wait a whole
        prefill)."""
        while True:
            entry, length = self.longest(ids)
            if entry is not None and not entry.ready.is_set() and length >= max(MIN_REUSE, len(ids) / 2):
                await entry.ready.wait()  # it is either ready now, or gone from the index
                continue
            entry, length = self.longest(ids, ready_only=True)
            if entry is None or length < MIN_REUSE:
                return None, 0
            entry.used = time.monotonic()
            return entry, length

    async def open(self, make: MakeSession, ids: torch.Tensor, max_length: int, embed: Callable) -> Opened:
        """An open session for generating after `ids` [B, T] (rows all alike), from the longest prefix
        held."""
        row = ids[0]
        self.stats.lookups += 1
        entry, length = await self.find(row[:-1])
        steps = self.answers.expected(max_length - len(row))
        if ids.shape[0] > 1:
            return await self._fan_out(make, ids, max_length, embed, entry, length, steps)
        session = make(max_length, True)
        own = Prefix(row, session)  # at once: prompts arriving meanwhile wait for this one's to run
        self.entries.append(own)
        try:
            length = await _forked(session, entry, length, 1, steps)
            if not length:
                await session.aopen()
        except BaseException:
            self._drop(own)
            own.ready.set()
            raise
        self._count(length)
        return Opened(session, length, length, own, len(row))

    def ended(self, opened: Opened, tokens: torch.Tensor | None) -> None:
        """The generation ended: `tokens` [L], those its servers hold (None: it failed, nothing is kept)."""
        if tokens is not None and opened.prompt:  # opened here: its prompt's length is known
            self.answers.add(len(tokens) + 1 - opened.prompt)  # its last token was chosen, never sent
        entry = opened.entry
        if entry is None:
            return
        if tokens is None or len(tokens) < MIN_REUSE:
            self._drop(entry)
        else:
            entry.tokens = tokens
            entry.ended = True
            entry.used = time.monotonic()
            self._prune(entry)
        entry.ready.set()

    async def adopt(self, session: InferenceSession, ids: torch.Tensor) -> Opened:
        """A fresh session of the user's (open, nothing sent) for generating after `ids` [1, T]: moved onto
        the servers holding the longest prefix, if any may be used; it is not indexed (its owner keeps it)."""
        self.stats.lookups += 1
        entry, length = await self.find(ids[0, :-1])
        steps = self.answers.expected(session.max_length - ids.shape[1])
        length = await _forked(session, entry, length, 1, steps)
        self._count(length)
        return Opened(session, length, length, prompt=ids.shape[1])

    async def _fan_out(
        self, make: MakeSession, ids: torch.Tensor, max_length: int, embed: Callable, entry, length, steps
    ) -> Opened:
        """n rows of one prompt: one row prefilled (from the longest prefix held), then forked n times."""
        row = ids[0]
        base = entry
        if entry is None or length < len(row) - 1:
            base = await self._prefill(make, row[:-1], entry, length, embed, steps)
        session = make(max_length, False)
        held = await _forked(session, base, len(row) - 1, ids.shape[0])
        if not held:
            await session.aopen()
            return Opened(session, prompt=len(row))
        self._count(length)
        return Opened(session, held, length, prompt=len(row))

    async def _prefill(
        self, make: MakeSession, ids: torch.Tensor, entry: Prefix | None, length: int, embed: Callable, steps
    ) -> Prefix | None:
        """A one-row session holding `ids` [T] (an entry), ended and kept; None if that failed. `steps`:
        the tokens its forks are expected to decode where it runs."""
        session = make(len(ids), True)
        base = Prefix(ids, session)  # at once: prompts arriving meanwhile wait for this one
        self.entries.append(base)
        try:
            length = await _forked(session, entry, length, 1, steps)
            if not length:
                await session.aopen()
            with torch.no_grad():
                await session.astep(embed(ids[None, length:]))
        except BaseException as e:  # failed or cancelled: its servers may not hold the prefix
            self._drop(base)
            if isinstance(e, ServerUnavailable):
                return None
            raise
        finally:
            await session.aclose()
            base.ready.set()
        base.ended = True
        self._prune(base)
        return base

    def _count(self, length: int) -> None:
        if length:
            self.stats.hits += 1
            self.stats.reused_tokens += length

    def _drop(self, entry: Prefix) -> None:
        if entry in self.entries:
            self.entries.remove(entry)

    def _prune(self, kept: Prefix) -> None:
        """Drop ended entries that `kept` holds all of, then the least recently used beyond capacity or
        beyond HISTORY_BYTES of kept hop histories."""
        for entry in list(self.entries):
            n = len(entry.tokens)
            covered = n <= len(kept.tokens) and bool((kept.tokens[:n] == entry.tokens).all())
            if entry is not kept and entry.ended and covered:
                self._drop(entry)
        ended = sorted((e for e in self.entries if e.ended), key=lambda e: e.used)
        total = sum(_history_bytes(e) for e in ended)
        for entry in ended:
            if len(self.entries) <= self.capacity and total <= HISTORY_BYTES:
                break
            self._drop(entry)
            total -= _history_bytes(entry)


def _history_bytes(entry: Prefix) -> int:
    """What an entry's hop histories hold (what failover would replay): at most, views are shared."""
    tensors = [t for link in entry.session.chain.links for t in (link.history.inputs, link.history.outputs)]
    return sum(t.nbytes for t in tensors if t is not None)


def _common(a: torch.Tensor, b: torch.Tensor) -> int:
    """The length of the longest common prefix of token ids a [T] and b [U]."""
    n = min(len(a), len(b))
    same = a[:n] == b[:n]
    return n if bool(same.all()) else int(same.int().argmin())


async def _forked(
    session: InferenceSession, entry: Prefix | None, length: int, batch: int, steps: int = 0
) -> int:
    """Open `session` forked from `entry` at (at most) `length`: the position it starts from; 0 (nothing
    open) if there is none to fork from, its servers may not be used now, or decoding `steps` tokens
    there costs more than prefilling the prefix on the cheapest chain (client/generation/prefix_cost.py)."""
    length = 0 if entry is None else min(length, entry.session.settled_position)
    if length < MIN_REUSE:
        return 0
    if steps and not await holding_chain_pays(session, entry.session, length, steps):
        return 0
    try:
        await session.afork(entry.session, length, batch)
    except ServerUnavailable:
        return 0
    return length
