"""The serving layer with a fake model (scripted tokens on a real loop thread): response shapes, SSE,
usage, stop strings, and the request lifecycle (a closed stream cancels its generation)."""

from __future__ import annotations

import asyncio
import json
import threading
from types import SimpleNamespace

import pytest
import torch

from byte_tokenizer import EOS, byte_tokenizer
from corolla.api.chat_protocol import ChatCompletionRequest
from corolla.api.metrics import ApiMetrics
from corolla.api.protocol import CompletionRequest, ErrorResponse
from corolla.api.serving import OpenAIServing
from corolla.api.streams import EventStream
from corolla.client.runtime import LoopThread
from corolla.decoding.chooser import GenerationStep
from corolla.errors import MissingBlocks, ServerUnavailable


class Tokenizer:
    """One character per token (id = code point, ASCII); EOS is special. Text is decoded by a real
    byte-level tokenizer (the API's detokenizer needs one)."""

    backend_tokenizer = byte_tokenizer()

    chat_template = "{{ messages }}"

    def __call__(self, text, add_special_tokens=True):
        return SimpleNamespace(input_ids=[ord(c) for c in text])

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
        return "".join("" if t == EOS and skip_special_tokens else chr(t) for t in ids)

    def apply_chat_template(self, messages, tools=None, tokenize=False, add_generation_prompt=True):
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


class FakeModel:
    """Generates a scripted text per row; `hang` blocks after the first token until cancelled. A "^" in
    the script withdraws the two tokens before it, as a spot check that caught a liar does (or ends the
    generation, where its consumer cannot take tokens back)."""

    def __init__(
        self, script: str, hang: bool = False, error: Exception | None = None, cached: int | None = None
    ):
        self.tokenizer, self.eos_token_ids = Tokenizer(), (EOS,)
        self.config = SimpleNamespace(vocab_size=1000, max_position_embeddings=256)
        self.runtime = LoopThread("fake-model")
        swarm = SimpleNamespace(bans=SimpleNamespace(faulty={}), view=SimpleNamespace(rejected_records={}))
        self.client = SimpleNamespace(checker=None, swarm=swarm, prefixes=None)  # found nothing
        self.script, self.hang, self.error = script, hang, error
        self.cached = cached  # prompt tokens each generation's first step says its servers held
        self.cancelled = threading.Event()
        self.prompts: list[torch.Tensor] = []

    async def agenerate_steps(self, input_ids, params, withdrawals="redo"):
        self.prompts.append(input_ids)
        if self.error is not None:
            raise self.error
        rows = input_ids.shape[0]
        try:
            for i, char in enumerate(self.script[: params.max_new_tokens]):
                if char == "^":
                    if withdrawals == "fail":
                        raise ServerUnavailable(
                            "a spot check caught a server: the last 2 tokens streamed were wrong"
                        )
                    yield GenerationStep(torch.empty(0), torch.zeros(rows, dtype=torch.bool), withdrawn=2)
                    continue
                tokens = torch.full((rows,), ord(char) if char != "$" else EOS)
                finished = tokens == EOS
                if params.logprobs is None:
                    yield GenerationStep(tokens, finished, cached_tokens=self.cached if i == 0 else None)
                else:
                    k = params.logprobs
                    yield GenerationStep(
                        tokens,
                        finished,
                        torch.full((rows,), -0.5),
                        torch.full((rows, k), -0.5),
                        tokens[:, None].repeat(1, k),
                    )
                if bool(finished.all()):
                    return
                if self.hang and i == 0:
                    await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise


@pytest.fixture
def serving_for():
    made = []

    def make(script: str, **kwargs) -> OpenAIServing:
        model = FakeModel(script, **kwargs)
        made.append(model)
        return OpenAIServing(model, "fake", 128, ApiMetrics())

    yield make
    for model in made:
        model.runtime.stop()


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "temperature": 0, **fields}
    )


async def read_sse(stream: EventStream) -> list:
    """The stream's events (a write may hold several: the opening ones go with the first token's)."""
    text = "".join([write async for write in stream])
    await stream.aclose()
    events = text.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    return [json.loads(e[len("data: ") :]) for e in events[:-2]]


