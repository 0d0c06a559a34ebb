"""An honest session's per-token latency next to a flooding peer, compared with honest load of one size.

One SmolLM2 server (all 30 blocks) on 127.0.0.1. The honest client steps one session (a 16-token
prefill, then one token at a time) and times every decode step, in three settings:
  alone        nothing else runs;
  honest load  --load other peers, one session each, decoding continuously;
  flood        ONE peer decodes the same --load sessions continuously and also opens as many idle
               sessions as the server lets one peer hold (each with a 64-token prefill), filling the
               cache, as in a lock-out attack.
Prints p50/p95 per-token latency for each, the ratios flood/honest-load, and whether the honest client
could open its session under the flood (before fair share it got CacheExhausted from a full cache).

    python -m bench.trust.abuse [--load 8] [--tokens 48]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import time

import msgpack
import torch
from hivemind.p2p import P2P, PeerID
from hivemind.proto import runtime_pb2

from bench.lib.env import parser
from bench.lib.stamp import report
from bench.lib.swarm import smollm2_swarm
from bench.lib.timing import ms, percentile
from corolla.client.model import DistributedModelForCausalLM
from corolla.wire import tensors
from corolla.wire.messages import RPC_INFERENCE
from corolla.wire.records import block_uids

HIDDEN, NUM_BLOCKS = 576, 30
CACHE_TOKENS = 2048


class RawSession:
    """A session of a raw peer: a prefill, then (if `busy`) one-token steps until stopped."""

    def __init__(self, p2p: P2P, server: str, uid: str, prefill: int, busy: bool):
        self.p2p, self.server, self.prefill, self.busy = p2p, PeerID.from_base58(server), prefill, busy
        self.uid = uid
        self.queue: asyncio.Queue = asyncio.Queue()
        self.error: str | None = None
        self.settled = asyncio.Event()  # opened (its prefill ran) or refused
        self.steps = 0  # decode steps done

    async def _requests(self):
        while (request := await self.queue.get()) is not None:
            yield request

    def _message(self, length: int, **fields) -> runtime_pb2.ExpertRequest:
        hidden = tensors.serialize(torch.randn(1, length, HIDDEN) * 0.1)
        return runtime_pb2.ExpertRequest(uid=self.uid, tensors=[hidden], metadata=msgpack.packb(fields))

    async def run(self, stop: asyncio.Event) -> None:
        await self.queue.put(self._message(self.prefill, max_length=4000))
        try:
            replies = await self.p2p.iterate_protobuf_handler(
                self.server, RPC_INFERENCE, self._requests(), runtime_pb2.ExpertResponse
            )
            await anext(replies)
            self.settled.set()
            position = self.prefill
            while not stop.is_set():
                if self.busy:
                    await self.queue.put(self._message(1, start_from_position=position))
                    await anext(replies)
                    position += 1
                    self.steps += 1
                else:
                    await asyncio.sleep(0.2)
        except Exception as e:  # refused (a limit, a full cache): the flooder just goes on
            self.error = f"{type(e).__name__}: {str(e)[-120:]}"
        finally:
            self.settled.set()
            await self.queue.put(None)


async def honest_latencies(model: DistributedModelForCausalLM, tokens: int) -> dict:
    def run() -> list[float]:
        with model.inference_session(max_length=16 + tokens) as session:
            session.step(torch.randn(1, 16, HIDDEN) * 0.1)
            times = []
            for _ in range(tokens):
                started = time.perf_counter()
                session.step(torch.randn(1, 1, HIDDEN) * 0.1)
                times.append(time.perf_counter() - started)
            return times

    try:
        times = await asyncio.to_thread(run)
    except Exception as e:
        return {"opened": False, "error": f"{type(e).__name__}: {str(e)[-200:]}"}
    return {"opened": True, "p50_ms": ms(statistics.median(times)), "p95_ms": ms(percentile(times, 95))}


async def measure(
    model, server: str, peers: list[P2P], sessions: list[tuple[int, int, bool]], tokens: int
) -> dict:
    """`sessions`: (peer index, prefill, busy) for each background session."""
    stop = asyncio.Event()
    uid = block_uids(model.client.dht_prefix, 0, NUM_BLOCKS)
    load = [RawSession(peers[i], server, uid, prefill, busy) for i, prefill, busy in sessions]
    tasks = []
    for busy in (True, False):  # the busy sessions first: the idle flood then fills what is left
        group = [s for s in load if s.busy == busy]
        tasks += [asyncio.create_task(s.run(stop)) for s in group]
        await asyncio.gather(*(s.settled.wait() for s in group))
    await asyncio.sleep(1.0)
    before = sum(s.steps for s in load)
    started = time.perf_counter()
    result = await honest_latencies(model, tokens)
    result["background_steps_per_s"] = round(
        (sum(s.steps for s in load) - before) / (time.perf_counter() - started), 1
    )
    stop.set()
    await asyncio.gather(*tasks)
    result["background_sessions_refused"] = sum(s.error is not None for s in load)
    result["refusals"] = sorted({s.error for s in load if s.error})[:3]
    await asyncio.sleep(1.0)
    return result


async def bench(args: argparse.Namespace) -> dict:
    server_args = ["--max-cache-tokens", str(CACHE_TOKENS)]
    if args.max_sessions_per_peer:
        server_args += ["--max-sessions-per-peer", str(args.max_sessions_per_peer)]
    with contextlib.ExitStack() as stack:
        swarm, model = stack.enter_context(smollm2_swarm([(0, 30)], server_args, num_threads=2))
        server = swarm.servers[0].peer_id
        peers = [
            await P2P.create(
                initial_peers=swarm.initial_peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False
            )
            for _ in range(args.load)
        ]
        try:
            await asyncio.sleep(2.0)
            alone = await measure(model, server, peers, [], args.tokens)
            honest = await measure(
                model, server, peers, [(i, 16, True) for i in range(args.load)], args.tokens
            )
            idle = max(0, (args.max_sessions_per_peer or 64) - args.load)
            flood_sessions = [(0, 16, True)] * args.load + [(0, 64, False)] * idle
            flood = await measure(model, server, peers, flood_sessions, args.tokens)
        finally:
            for p2p in peers:
                await p2p.shutdown()
    ratios = {}
    if honest.get("opened") and flood.get("opened"):
        ratios = {
            "flood_vs_honest_load_p50": round(flood["p50_ms"] / honest["p50_ms"], 2),
            "flood_vs_honest_load_p95": round(flood["p95_ms"] / honest["p95_ms"], 2),
        }
    return {"load_sessions": args.load, "alone": alone, "honest_load": honest, "flood": flood, **ratios}


def main() -> None:
    flags = parser(__doc__)
    flags.add_argument("--load", type=int, default=8, help="busy background sessions (default: 8)")
    flags.add_argument("--tokens", type=int, default=48, help="honest decode steps timed (default: 48)")
    flags.add_argument(
        "--max-sessions-per-peer", type=int, default=64, help="server's limit (0: leave the option out)"
    )
    args = flags.parse_args()
    torch.set_num_threads(1)
    report(__file__, asyncio.run(bench(args)))


if __name__ == "__main__":
    main()
