"""corolla sim against a real swarm on this machine, small scale: route choice and failover counts.

Real: five SmolLM2 servers on 127.0.0.1 with fixed spans (A 0:30; B 0:15 + C 15:30; D 0:20 + E 20:30), one
client running greedy sessions one after another. After --before sessions, the next one's server that most
sessions used is SIGKILLed (its process group) after --kill-at tokens; --after sessions follow. Per session:
its chain, failovers (`num_failovers`), whether it failed, whether its tokens equal the first session's.
Noise, as log-normal sigma = ln(p90 / median) / 1.2816: of the decode steps the client timed, and of the
round trips it saw (its pings; the links the servers announce, `next_pings`, each figure once).

Sim: five.json, the bench overriding its typical step_noise, rtt_ms and ping_noise with the run's (rtt_ms:
the least and the greatest of the links' median round trips; ping_noise: the median link's own spread);
per seed 1 to --seeds, servers announce the real ones' speeds and run at the timed steps' median,
sessions start when the real ones did (one at a time), the victim's process dies (a crash, not silent)
after as many steps of the same session.

Prints JSON (kept, stamped, in bench/results/): what was measured; per phase (before the kill, the kill's
session included; after it) chains, each hop count's share of the sessions (1 hop: A) against the sim's over
seeds (route choice agrees when every real share lies in its 10th-90th percentile range), sessions through
the victim; failovers (agree when on both sides, every seed, just the sessions on the killed server failed
over, once, and the real kill session's count is the sim's where that was on the victim); sessions lost
(agree when none are).

    python -m bench.swarm.sim_vs_real [--before 6] [--after 5] [--new-tokens 20] [--kill-at 10] [--seeds 40]
"""

from __future__ import annotations

import signal
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass

import torch

from bench.lib.env import parser
from bench.lib.stamp import report
from bench.lib.swarm import smollm2_swarm
from bench.lib.timing import gaps
from bench.swarm.real_timings import round_trips, spread, watch
from corolla.errors import CorollaError
from corolla.sim.record_book import Record
from corolla.sim.scenario import Event, Scenario, load
from corolla.sim.simulation import Simulation

SPANS = {"A": (0, 30), "B": (0, 15), "C": (15, 30), "D": (0, 20), "E": (20, 30)}
NAME_OF = {span: name for name, span in SPANS.items()}
ANNOUNCE_PERIOD = 2  # seconds, real and simulated: a dead server's record is gone within a few seconds
PROMPT = "The ocean covers most of the Earth, and"
SIM_START = 1.0  # simulated seconds: the servers joined at 0


@dataclass
class Outcome:
    """One session: when it started (seconds after the first), the chain it opened, what became of it."""

    phase: str  # "before" the kill, "kill" (the server was killed during it), "after"
    start: float
    chain: list[str]  # its servers' names, in order
    final: list[str] | None = None  # its chain when it ended
    failovers: int = 0
    lost: bool = False
    on_killed: bool = False  # it had a hop on the server when that was killed
    exact: bool | None = None  # its tokens equal the first session's (real only)


def real_session(model, prompt: list[int], names: dict, phase: str, args, kill=None) -> tuple:
    """One generation: its Outcome, tokens and token gaps; after --kill-at tokens, `kill(chain)`."""
    stamps: list[float] = []
    with model.inference_session(max_length=len(prompt) + args.new_tokens) as session:
        outcome = Outcome(phase, time.perf_counter(), [names[hop.peer_id] for hop in session.route])

        def on_token(_: torch.Tensor) -> None:
            stamps.append(time.perf_counter())
            if kill is not None and len(stamps) == args.kill_at:
                outcome.on_killed = kill([names[hop.peer_id] for hop in session.route])

        try:
            tokens = model.generate(
                prompt, session=session, max_new_tokens=args.new_tokens, ignore_eos=True, streamer=on_token
            )
        except CorollaError:
            outcome.lost, tokens = True, None
        outcome.final = [names[hop.peer_id] for hop in session.route]
        outcome.failovers = session.num_failovers
    return outcome, tokens, gaps(stamps)