async def test_chat_response_usage_and_finish_reasons(serving_for):
    serving = serving_for("Hello$")
    answer = await serving.create_chat_completion(chat(max_tokens=10))
    assert answer.choices[0].message.content == "Hello" and answer.choices[0].finish_reason == "stop"
    prompt = len("<user>hi<assistant>")
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (prompt, 6)  # EOS counts
    assert answer.usage.prompt_tokens_details.cached_tokens == 0
    short = await serving.create_chat_completion(chat(max_tokens=3))
    assert short.choices[0].message.content == "Hel" and short.choices[0].finish_reason == "length"


async def test_usage_reports_the_prompt_tokens_the_servers_held(serving_for):
    """Each prompt's first step says how many of its tokens the servers held (reused prefixes): usage
    adds them up (n rows of one prompt count once), and /metrics counts them."""
    serving = serving_for("Hi$", cached=5)
    answer = await serving.create_chat_completion(chat(max_tokens=10, n=3))
    assert answer.usage.prompt_tokens_details.cached_tokens == 5
    chunks = await read_sse(
        await serving.create_chat_completion(chat(stream=True, stream_options={"include_usage": True}))
    )
    assert chunks[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 5}
    assert b"corolla_api_cached_prompt_tokens_total 10.0" in serving.metrics.render()


async def test_withdrawn_tokens_are_redone_in_an_answer_and_end_a_stream(serving_for):
    """A spot check withdrew "xy": a whole answer never shows them; a stream, whose tokens are out
    already, ends with an error event."""
    serving = serving_for("Hexy^llo$")
    answer = await serving.create_chat_completion(chat(max_tokens=10))
    assert answer.choices[0].message.content == "Hello" and answer.usage.completion_tokens == 6
    chunks = await read_sse(await serving.create_chat_completion(chat(max_tokens=10, stream=True)))
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1]) == "Hexy"
    assert "streamed were wrong" in chunks[-1]["error"]["message"]


async def test_stream_has_one_chunk_per_token_and_holds_back_stop_strings(serving_for):
    serving = serving_for("one two three")
    stream = await serving.create_chat_completion(
        chat(max_tokens=20, stream=True, stop=["two"], stream_options={"include_usage": True})
    )
    chunks = await read_sse(stream)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    deltas = [c["choices"][0]["delta"]["content"] for c in chunks[1:-1]]
    assert len(deltas) == len("one two")  # one chunk per generated token, up to the end of the stop string
    assert "".join(deltas) == "one " and "t" not in "".join(deltas)
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == len("one two")


async def test_n_choices_and_multiple_prompts(serving_for):
    serving = serving_for("abc")
    request = CompletionRequest.model_validate(
        {"model": "fake", "prompt": ["x", "yy"], "n": 2, "max_tokens": 3, "temperature": 0}
    )
    answer = await serving.create_completion(request)
    assert [c.index for c in answer.choices] == [0, 1, 2, 3]
    assert all(c.text == "abc" and c.finish_reason == "length" for c in answer.choices)
    assert answer.usage.prompt_tokens == 3 and answer.usage.completion_tokens == 12
    assert sorted(tuple(p.shape) for p in serving.model.prompts) == [(2, 1), (2, 2)]  # n rows per prompt


async def test_logprobs_shapes(serving_for):
    serving = serving_for("ab")
    answer = await serving.create_chat_completion(chat(max_tokens=2, logprobs=True, top_logprobs=2))
    content = answer.choices[0].logprobs.content
    assert [c.token for c in content] == ["a", "b"] and all(len(c.top_logprobs) == 2 for c in content)
    assert content[0].bytes == [ord("a")]


async def test_limits_and_swarm_errors_become_openai_errors(serving_for):
    serving = serving_for("ab")
    too_long = await serving.create_chat_completion(chat(max_tokens=500))
    assert (
        isinstance(too_long, ErrorResponse)
        and too_long.status == 400
        and too_long.error.param == "max_tokens"
    )
    bad_ids = await serving.create_completion(
        CompletionRequest.model_validate({"model": "fake", "prompt": [5000]})
    )
    assert bad_ids.status == 400 and bad_ids.error.param == "prompt"
    missing = serving_for("ab", error=MissingBlocks("no server covers blocks 3-5", (3, 4, 5)))
    error = await missing.create_chat_completion(chat(stream=True))
    assert error.status == 503 and error.error.code == "missing_blocks" and "3-5" in error.error.message
    assert missing.tracker.num_active == 0


