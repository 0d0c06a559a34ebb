"""What the HTTP layer costs: time to first token and tokens/s through `corolla api` vs the Python client.

Starts a local 3-server SmolLM2 swarm and `corolla api` on it. For 1 and 16 concurrent clients, each
generating `--new-tokens` tokens greedily (ignore_eos) from its own chat prompt, measures:
- through the Python client (`DistributedModelForCausalLM.agenerate`, one asyncio task per session, in
  this process), and
- through the HTTP API: one streaming /v1/chat/completions request per client (raw HTTP on asyncio, so
  the measuring side stays light; a token is one SSE chunk with content).
Reports median time to first token, aggregate tokens/s and median per-token latency, and the HTTP/Python
ratios. Paths alternate level by level, so machine noise hits both alike.

    python bench/api.py [--levels 1 16] [--new-tokens 64] [--repeats 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from corolla.client.model import DistributedModelForCausalLM  # noqa: E402
from corolla.swarm.local import LocalSwarm, even_spans  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
TOPICS = ["the sea", "a mountain", "a city at night", "an old library", "a robot", "the moon", "a garden",
          "a train journey", "winter", "a lighthouse", "a market", "the desert", "a violin", "a storm",
          "a friendship", "a forest"]  # fmt: skip


def messages(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Write a few sentences about {TOPICS[i % len(TOPICS)]}."}]


def summarize(starts: list[float], stamps: list[list[float]], elapsed: float) -> dict:
    firsts = [times[0] - start for start, times in zip(starts, stamps, strict=True) if times]
    gaps = [b - a for times in stamps for a, b in zip(times, times[1:], strict=False)]
    return {
        "ttft_p50_ms": round(1000 * statistics.median(firsts), 1),
        "tokens_per_s": round(sum(len(t) for t in stamps) / elapsed, 2),
        "token_latency_p50_ms": round(1000 * statistics.median(gaps), 1),
        "tokens": sum(len(t) for t in stamps),
    }


def python_level(model: DistributedModelForCausalLM, clients: int, new_tokens: int) -> dict:
    tokenizer = model.tokenizer
    inputs = [
        tokenizer(
            tokenizer.apply_chat_template(messages(i), tokenize=False, add_generation_prompt=True),
            add_special_tokens=False,
        ).input_ids
        for i in range(clients)
    ]
    starts, stamps = [0.0] * clients, [[] for _ in range(clients)]

    async def session(i: int) -> None:
        starts[i] = time.perf_counter()
        async for _ in model.agenerate(inputs[i], max_new_tokens=new_tokens, ignore_eos=True):
            stamps[i].append(time.perf_counter())

    async def run() -> float:
        started = time.perf_counter()
        await asyncio.gather(*(session(i) for i in range(clients)))
        return time.perf_counter() - started

    return summarize(starts, stamps, model.runtime.run(run()))


async def http_stream(port: int, i: int, new_tokens: int, stamps: list[float]) -> None:
    body = json.dumps(
        {"model": MODEL, "messages": messages(i), "max_tokens": new_tokens, "temperature": 0,
         "stream": True, "ignore_eos": True}
    ).encode()  # fmt: skip
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
        + body
    )
    await writer.drain()
    first = True
    while line := await reader.readline():
        if line.startswith(b"data: {"):
            if first:  # the opening chunk carries the role, not a token
                first = False
                continue
            stamps.append(time.perf_counter())
        elif line.startswith(b"data: [DONE]"):
            break
    writer.close()


def http_level(port: int, clients: int, new_tokens: int) -> dict:
    starts, stamps = [0.0] * clients, [[] for _ in range(clients)]

    async def client(i: int) -> None:
        starts[i] = time.perf_counter()
        await http_stream(port, i, new_tokens, stamps[i])

    async def run() -> float:
        started = time.perf_counter()
        await asyncio.gather(*(client(i) for i in range(clients)))
        return time.perf_counter() - started

    return summarize(starts, stamps, asyncio.run(run()))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2, help="runs per level and path (the best is kept)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = []
    with (
        LocalSwarm("smollm2", even_spans(30, 3), num_threads=1) as swarm,
        DistributedModelForCausalLM.from_pretrained("smollm2", config=swarm.client_config()) as model,
    ):
        api = swarm.add_api()
        port = int(api.url.rsplit(":", 1)[1])
        python_level(model, 2, 4)  # warm up both paths
        http_level(port, 2, 4)
        for clients in args.levels:
            runs = {"python": [], "http": []}
            for _ in range(args.repeats):
                runs["python"].append(python_level(model, clients, args.new_tokens))
                runs["http"].append(http_level(port, clients, args.new_tokens))
            best = {path: max(rows, key=lambda r: r["tokens_per_s"]) for path, rows in runs.items()}
            results.append(
                {
                    "clients": clients,
                    **best,
                    "ratios_http_vs_python": {
                        "ttft": round(best["http"]["ttft_p50_ms"] / best["python"]["ttft_p50_ms"], 2),
                        "tokens_per_s": round(
                            best["http"]["tokens_per_s"] / best["python"]["tokens_per_s"], 2
                        ),
                        "token_latency": round(
                            best["http"]["token_latency_p50_ms"] / best["python"]["token_latency_p50_ms"], 2
                        ),
                    },
                }
            )
    print(
        json.dumps({"model": MODEL, "servers": 3, "new_tokens": args.new_tokens, "levels": results}, indent=2)
    )


if __name__ == "__main__":
    main()