def run_real(args) -> dict:
    period = ["--announce-period", str(ANNOUNCE_PERIOD)]
    # prefix_cache=0: no session moved onto a kept prefix
    with smollm2_swarm(SPANS.values(), period, prefix_cache=0) as (swarm, model):
        names = {server.peer_id: name for server, name in zip(swarm.servers, SPANS, strict=True)}
        prompt = model.tokenizer(PROMPT).input_ids
        estimates = model.client.swarm.estimates
        per_block, seen = watch(model.client.swarm)
        runs = [real_session(model, prompt, names, "before", args) for _ in range(args.before)]
        used = Counter(name for outcome, _, _ in runs for name in set(outcome.chain))
        killed: list[str] = []

        def kill(chain: list[str]) -> bool:  # the session's server that most sessions used
            killed.append(max(chain, key=lambda name: (used[name], -ord(name))))
            next(server for server in swarm.servers if names[server.peer_id] == killed[0]).kill_group()
            return True

        runs.append(real_session(model, prompt, names, "kill", args, kill))
        runs += [real_session(model, prompt, names, "after", args) for _ in range(args.after)]
        announced = {names[peer]: info.throughput for peer, info in estimates.infos.items()}
    first = runs[0][0].start
    for outcome, tokens, _ in runs:
        outcome.start -= first
        outcome.exact = tokens is not None and torch.equal(tokens, runs[0][1])
    median, p90, sigma = spread(per_block, "exclusive")
    measured = {
        "timed_steps": len(per_block),
        "seconds_per_block": round(median, 6),
        "seconds_per_block_p90": round(p90, 6),  # step times' tail
        "step_noise_sigma": sigma,
        "announced_seconds_per_block": {name: round(1 / v, 6) for name, v in sorted(announced.items())},
        "kill_session_longest_token_gap_s": round(max(next(g for o, _, g in runs if o.phase == "kill")), 3),
        **round_trips(seen, names),
    }
    return {"outcomes": [outcome for outcome, _, _ in runs], "victim": killed[0], "measured": measured}


class SimDriver:
    """The real run's sessions in a Simulation, one at a time, each at its real start time (or once the
    previous one ended); the victim crashes after --kill-at steps of the "kill" session."""

    def __init__(self, sim: Simulation, plan: list[Outcome], victim: str, kill_steps: int):
        self.sim, self.plan, self.victim, self.kill_steps = sim, plan, victim, kill_steps
        self.opened: list = []  # (Outcome, SimSession or None)
        self.ended = 0  # sessions lost or turned away when the last one started

    def next(self) -> None:
        sim = self.sim
        self.names = {server.peer_id: NAME_OF[server.start, server.end] for server in sim.servers.values()}
        if sim.sessions.open:  # the previous one still runs, or waits for blocks
            return sim.at(sim.now + 0.05, self.next)
        self.settle()
        sim.sessions.start(Event(at=sim.now, kind="sessions", count=1))  # it arrives now
        sim.at(sim.now, self._opened)

    def _opened(self) -> None:
        sim = self.sim
        session = next(iter(set().union(*sim.sessions.on.values())), None)  # the open one (None: lost)
        chain = [self.names[hop.peer_id] for hop in session.hops] if session else []
        outcome = Outcome(self.plan[len(self.opened)].phase, sim.now - SIM_START, chain)
        self.opened.append((outcome, session))
        if outcome.phase == "kill" and session is not None:  # its process dies: connections reset
            outcome.on_killed = self.victim in chain  # the chain it has until then
            victim = next(s for s in sim.servers.values() if self.names[s.peer_id] == self.victim)
            sim.at(sim.now + self.kill_steps * session.latency, sim.crash, [victim], False)
        if len(self.opened) < len(self.plan):
            sim.at(max(SIM_START + self.plan[len(self.opened)].start, sim.now), self.next)

    def settle(self) -> None:
        """The last session started is over: whether it was lost, its failovers, its final chain."""
        sessions = self.sim.sessions
        ended = sessions.lost + sessions.turned_away
        if self.opened:
            outcome, session = self.opened[-1]
            outcome.lost = ended > self.ended or session is None
            if session is not None:
                outcome.failovers = session.failovers
                outcome.final = [self.names[hop.peer_id] for hop in session.hops]
        self.ended = ended


