"""A conversation of many turns through the Responses API (each turn sends only its new input and names the
previous response) against the same conversation through chat completions (each turn sends the whole
history; the client reuses the prefix its servers hold): bytes sent per turn, time to first token per
turn, and the prompt tokens the servers held. Part of bench/decode/api.py.

The two conversations differ only in their opening system message (so neither reuses the other's
prefix), ask the same questions and answer greedily, so their prompts grow alike; their turns alternate,
each path first every other turn.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time

from bench.lib.http import open_stream
from bench.lib.prompts import topic_question

MODEL = "SmolLM2-135M-Instruct"


async def post_stream(port: int, route: str, request: dict, token_line: bytes) -> dict:
    """POST a streaming request; its body's bytes, time to first token, and the last event's JSON."""
    body = json.dumps(request).encode()
    started = time.perf_counter()
    reader, writer = await open_stream(port, route, body)
    first = None
    lines = []
    while line := await reader.readline():
        if line.startswith(token_line) and first is None:
            first = time.perf_counter() - started
        if line.startswith(b"data: {"):
            lines.append(line)
    writer.close()
    events = [json.loads(line[len(b"data: ") :]) for line in lines]  # after the clock: not timed
    return {"bytes": len(body), "ttft_s": first, "events": events}


class Conversation:
    def __init__(self, port: int, system: str, new_tokens: int):
        self.port = port
        self.system = {"role": "system", "content": system}
        self.new_tokens = new_tokens
        self.history: list[dict] = [self.system]
        self.previous: str | None = None

    async def responses_turn(self, question: str) -> dict:
        ask = {"role": "user", "content": question}
        request = {"model": MODEL, "input": [self.system, ask] if self.previous is None else [ask],
                   "previous_response_id": self.previous, "max_output_tokens": self.new_tokens,
                   "temperature": 0, "stream": True}  # fmt: skip
        line = b'data: {"type": "response.output_text.delta"'
        sent = await post_stream(self.port, "/v1/responses", request, line)
        response = sent.pop("events")[-1]["response"]
        self.previous = response["id"]
        usage = response["usage"]
        return {**sent, "prompt_tokens": usage["input_tokens"],
                "cached_tokens": usage["input_tokens_details"]["cached_tokens"]}  # fmt: skip

    async def chat_turn(self, question: str) -> dict:
        self.history.append({"role": "user", "content": question})
        request = {"model": MODEL, "messages": self.history, "max_tokens": self.new_tokens, "temperature": 0,
                   "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
        sent = await post_stream(self.port, "/v1/chat/completions", request, b'data: {"id"')
        chunks = sent.pop("events")
        answer = "".join(chunk["choices"][0]["delta"].get("content") or "" for chunk in chunks[:-1])
        self.history.append({"role": "assistant", "content": answer})
        usage = chunks[-1]["usage"]
        return {**sent, "prompt_tokens": usage["prompt_tokens"],
                "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]}  # fmt: skip


def conversation_turns(port: int, turns: int, new_tokens: int) -> dict:
    """`turns` turns of each path, alternating; per path its turns' figures, and the later turns' (all
    but the first) median time to first token and bytes per turn, Responses over chat completions."""

    async def run() -> dict[str, list[dict]]:
        paths = {"responses": Conversation(port, "You are assistant A.", new_tokens),
                 "chat": Conversation(port, "You are assistant B.", new_tokens)}  # fmt: skip
        rows: dict[str, list[dict]] = {"responses": [], "chat": []}
        for turn in range(turns):
            question = topic_question(turn)
            order = ("responses", "chat") if turn % 2 == 0 else ("chat", "responses")
            for path in order:
                conversation = paths[path]
                take = conversation.responses_turn if path == "responses" else conversation.chat_turn
                rows[path].append(await take(question))
        return rows

    rows = asyncio.run(run())
    later = {path: rows[path][1:] for path in rows}
    ttft = {path: statistics.median(row["ttft_s"] for row in later[path]) for path in later}
    sent = {path: statistics.median(row["bytes"] for row in later[path]) for path in later}
    return {
        "turns": turns,
        "new_tokens": new_tokens,
        "per_turn": rows,
        "later_turns_ttft_p50_ms": {path: round(1000 * value, 1) for path, value in ttft.items()},
        "later_turns_bytes_p50": sent,
        "ratios_responses_vs_chat": {
            "later_turns_ttft": round(ttft["responses"] / ttft["chat"], 3),
            "later_turns_bytes": round(sent["responses"] / sent["chat"], 3),
        },
    }
