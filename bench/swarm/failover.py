"""Recovery from a server killed or frozen mid-generation: how long the user's token stream stalls.

A local SmolLM2 swarm with two servers per third of the model. Each run generates 64 tokens greedily and,
after 32, SIGKILLs the process group of the server serving one hop (first, middle or last), as when a
machine disappears; the client bans it, re-routes, replays the dead server's inputs to the replica, and
continues. Then the same with SIGSTOP instead, as when a machine hangs: its connections stay open and
nothing answers, so the client must notice the silence (client/rpc/stall_probe.py); the frozen server is
killed after the run. After each run the victim's span gets a new server, and the next run starts once
the client has read and pinged it. (Without that wait, a replica started seconds before a freeze was
sometimes found only 15-30 s later: DHT reads are slow and partial while a DHT peer is frozen.) Every run
must end with exactly the uninterrupted run's tokens. Reports the stall (the longest wait for a token from
the kill or freeze on) and the normal step time, as medians over --repeats runs per hop, and the longest
stall (a frozen server's target: at most 3 s). With `--sessions N`, N sessions generate at once (the
first one's route names the victim; the others' routes may or may not pass through it) and a run's stall
is the longest wait of any of them from the signal on; the results are kept as
bench/results/failover_sessions_N.json.

    python -m bench.swarm.failover [--repeats 5] [--sessions 1]
"""

from __future__ import annotations

import signal
import statistics
import threading
import time

import torch

from bench.lib.env import parser
from bench.lib.prompts import chat_ids
from bench.lib.stamp import report
from bench.lib.swarm import smollm2_swarm
from bench.lib.timing import gaps
from corolla.client.model import DistributedModelForCausalLM
from corolla.launch.local import LocalSwarm

SPANS = [(0, 10), (10, 20), (20, 30)]
NEW_TOKENS, KILL_AT = 64, 32
SERVER_ARGS = ["--announce-period", "2"]
HOPS = [(0, "first"), (1, "middle"), (2, "last")]


def run(
    model: DistributedModelForCausalLM,
    swarm: LocalSwarm,
    prompt: list[int],
    hop: int | None,
    freeze: bool,
    sessions: int = 1,
) -> dict:
    stamps: list[list[float]] = [[] for _ in range(sessions)]
    tokens: list[torch.Tensor | None] = [None] * sessions
    victims = []
    signalled: list[float] = []
    started = threading.Barrier(sessions)

    def one(i: int) -> None:
        with model.inference_session(max_length=len(prompt) + NEW_TOKENS) as session:

            def on_token(_: torch.Tensor) -> None:
                stamps[i].append(time.perf_counter())
                if i == 0 and hop is not None and len(stamps[0]) == KILL_AT:
                    victim = next(s for s in swarm.servers if s.peer_id == session.route[hop].peer_id)
                    if freeze:
                        victim.signal_group(signal.SIGSTOP)
                    else:
                        victim.kill_group()
                    signalled.append(time.perf_counter())
                    victims.append(victim)

            started.wait()
            tokens[i] = model.generate(
                prompt, session=session, max_new_tokens=NEW_TOKENS, ignore_eos=True, streamer=on_token
            )

    threads = [threading.Thread(target=one, args=(i,)) for i in range(sessions)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for victim in victims:  # restore two replicas per span
        victim.kill_group()
        swarm.servers.remove(victim)
        swarm.add_server(victim.blocks, extra_args=SERVER_ARGS)
    if victims:
        known_to(model, swarm)
    at = signalled[0] if signalled else stamps[0][KILL_AT - 1]
    # the longest wait for a token from the signal on, of any session (a slow replacement may stall more
    # than one); a session's wait that spans the signal counts from the signal
    waits = [b - max(a, at) for s in stamps for a, b in zip(s, s[1:], strict=False) if b > at]
    stall = max(waits, default=0.0)
    between = [gap for s in stamps for gap in gaps(s)]
    return {"tokens": tokens, "stall": stall, "step": statistics.median(between)}


def known_to(model: DistributedModelForCausalLM, swarm: LocalSwarm, timeout: float = 60.0) -> None:
    """Wait until the client has read and pinged every server (as a swarm's replicas are known before one
    fails: finding a server started a moment ago is another matter, see the docstring)."""
    view = model.client.swarm.view
    live = {server.peer_id for server in swarm.servers}
    deadline = time.monotonic() + timeout
    while not live <= {span.peer_id for span in view.spans} & view.answered:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the client did not see the restored servers within {timeout:.0f}s")
        time.sleep(0.5)
        model.runtime.run(view.refresh())


def summary(runs: list[dict], reference: dict) -> dict:
    return {
        "runs": len(runs),
        "all_tokens_exact": all(
            torch.equal(mine, reference["tokens"][0]) for r in runs for mine in r["tokens"]
        ),
        "median_stall_s": round(statistics.median(r["stall"] for r in runs), 3),
        "max_stall_s": round(max(r["stall"] for r in runs), 3),
        "median_step_s": round(statistics.median(r["step"] for r in runs), 3),
    }


def main() -> None:
    flags = parser(__doc__)
    flags.add_argument("--repeats", type=int, default=5)
    flags.add_argument("--sessions", type=int, default=1, help="sessions generating at once")
    args = flags.parse_args()
    torch.set_num_threads(1)
    results = {}
    with smollm2_swarm(SPANS + SPANS, SERVER_ARGS) as (swarm, model):
        prompt = chat_ids(model.tokenizer, "Tell me about the ocean.")
        reference = run(model, swarm, prompt, None, False)
        for label, freeze in [("killed", False), ("frozen", True)]:
            results[label] = {}
            for hop, name in HOPS:
                runs = [run(model, swarm, prompt, hop, freeze, args.sessions) for _ in range(args.repeats)]
                results[label][name] = summary(runs, reference)
    report(
        __file__,
        {
            "model": "SmolLM2-135M-Instruct",
            "servers": "2 per span of 10 blocks",
            "new_tokens": NEW_TOKENS,
            "signalled_after": KILL_AT,
            **results,
        },
        variant=f"sessions_{args.sessions}" if args.sessions > 1 else "",
    )


if __name__ == "__main__":
    main()