def announce_as(sim: Simulation, announced: dict[str, float]) -> None:
    """Each simulated server announces (from now on) the speed its real counterpart announced."""
    for server in sim.servers.values():
        server.throughput = 1 / announced[NAME_OF[server.start, server.end]]
        record = sim.book.records[server.peer_id]
        placed = (server.start, server.end, server.throughput)
        sim.book.store(server.peer_id, Record(placed, record.announced_at, record.expires))


def run_sim(real: dict, args, seed: int) -> list[Outcome]:
    found = load("five").model_dump()
    found["classes"][0]["seconds_per_block"] = real["measured"]["seconds_per_block"]
    found["events"] = [event for event in found["events"] if event["kind"] == "join"]
    found.update(announce_period=ANNOUNCE_PERIOD, session_steps=(args.new_tokens, args.new_tokens))
    found.update(step_noise=real["measured"]["step_noise_sigma"], seed=seed)
    found.update(rtt_ms=real["measured"]["rtt_ms"], ping_noise=real["measured"]["ping_noise_sigma"])
    found["duration"] = SIM_START + real["outcomes"][-1].start + 120
    sim = Simulation(Scenario.model_validate(found))
    driver = SimDriver(sim, real["outcomes"], real["victim"], args.kill_at)
    sim.at(SIM_START, announce_as, sim, real["measured"]["announced_seconds_per_block"])
    sim.at(SIM_START, driver.next)
    sim.run()
    driver.settle()
    return [outcome for outcome, _ in driver.opened]


def against(real: float, sims: list[float]) -> dict:
    """A real value, the sim's over seeds (median, 10th and 90th percentile), how far outside it lies."""
    cuts = statistics.quantiles(sims, n=10, method="inclusive")
    spread = [round(value, 3) for value in (statistics.median(sims), cuts[0], cuts[-1])]
    real = round(real, 3)
    by = max(spread[1] - real, real - spread[2])
    where = f"real {real} lies {by:.3f} {'below' if real < spread[1] else 'above'} the sim's p10-p90"
    return {"real": real, "sim_median_p10_p90": spread, "verdict": f"differ: {where}" if by > 0 else "agree"}


def phase_report(real: list[Outcome], sims: list[list[Outcome]], victim: str) -> dict:
    """Both sides' chains, each hop count's share of the sessions (0 hops: lost before it had a chain; the
    sims have as many sessions), sessions through the victim; route choice agrees when every share does."""
    hops = [Counter(len(o.chain) for o in run) for run in (real, *sims)]
    chains = [Counter("+".join(o.chain) for run in side for o in run) for side in ([real], sims)]
    found: dict = {"chains": {"real": chains[0], "sim_all_seeds": chains[1]}, "hop_shares": {}}
    for n in sorted(set().union(*hops)):
        found["hop_shares"][n] = against(hops[0][n] / len(real), [seed[n] / len(real) for seed in hops[1:]])
    misses = [f"{n}-hop share: {share['verdict']}" for n, share in found["hop_shares"].items()]
    found["route_choice"] = "; ".join(miss for miss in misses if not miss.endswith(": agree")) or "agree"
    through = [sum(victim in o.chain for o in real), sum(any(victim in o.chain for o in run) for run in sims)]
    return {**found, f"through_{victim}": {"real_sessions": through[0], "sim_seeds": through[1]}}


