"""Reused prefixes through the OpenAI API (issue 30): a long chat, and many users with one system prompt.

SmolLM2 on 3 servers (a local swarm on loopback; with --wan, the swarm of bench/lib/wan.py: 50 ms between
hosts, uploads capped), two `corolla api` processes over it: one with reuse (the default) and one with
`--prefix-cache 0`. Driven by the official openai package, streaming, greedy:

- chat: a 10-turn conversation on a ~1,500-token system prompt, each turn adding about 60 tokens (a
  40-token question, the 12-token answer before it and the chat template's markers). Time to first
  token per turn, with and without reuse, against the time to first token of a fresh 60-token prompt
  (target: turns 2-10 within 1.2x of it; across the WAN under 1.5 s). Both APIs get the same messages
  (the answers of the one without reuse), and their answers are compared turn by turn.
- shared: 16 users at once, one ~1,500-token system prompt (another one), each its own question. Prefill
  positions the first server computed (its `computed_tokens`, less the decode steps) against the ideal
  (the common prefix once + each prompt's own rest; target at most 1.1x), and the mean time to first
  token with and without reuse (target at least 5x better); answers compared.

    python -m bench.decode.prefix [--wan] [--no-loopback] [--delay-ms 25] [--rate 20mbit]
"""

from __future__ import annotations

import json
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.lib.env import parser, wan_flags
from bench.lib.prompts import COUNCIL, LIGHTHOUSE, PROMPTS, SOURDOUGH, chat_ids
from bench.lib.stamp import report
from bench.lib.swarm import server_status
from corolla.launch.local import client_config

SPANS = [(0, 10), (10, 20), (20, 30)]
SYSTEM_TOKENS = 1500
# a turn adds about 60 tokens: a question of 40, the answer before it (12) and the chat template's markers
QUESTION_TOKENS = 40
FRESH_TOKENS = 60  # the fresh prompt each later turn is compared with
TURNS = 10
USERS = 16
ANSWER_TOKENS = 12
MODEL = "SmolLM2-135M-Instruct"


def clip(tokenizer, text: str, tokens: int) -> str:
    return tokenizer.decode(tokenizer(text, add_special_tokens=False).input_ids[:tokens])


def system_prompt(tokenizer, order: tuple[str, ...]) -> dict:
    reports = " ".join(list(order) * 12)
    text = "You answer questions about the following reports, briefly.\n\n" + reports
    return {"role": "system", "content": clip(tokenizer, text, SYSTEM_TOKENS)}


def question(tokenizer, i: int, tokens: int = QUESTION_TOKENS) -> dict:
    text = f"Question {i}: {PROMPTS[i % len(PROMPTS)][1]} " + " ".join(text for _, text in PROMPTS)
    return {"role": "user", "content": clip(tokenizer, text, tokens)}


def ask(client, messages: list[dict], max_tokens: int = ANSWER_TOKENS) -> dict:
    """One streamed chat completion: time to first token, the answer and its usage."""
    started = time.perf_counter()
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    first = None
    parts = []
    usage = None
    for chunk in stream:
        if chunk.choices:
            first = first or time.perf_counter() - started
            parts.append(chunk.choices[0].delta.content or "")
        usage = chunk.usage or usage
    return {
        "ttft_s": first,
        "text": "".join(parts),
        "prompt_tokens": usage.prompt_tokens,
        "cached_tokens": usage.prompt_tokens_details.cached_tokens,
    }


def chat(plain, reuse, tokenizer) -> dict:
    """The 10-turn chat on both APIs, the plain one's answers making the history of both."""
    messages = [system_prompt(tokenizer, (LIGHTHOUSE, SOURDOUGH, COUNCIL))]
    turns = []
    for t in range(TURNS):
        messages.append(question(tokenizer, t))
        without = ask(plain, messages)
        with_reuse = ask(reuse, messages)
        turns.append({"without": without, "with": with_reuse})
        messages.append({"role": "assistant", "content": without["text"]})
    fresh = [ask(reuse, [question(tokenizer, 100 + i, FRESH_TOKENS)])["ttft_s"] for i in range(3)]
    short = statistics.median(fresh)
    later = [t["with"]["ttft_s"] for t in turns[1:]]
    history = [t["with"]["prompt_tokens"] for t in turns]
    return {
        "history_tokens": history,
        "cached_tokens": [t["with"]["cached_tokens"] for t in turns],
        "ttft_s_with_reuse": [round(t["with"]["ttft_s"], 3) for t in turns],
        "ttft_s_without": [round(t["without"]["ttft_s"], 3) for t in turns],
        "added_tokens_per_turn": round(
            statistics.mean(b - a for a, b in zip(history[:-1], history[1:], strict=True)), 1
        ),
        "ttft_s_fresh_60_token_prompt": round(short, 3),
        "worst_later_turn_vs_fresh": round(max(later) / short, 2),
        "mean_later_turn_vs_fresh": round(statistics.mean(later) / short, 2),
        "later_turns_without_vs_with": round(
            statistics.mean(t["without"]["ttft_s"] for t in turns[1:]) / statistics.mean(later), 2
        ),
        "same_answers": sum(t["with"]["text"] == t["without"]["text"] for t in turns),
        "turns": TURNS,
    }


