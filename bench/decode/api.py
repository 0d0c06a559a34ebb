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

The same streams through Anthropic's Messages API (`/v1/messages`, its named events) and OpenAI's
Responses API (`/v1/responses`, its typed events) against chat completions, at each level, 3 x
`--repeats` runs each, the APIs taking turns going first (a request that follows another starts some ms
later): medians, and what the other dialects' translations and event shapes cost. And a conversation of
`--turns` turns continued with previous_response_id against the same through chat completions
(bench/decode/conversation.py): bytes sent and time to first token per turn.

    python -m bench.decode.api [--levels 1 16] [--new-tokens 64] [--repeats 2] [--turns 10]
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time

import torch

from bench.decode.conversation import conversation_turns
from bench.lib.env import parser
from bench.lib.http import open_stream
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


# per API: its streaming route, how a stream's line carrying a token begins, and the one that ends it
ROUTES = {"chat": "/v1/chat/completions", "messages": "/v1/messages", "responses": "/v1/responses"}
TOKEN_LINES = {
    "chat": b"data: {",
    "messages": b'data: {"type": "content_block_delta"',
    "responses": b'data: {"type": "response.output_text.delta"',
}
ENDS = (b"data: [DONE]", b"event: message_stop", b"event: response.completed")


async def http_stream(
    port: int, i: int, new_tokens: int, stamps: list[float], schema: dict | None = None, api: str = "chat"
) -> None:
    """One streaming request (chat completions, Anthropic's Messages API or OpenAI's Responses API); free
    text to `new_tokens` tokens, or an answer matching `schema` (chat completions)."""
    request = {"model": MODEL, "messages": messages(i), "max_tokens": new_tokens, "temperature": 0,
               "stream": True, "ignore_eos": schema is None}  # fmt: skip
    if api == "responses":
        request["input"] = request.pop("messages")
        request["max_output_tokens"] = request.pop("max_tokens")
    if schema is not None:
        request["response_format"] = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    reader, writer = await open_stream(port, ROUTES[api], json.dumps(request).encode())
    first = api == "chat"  # chat's opening chunk carries the role, not a token
    while line := await reader.readline():
        if line.startswith(TOKEN_LINES[api]):
            if first:
                first = False
                continue
            stamps.append(time.perf_counter())
        elif line.startswith(ENDS):
            break
    writer.close()


def http_level(
    port: int, clients: int, new_tokens: int, schema: dict | None = None, api: str = "chat"
) -> dict:
    starts, stamps = [0.0] * clients, [[] for _ in range(clients)]

    async def client(i: int) -> None:
        starts[i] = time.perf_counter()
        await http_stream(port, i, new_tokens, stamps[i], schema, api)

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


def api_levels(port: int, levels: list[int], new_tokens: int, repeats: int) -> list[dict]:
    """The same streams through Anthropic's Messages API, OpenAI's Responses API and chat completions, level
    by level (issue 50: at most 1.05x chat completions' time to first token, at least 1/1.05 of its
    tokens/s)."""
    apis = list(ROUTES)
    results = []
    for clients in levels:
        runs: dict[str, list[dict]] = {api: [] for api in apis}
        for repeat in range(repeats):
            # a request that follows another starts some ms later (the first one's sessions are still
            # being kept for reuse), so the APIs take turns going first
            for api in apis[repeat % 3 :] + apis[: repeat % 3]:
                runs[api].append(http_level(port, clients, new_tokens, api=api))
        keys = ("ttft_p50_ms", "tokens_per_s")
        medians = {
            api: {key: statistics.median(run[key] for run in rows) for key in keys}
            for api, rows in runs.items()
        }
        ratios = {
            f"{api}_vs_chat": {key: round(medians[api][key] / medians["chat"][key], 3) for key in keys}
            for api in apis[1:]
        }
        results.append({"clients": clients, "runs": runs, "medians": medians, "ratios": ratios})
    return results


def main() -> None:
    flags = parser(__doc__)
    flags.add_argument("--levels", type=int, nargs="+", default=[1, 16])
    flags.add_argument("--new-tokens", type=int, default=64)
    flags.add_argument("--repeats", type=int, default=2, help="runs per level and path (the best is kept)")
    flags.add_argument("--turns", type=int, default=10, help="turns of the conversation through each API")
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
        apis = api_levels(port, args.levels, args.new_tokens, 3 * args.repeats)
        conversation = conversation_turns(port, args.turns, 32)
    report(
        __file__,
        {
            "model": MODEL,
            "servers": 3,
            "new_tokens": args.new_tokens,
            "levels": results,
            "constrained_decoding": constrained,
            "dialects_vs_chat_completions": apis,
            "conversation": conversation,
        },
    )


if __name__ == "__main__":
    main()