def failover_report(real: list[Outcome], sims: list[list[Outcome]]) -> dict:
    """The rule (one failover in each session on the killed server, none elsewhere) on both sides, and the
    real kill session's failovers against the sim's where its kill session was on the victim."""
    kept = [all(o.failovers == int(o.on_killed) for o in run) for run in (real, *sims)]
    kill, *kills = [next(o for o in run if o.phase == "kill") for run in (real, *sims)]
    on_victim = Counter(o.failovers for o in kills if o.on_killed)  # failovers: seeds
    problems = [] if kept[0] else [f"the real run breaks the rule: failovers {[o.failovers for o in real]}"]
    if not all(kept[1:]):
        problems.append(f"the sim breaks the rule in {kept[1:].count(False)} of {len(sims)} seeds")
    if set(on_victim) != {kill.failovers}:
        there = f"on the victim: {dict(on_victim)} (failovers: seeds)" if on_victim else "never on the victim"
        problems.append(f"the real kill session failed over {kill.failovers} time(s); the sim's {there}")
    found = {"real": [o.failovers for o in real], "real_on_killed_server": [o.on_killed for o in real]}
    found["real_kill_session"] = f"{'+'.join(kill.chain)} -> {'+'.join(kill.final or [])}"
    found["sim_seeds_keeping_rule"] = sum(kept[1:])
    found["sim_kill_session"] = Counter(f"{'+'.join(o.chain)} -> {'+'.join(o.final or [])}" for o in kills)
    found["sim_kill_session_on_victim"] = {"seeds": sum(on_victim.values()), "failovers_seeds": on_victim}
    return {**found, "verdict": "; ".join(problems) or "agree"}


def compare(real: dict, sims: list[list[Outcome]], args) -> dict:
    outcomes = real["outcomes"]
    victim = real["victim"]
    found = {"sessions": vars(args), "killed": victim, "measured": real["measured"]}
    for phase, after in (("before", False), ("after", True)):
        parts = [[o for o in run if (o.phase == "after") == after] for run in (outcomes, *sims)]
        found[phase] = phase_report(parts[0], parts[1:], victim)
    through = found["after"][f"through_{victim}"]  # the victim is dead: no chain through it, in any seed
    through["verdict"] = "differ" if any(through.values()) else "agree"
    found["failovers"] = failover_report(outcomes, sims)
    lost = {"real": sum(o.lost for o in outcomes), "sim_seeds": sum(any(o.lost for o in run) for run in sims)}
    found["sessions_lost"] = {**lost, "verdict": "differ" if any(lost.values()) else "agree"}
    found["real_tokens_exact"] = all(o.exact for o in outcomes if not o.lost)
    return found


def main() -> None:
    flags = parser(__doc__)
    flags.add_argument("--before", type=int, default=6, help="sessions before the kill (default: 6)")
    flags.add_argument("--after", type=int, default=5, help="sessions after the kill's (default: 5)")
    flags.add_argument("--new-tokens", type=int, default=20, help="tokens each generates (default: 20)")
    flags.add_argument("--kill-at", type=int, default=10, help="kill after this many tokens (default: 10)")
    flags.add_argument("--seeds", type=int, default=40, help="simulations, seeds 1.. (default: 40)")
    args = flags.parse_args()
    if not 0 < args.kill_at < args.new_tokens or args.seeds < 2:
        flags.error("--kill-at must lie between 0 and --new-tokens, and --seeds be 2 or more")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the swarm's processes on SIGTERM too
    torch.set_num_threads(1)
    started = time.perf_counter()
    real = run_real(args)
    simulated = time.perf_counter()
    sims = [run_sim(real, args, seed) for seed in range(1, args.seeds + 1)]
    found = compare(real, sims, args)
    found["sim_s_per_seed"] = round((time.perf_counter() - simulated) / args.seeds, 3)
    report(__file__, {**found, "runtime_s": round(time.perf_counter() - started, 1)}, short=True)


if __name__ == "__main__":
    main()