def shared(plain, reuse, tokenizer, computed) -> dict:
    """16 users at once with one system prompt, on each API; prefill the first server computed."""
    system = system_prompt(tokenizer, (COUNCIL, LIGHTHOUSE, SOURDOUGH))
    conversations = [[system, question(tokenizer, 200 + i)] for i in range(USERS)]
    result = {}
    answers = {}
    for name, client in (("without", plain), ("with", reuse)):
        before = computed()
        started = time.perf_counter()
        with ThreadPoolExecutor(USERS) as pool:
            replies = list(pool.map(lambda m, c=client: ask(c, m, 8), conversations))
        wall = time.perf_counter() - started
        decode = sum(len(tokenizer(r["text"], add_special_tokens=False).input_ids) for r in replies)
        answers[name] = [r["text"] for r in replies]
        result[name] = {
            "mean_ttft_s": round(statistics.mean(r["ttft_s"] for r in replies), 2),
            "max_ttft_s": round(max(r["ttft_s"] for r in replies), 2),
            "wall_s": round(wall, 2),
            "first_server_computed_tokens": computed() - before,
            "approx_decode_tokens": decode,
            "cached_tokens": sum(r["cached_tokens"] for r in replies),
        }
    ids = [chat_ids(tokenizer, c) for c in conversations]
    common = min(_common(ids[0], other) for other in ids[1:])
    ideal = common + sum(len(i) - common for i in ids)
    same = sum(a == b for a, b in zip(answers["with"], answers["without"], strict=True))
    with_reuse = result["with"]
    prefill = with_reuse["first_server_computed_tokens"] - USERS * 7  # 8 tokens: 7 decode steps each
    return {
        **result,
        "ideal_prefill_tokens": ideal,
        "prefill_with_reuse_vs_ideal": round(prefill / ideal, 3),
        "mean_ttft_without_vs_with": round(result["without"]["mean_ttft_s"] / with_reuse["mean_ttft_s"], 2),
        "max_ttft_without_vs_with": round(result["without"]["max_ttft_s"] / with_reuse["max_ttft_s"], 2),
        "same_answers": f"{same}/{USERS}",
    }


def _common(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def measure(plain_url: str, reuse_url: str, model) -> dict:
    """Both workloads through the two APIs; `model`: a Python client of the swarm (servers' counters)."""
    from openai import OpenAI

    plain, reuse = (OpenAI(base_url=f"{u}/v1", api_key="-", timeout=600) for u in (plain_url, reuse_url))
    first = next(span.peer_id for span in model.client.swarm.view.spans if span.start == 0)

    def computed() -> int:
        return server_status(model, first, 30.0).computed_tokens

    ask(plain, [question(model.tokenizer, 999)], 2)  # warm both up
    ask(reuse, [question(model.tokenizer, 998)], 2)
    return {
        "chat": chat(plain, reuse, model.tokenizer),
        "shared": shared(plain, reuse, model.tokenizer, computed),
    }


def loopback() -> dict:
    from corolla.launch.local import LocalSwarm
    from corolla.models.source import resolve_model

    path = str(resolve_model("smollm2").path)
    with LocalSwarm(path, SPANS, server_args=["--num-threads", "1"]) as swarm:
        plain = swarm.add_api(extra_args=["--prefix-cache", "0", "--max-model-len", "4096"])
        reuse = swarm.add_api(extra_args=["--max-model-len", "4096"])
        with python_client(path, swarm.initial_peers, "127.0.0.1") as model:
            return measure(plain.url, reuse.url, model)


def python_client(path: str, peers: list[str], host: str):
    from corolla.client.model import DistributedModelForCausalLM

    model = DistributedModelForCausalLM.from_pretrained(path, config=client_config(host, peers))
    model.generate([1, 2, 3], max_new_tokens=1)  # the swarm is routed
    return model


def wan_client(peers: list[str]) -> dict:
    """Inside the client's host of the emulated internet: two APIs there, and both workloads."""
    import tempfile

    from bench.lib.wan import address
    from corolla.launch.local import PeerProcess, answers_http, free_port
    from corolla.models.source import resolve_model
    from corolla.swarm.p2p.addresses import peer_args

    path = str(resolve_model("smollm2").path)
    workdir = Path(tempfile.mkdtemp(prefix="corolla-prefix-"))
    apis = []
    try:
        for name, extra in (("plain", ["--prefix-cache", "0"]), ("reuse", [])):
            port = free_port()
            args = ["api", path, "--port", str(port), "--p2p-host", address(4), "--no-nat-port-map",
                    "--max-model-len", "4096", *extra, *peer_args(peers)]  # fmt: skip
            api = PeerProcess(name, args, workdir / f"{name}.log", dict(os.environ))
            api.url = f"http://127.0.0.1:{port}"
            apis.append(api)
        for api in apis:
            deadline = time.monotonic() + 300
            while not answers_http(f"{api.url}/health") and time.monotonic() < deadline:
                time.sleep(0.5)
        with python_client(path, peers, address(4)) as model:
            return measure(apis[0].url, apis[1].url, model)
    finally:
        for api in apis:
            api.stop(timeout=10)


def wan(delay_ms: float, rate: str) -> dict:
    from bench.lib.wan import WanSwarm

    with WanSwarm(delay_ms, rate) as swarm:
        result = swarm.run_client(__spec__.name, [])
    return {"round_trip_ms": 2 * delay_ms, "upload": rate, **result}


def main() -> None:
    flags = parser(__doc__, wan_flags())
    flags.add_argument("--wan", action="store_true", help="also across the emulated internet (root)")
    flags.add_argument("--no-loopback", action="store_true")
    flags.add_argument("--rate", default="20mbit", help="every host's upload cap")
    args = flags.parse_args()
    if args.client:
        print(json.dumps(wan_client(args.client)))
        return
    results: dict = {"model": MODEL, "servers": 3}
    if not args.no_loopback:
        results["loopback"] = loopback()
    if args.wan:
        results["wan"] = wan(args.delay_ms, args.rate)
    report(__file__, results)


if __name__ == "__main__":
    main()
