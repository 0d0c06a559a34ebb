"""What the HTTP layer costs: time to first token and tokens/s through `corolla api` vs the Python client.

Starts a local 3-server SmolLM2 swarm and `corolla api` on it. For 1 and 16 concurrent clients, each
generating `--new-tokens` tokens greedily (ignore_eos) from its own chat prompt, measures:
- through the Python client (`DistributedModelForCausalLM.agenerate`, one asyncio task per session, in
  this process), and
- through the HTTP API: one streaming /v1/chat/completions request per client (raw HTTP on asyncio, so
  the measuring side stays light; a token is one SSE chunk with content).
Reports median time to first token, aggregate tokens/s and median per-token latency, and the HTTP/Python
ratios. Paths alternate level by level, so machine noise hits both alike.

Constrained decoding (response_format, forced tool calls) is measured twice: on the client alone, the
time per token of masking the logits and following the chosen token (llguidance, SmolLM2's 49,152-token
vocabulary, 1 and 16 rows), and through the API, the per-token latency of streams whose answers must
match a JSON schema vs free ones, at each level.

    python -m bench.decode.api [--levels 1 16] [--new-tokens 64] [--repeats 2]
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time

import torch

from bench.lib.env import parser
from bench.lib.prompts import chat_ids, topic_question
from bench.lib.stamp import report
from bench.lib.swarm import concurrent, smollm2_swarm
from bench.lib.timing import gaps
from corolla.client.model import DistributedModelForCausalLM

MODEL = "SmolLM2-135M-Instruct"


def messages(i: int) -> list[dict]:
    return [{"role": "user", "content": topic_question(i)}]


def summarize(starts: list[float], stamps: list[list[float]], elapsed: float) -> dict:
    firsts = [times[0] - start for start, times in zip(starts, stamps, strict=True) if times]
    between = [gap for times in stamps for gap in gaps(times)]
    return {
        "ttft_p50_ms": round(1000 * statistics.median(firsts), 1),
        "tokens_per_s": round(sum(len(t) for t in stamps) / elapsed, 2),
        "token_latency_p50_ms": round(1000 * statistics.median(between), 1),
        "tokens": sum(len(t) for t in stamps),
    }


def python_level(model: DistributedModelForCausalLM, clients: int, new_tokens: int) -> dict:
    inputs = [chat_ids(model.tokenizer, messages(i)) for i in range(clients)]
    sessions = concurrent(model, inputs, new_tokens)
    return summarize(sessions.starts, sessions.stamps, sessions.elapsed)


async def http_stream(
    port: int, i: int, new_tokens: int, stamps: list[float], schema: dict | None = None
) -> None:
    """One streaming chat request; free text to `new_tokens` tokens, or an answer matching `schema`."""
    request = {"model": MODEL, "messages": messages(i), "max_tokens": new_tokens, "temperature": 0,
               "stream": True, "ignore_eos": schema is None}  # fmt: skip
    if schema is not None:
        request["response_format"] = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    body = json.dumps(request).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
        + body
    )
    await writer.drain()
    status = await reader.readline()
    if b" 200 " not in status:  # a refused request would leave the stream without tokens: say why
        raise RuntimeError(f"{status.decode().strip()}: {(await reader.read()).decode()[-500:]}")
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


def http_level(port: int, clients: int, new_tokens: int, schema: dict | None = None) -> dict:
    starts, stamps = [0.0] * clients, [[] for _ in range(clients)]

    async def client(i: int) -> None:
        starts[i] = time.perf_counter()
        await http_stream(port, i, new_tokens, stamps[i], schema)

    async def run() -> float:
        started = time.perf_counter()
        await asyncio.gather(*(client(i) for i in range(clients)))
        return time.perf_counter() - started

    return summarize(starts, stamps, asyncio.run(run()))


SCHEMA = {  # what the API's constrained streams answer: a long enough object to time
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "mood": {"enum": ["calm", "wild", "sad", "happy"]},
        "lines": {"type": "array", "items": {"type": "string"}, "minItems": 3},
    },
    "required": ["title", "mood", "lines"],
}
EXAMPLE = {"title": "The lighthouse keeper", "mood": "calm", "lines": [
    "The lamp turns slowly over the grey water.", "Ships pass, and none of them stop.",
    "At dawn the keeper writes the weather in a book."]}  # fmt: skip


def mask_cost(model: DistributedModelForCausalLM, rows: int, repeats: int = 5) -> dict:
    """The client's cost of constrained decoding per token and row: mask the logits, follow the token."""
    from corolla.decoding.constraints import Constraint, json_schema_grammar

    grammar, tokenizer = json_schema_grammar(SCHEMA), model.tokenizer
    tokens = tokenizer(json.dumps(EXAMPLE), add_special_tokens=False).input_ids
    logits = torch.randn(rows, model.config.vocab_size)
    active = torch.ones(rows, dtype=torch.bool)
    times = []
    for _ in range(repeats):
        constraint = Constraint(grammar, tokenizer, model.eos_token_ids, rows)
        constraint.mask(logits, active)  # builds the matchers (the tokenizer's view is cached)
        for matcher in constraint.matchers:
            matcher.reset()
        started = time.perf_counter()
        for token in tokens:
            constraint.mask(logits, active)
            constraint.advance(torch.full((rows,), token), active)
        times.append((time.perf_counter() - started) / len(tokens))
    return {"rows": rows, "tokens": len(tokens), "ms_per_token": round(1000 * min(times), 3)}


def constrained_levels(port: int, levels: list[int], new_tokens: int, repeats: int) -> list[dict]:
    """Per-token latency through the API, answers constrained to SCHEMA vs free, level by level."""
    results = []
    for clients in levels:
        runs = {"free": [], "json_schema": []}
        for _ in range(repeats):
            runs["free"].append(http_level(port, clients, new_tokens))
            runs["json_schema"].append(http_level(port, clients, new_tokens, SCHEMA))
        best = {path: min(rows, key=lambda r: r["token_latency_p50_ms"]) for path, rows in runs.items()}
        ratio = best["json_schema"]["token_latency_p50_ms"] / best["free"]["token_latency_p50_ms"]
        results.append({"clients": clients, **best, "latency_ratio_constrained_vs_free": round(ratio, 3)})
    return results


def main() -> None:
    flags = parser(__doc__)
    flags.add_argument("--levels", type=int, nargs="+", default=[1, 16])
    flags.add_argument("--new-tokens", type=int, default=64)
    flags.add_argument("--repeats", type=int, default=2, help="runs per level and path (the best is kept)")
    args = flags.parse_args()
    torch.set_num_threads(1)
    results = []
    with smollm2_swarm() as (swarm, model):
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
        constrained = {
            "client_mask_cost": [mask_cost(model, rows) for rows in (1, 16)],
            "api": constrained_levels(port, args.levels, args.new_tokens, args.repeats),
        }
    report(
        __file__,
        {
            "model": MODEL,
            "servers": 3,
            "new_tokens": args.new_tokens,
            "levels": results,
            "constrained_decoding": constrained,
        },
    )


if __name__ == "__main__":
    main()