async def test_closing_a_stream_cancels_its_generation(serving_for):
    serving = serving_for("abcdef", hang=True)
    stream = await serving.create_chat_completion(chat(max_tokens=6, stream=True))
    events = aiter(stream)
    first = await anext(events)  # the opening chunk goes out with the first token's
    assert "role" in first and '"a"' in first
    await stream.aclose()  # what the HTTP layer does when the client goes away
    assert await asyncio.to_thread(serving.model.cancelled.wait, 5)
    assert serving.metrics.aborted._value.get() == 1
    assert serving.metrics.active_requests._value.get() == 0


async def test_too_many_choices_in_one_request_are_refused(serving_for):
    serving = serving_for("ab")
    request = CompletionRequest.model_validate(
        {"model": "fake", "prompt": ["a"] * 5, "n": 16, "max_tokens": 2}
    )
    error = await serving.create_completion(request)
    assert error.status == 400 and error.error.param == "prompt" and "at most 64" in error.error.message
    assert serving.model.prompts == []  # nothing reached the swarm


CALL = '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'
TOOL_F = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


async def test_tool_calls_come_out_of_the_text_whole_and_streamed(serving_for, monkeypatch):
    serving = serving_for(f"ok {CALL}$")
    monkeypatch.setattr(Tokenizer, "chat_template", "{{ tools }}{{ messages }}")  # a template with tools
    answer = await serving.create_chat_completion(chat(max_tokens=80, tools=[TOOL_F]))
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "ok"
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == [("f", '{"x": 1}')]
    chunks = await read_sse(
        await serving.create_chat_completion(chat(max_tokens=80, tools=[TOOL_F], stream=True))
    )
    deltas = [c["choices"][0]["delta"] for c in chunks[1:]]
    assert "".join(d.get("content") or "" for d in deltas) == "ok "  # nothing of the call leaks as text
    (call,) = [tc for d in deltas for tc in d.get("tool_calls") or []]
    assert call["index"] == 0 and call["function"] == {"name": "f", "arguments": '{"x": 1}'}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    plain = await serving.create_chat_completion(chat(max_tokens=80, tools=[TOOL_F], tool_choice="none"))
    assert plain.choices[0].message.content == f"ok {CALL}" and plain.choices[0].finish_reason == "stop"


async def test_tools_on_a_template_without_them_are_refused(serving_for):
    answer = await serving_for("x$").create_chat_completion(chat(tools=[TOOL_F]))
    assert isinstance(answer, ErrorResponse) and answer.status == 400 and answer.error.param == "tools"


async def test_calls_cut_by_max_tokens_finish_with_length_and_leave_no_markup(serving_for, monkeypatch):
    serving = serving_for(f'{CALL}\n<tool_call>{{"name": "f", "argu')
    monkeypatch.setattr(Tokenizer, "chat_template", "{{ tools }}{{ messages }}")
    answer = await serving.create_chat_completion(chat(max_tokens=75, tools=[TOOL_F]))
    choice = answer.choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    assert [c.function.name for c in choice.message.tool_calls] == ["f"]  # the finished call stands
    chunks = await read_sse(
        await serving.create_chat_completion(chat(max_tokens=75, tools=[TOOL_F], stream=True))
    )
    assert not "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks[1:])
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


async def test_llama3_templates_get_their_bare_json_calls(serving_for, monkeypatch):
    serving = serving_for('{"name": "f", "parameters": {"x": 1}}$')
    monkeypatch.setattr(Tokenizer, "chat_template", '{{ tools }}"parameters"<|eot_id|>{{ messages }}')
    answer = await serving.create_chat_completion(chat(max_tokens=80, tools=[TOOL_F]))
    assert answer.choices[0].finish_reason == "tool_calls" and answer.choices[0].message.content is None
    assert answer.choices[0].message.tool_calls[0].function.arguments == '{"x": 1}'
    chunks = await read_sse(
        await serving.create_chat_completion(chat(max_tokens=80, tools=[TOOL_F], stream=True))
    )
    deltas = [c["choices"][0]["delta"] for c in chunks[1:]]
    assert not "".join(d.get("content") or "" for d in deltas)
    assert [tc["function"]["name"] for d in deltas for tc in d.get("tool_calls") or []] == ["f"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
