"""One session's decoding through a chain, with synchronous and with pipelined speculation: a projection.

A chain here is what routing gives a session: hops that each run a pass over their blocks (priced by
sim/compute.py's calibrated `PassCost`), one-way delays between the client and each hop and from each hop
to the next (push on), and each hop's upload (a token's hidden state takes `upload` seconds over it). The
drafter drafts `draft_s` seconds a token, one token after another; each drafted token is what the model
chooses with probability `acceptance`, independently (a geometric run of accepted tokens, the usual model).

- **Synchronous** (client/generation/speculative.py): a draft of k tokens, then one step of k + 1 tokens
  through the chain and back; 1 + the accepted tokens emitted. The depth with the best expected tokens
  per second is taken, as `DraftBudget` does (k = 0: plain decoding with push).
- **Pipelined** (client/generation/pipelined.py): an epoch's root goes out at once as a frame, then each
  chain of k drafted tokens as the next frame, at most `depth` frames in flight; each hop runs frames in
  order. The first rejection ends the epoch when the reply holding it reaches the client; the frames sent
  before it still run on every hop (pushed ahead of the rollback, they are taken before it), the draft
  being made is finished and dropped, and the new root goes out as a rollback that opens the next epoch,
  pushed like any frame through servers that keep epochs (client/chain/frames.py). With
  `pushed_rollbacks=False` (servers that do not), the client sends a rollback to each hop after the
  previous hop's reply, and frames sent before every hop replied to it are not pushed either.

Simplifications: one session alone on its servers; no relays (every connection direct); a frame's
arrival at the next hop is the push's (the client's copy is never earlier on a direct chain).
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass, replace

from corolla.sim.compute import PassCost, pass_cost
from corolla.sim.network import Network
from corolla.sim.scenario import Scenario, ServerClass

MAX_FRAME = 8  # the most tokens a draft (synchronous) or a frame (pipelined) is tried with
TOKENS = 2000  # tokens a pipelined projection decodes


@dataclass(frozen=True)
class Hop:
    blocks: int
    cost: PassCost  # of a pass over one block
    to: float  # one-way seconds from the client
    back: float  # one-way seconds to the client
    on: float  # one-way seconds to the next hop (the last: unused)
    upload: float  # seconds a token's hidden state takes over the hop's upload

    def compute(self, tokens: int) -> float:
        return self.blocks * self.cost.seconds(tokens)


@dataclass(frozen=True)
class Drafting:
    acceptance: float  # each drafted token is the model's choice with this probability
    draft_s: float  # seconds the drafter takes per token
    client_upload: float = 0.0  # seconds a token's hidden state takes over the client's upload


def synchronous(chain: list[Hop], drafting: Drafting, depth: int) -> tuple[float, float]:
    """Expected tokens and seconds of one synchronous round drafting `depth` tokens."""
    tokens = depth + 1
    seconds = depth * drafting.draft_s + chain[0].to + tokens * drafting.client_upload
    for i, hop in enumerate(chain):
        last = i == len(chain) - 1
        seconds += hop.compute(tokens) + tokens * hop.upload + (hop.back if last else hop.on)
    expected = sum(drafting.acceptance**j for j in range(depth + 1))
    return expected, seconds


def synchronous_rate(chain: list[Hop], drafting: Drafting) -> tuple[float, int]:
    """(tokens per second, depth) at the best depth, 0 (plain decoding) to MAX_FRAME."""
    rates = [(t / s, k) for k in range(MAX_FRAME + 1) for t, s in [synchronous(chain, drafting, k)]]
    return max(rates)


@dataclass
class _Frame:
    first: int  # the epoch's index of its first token (0: the root)
    length: int
    sent: float
    pushed: bool
    reply: float = 0.0  # when the last hop's reply reaches the client


class _Pipeline:
    """The event times of pipelined frames through a chain (see the module's docstring)."""

    def __init__(self, chain: list[Hop], drafting: Drafting, frame: int, depth: int, pushed_rollbacks: bool):
        self.chain = chain
        self.drafting = drafting
        self.frame = frame  # drafted tokens per frame
        self.depth = depth
        self.pushed_rollbacks = pushed_rollbacks
        self.free = [0.0] * len(chain)  # when each hop has run every frame it took
        self.drafter_free = 0.0
        self.rollback_reply = 0.0  # frames sent before the last rollback's reply are not pushed

    def run(self, frame: _Frame) -> None:
        """Take `frame` through every hop, in turn after the frames before it."""
        arrival = frame.sent + self.chain[0].to + frame.length * self.drafting.client_upload
        for i, hop in enumerate(self.chain):
            done = max(arrival, self.free[i]) + hop.compute(frame.length)
            self.free[i] = done
            out = done + frame.length * hop.upload
            if i == len(self.chain) - 1:
                frame.reply = out + hop.back
            elif frame.pushed:
                arrival = out + hop.on
            else:  # the client's copy: back to the client, then to the next hop
                arrival = out + hop.back + self.chain[i + 1].to

    def epoch(self, start: float, accepted: int) -> float:
        """An epoch whose root is known at `start` and whose first `accepted` drafted tokens are the
        model's (the next one is not): when its rejection is known, the next epoch's start."""
        k = self.frame
        root = _Frame(0, 1, start, pushed=self.pushed_rollbacks)
        self.run(root)
        if not self.pushed_rollbacks:
            self.rollback_reply = root.reply
        frames = [root]  # frame j > 0 holds draft j: the epoch's tokens (j - 1) * k + 1 to j * k
        holding = -(-accepted // k)  # the frame holding the last accepted token (0: the root)
        rejected = -(-(accepted + 1) // k)  # the draft holding the first rejected token
        end: float | None = None  # when the rejection is known
        draft_start = max(start, self.drafter_free)  # a stale draft is finished first
        j = 0
        while True:
            j += 1
            ready = draft_start + k * self.drafting.draft_s
            sent = max(ready, frames[j - self.depth].reply if j >= self.depth else 0.0)
            if j == rejected > holding:  # the choice after `holding`'s last token is compared with it
                reply = frames[holding].reply
                end = ready if draft_start < reply < ready else reply  # waits for a draft being made
            if end is not None and sent >= end:  # known before this draft could go: never sent
                self.drafter_free = ready if draft_start < end else end
                return end
            frame = _Frame((j - 1) * k + 1, k, sent, pushed=sent >= self.rollback_reply)
            self.run(frame)
            frames.append(frame)
            if j == holding == rejected:  # the rejected token went in the frame holding the last accepted
                end = frame.reply
            draft_start = sent  # the drafter drafts on once its draft is sent


def pipelined_rate(
    chain: list[Hop], drafting: Drafting, frame: int, depth: int, seed: int = 0, pushed_rollbacks: bool = True
) -> float:
    """Tokens per second of a pipelined generation of about TOKENS tokens (seeded)."""
    rng = random.Random(seed)
    pipeline = _Pipeline(chain, drafting, frame, depth, pushed_rollbacks)
    now = 0.0
    tokens = 0
    while tokens < TOKENS:
        accepted = 0
        while rng.random() < drafting.acceptance and accepted < TOKENS:
            accepted += 1
        now = pipeline.epoch(now, accepted)
        tokens += accepted + 1
    return tokens / now


def best_pipelined(
    chain: list[Hop], drafting: Drafting, depth: int, seed: int, pushed_rollbacks: bool = True
) -> tuple[float, int]:
    """(tokens per second, frame length) at the best frame length, 1 to MAX_FRAME."""
    rates = [
        (pipelined_rate(chain, drafting, k, depth, seed, pushed_rollbacks), k)
        for k in range(1, MAX_FRAME + 1)
    ]
    return max(rates)


def class_chain(scenario: Scenario, kind: ServerClass, rng: random.Random) -> list[Hop]:
    """A chain of servers of one class over the whole model, each holding the middle of the class's
    block range (the last one the rest), placed at random on the scenario's plane with the client."""
    network = Network(scenario.rtt_ms, rng, scenario.hidden_bytes)
    network.place("client", upload_mbps=scenario.client_upload_mbps)
    size = (kind.min_blocks + kind.max_blocks) // 2
    spans = [min(size, scenario.num_blocks - start) for start in range(0, scenario.num_blocks, size)]
    names = [f"server{i}" for i in range(len(spans))]
    for name in names:
        network.place(name, upload_mbps=kind.upload_mbps)
    cost = pass_cost(kind)
    following = [*names[1:], "client"]
    return [
        Hop(
            blocks,
            cost,
            to=network.rtt("client", name) / 2,
            back=network.rtt(name, "client") / 2,
            on=network.rtt(name, after) / 2,
            upload=network.peers[name].upload,
        )
        for blocks, name, after in zip(spans, names, following, strict=True)
    ]


def project(scenario: Scenario, drafting: Drafting, depth: int, chains: int = 16) -> dict:
    """Per server class of `scenario`: one session's tokens/s through chains of that class alone (medians
    over `chains` placements): plain decoding with push, synchronous speculation at its best depth,
    pipelined at its best frame length with `depth` frames in flight, and pipelined through servers that
    keep no epochs (rollbacks through the client)."""
    client_upload = scenario.hidden_bytes * 8 / (scenario.client_upload_mbps * 1e6)
    drafting = replace(drafting, client_upload=client_upload)
    rng = random.Random(f"{scenario.seed}-speculation")
    classes = {}
    for kind in scenario.classes:
        rows = []
        for n in range(chains):
            chain = class_chain(scenario, kind, rng)
            plain = 1 / synchronous(chain, drafting, 0)[1]
            sync, sync_depth = synchronous_rate(chain, drafting)
            piped, frame = best_pipelined(chain, drafting, depth, n)
            unpushed, _ = best_pipelined(chain, drafting, depth, n, pushed_rollbacks=False)
            rows.append((plain, sync, piped, unpushed, sync_depth, frame, len(chain)))
        plain, sync, piped, unpushed, sync_depth, frame, hops = (
            statistics.median(c) for c in zip(*rows, strict=True)
        )
        classes[kind.name] = {
            "hops": hops,
            "plain_tokens_per_s": round(plain, 2),
            "synchronous_tokens_per_s": round(sync, 2),
            "pipelined_tokens_per_s": round(piped, 2),
            "pipelined_vs_synchronous": round(piped / sync, 2),
            "pipelined_rollbacks_unpushed_tokens_per_s": round(unpushed, 2),
            "synchronous_depth": sync_depth,
            "frame_tokens": frame,
        }
    return {
        "acceptance": drafting.acceptance,
        "draft_ms_per_token": drafting.draft_s * 1000,
        "frames_in_flight": depth,
        "chains_per_class": chains,
        "classes": classes,
    }
