"""The OpenAI API's logic: requests in, responses, stream chunks or errors out; no HTTP here.

Each generation runs as a job of the request tracker on the model's loop and streams `GenerationStep`s
back; `IncrementalText` turns each choice's tokens into text that never shows a stop string. A streaming
request waits for its first token before answering, so that errors found while opening the session
(no server for some blocks, a limit a server enforces) still get a proper status code; later errors end
the stream with an error event. A stream that ends early (the client went away) aborts its generation.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import torch

from corolla.api import chat, limits
from corolla.api.chat import invalid as _invalid
from corolla.api.chat_protocol import ChatCompletionRequest
from corolla.api.choices import Choice, Moved, advance
from corolla.api.formats import ChatFormat, CompletionFormat, ResponseFormat
from corolla.api.metrics import ApiMetrics
from corolla.api.protocol import (
    CompletionRequest,
    ErrorResponse,
    ModelCard,
    ModelList,
    SamplingRequest,
    error_for,
    new_id,
)
from corolla.api.request_log import Record, RequestLog
from corolla.api.streams import EventStream, merge, settled
from corolla.api.tool_calls import CallFormat
from corolla.api.tracker import RequestTracker
from corolla.client.model import DistributedModelForCausalLM
from corolla.decoding import constraints
from corolla.decoding.chooser import GenerationStep
from corolla.decoding.text import IncrementalText
from corolla.errors import InvalidRequest

logger = logging.getLogger(__name__)

OVERVIEW_TTL = 1.0  # seconds
Result = Any  # a response model, an ErrorResponse, or an AsyncIterator[str] of SSE events


class OpenAIServing:
    default_temperature: float | None = None  # for requests that set none (None: each API's own default)

    def __init__(
        self, model: DistributedModelForCausalLM, name: str, max_model_len: int, metrics: ApiMetrics
    ):
        if model.tokenizer is None:
            raise InvalidRequest("the API needs a model folder with a tokenizer")
        self.model = model
        self.name = name
        self.metrics = metrics
        self.max_model_len = min(max_model_len, model.config.max_position_embeddings)
        self.tracker = RequestTracker(model.runtime.loop)
        constraints.warm(model.tokenizer, model.config.vocab_size, model.eos_token_ids)
        self.log = RequestLog()
        self._overview: tuple[float, dict] | None = None
        metrics.watch_client(model.client)

    def models(self) -> ModelList:
        return ModelList(data=[ModelCard(id=self.name, max_model_len=self.max_model_len)])

    async def overview(self) -> dict:
        """The swarm: the DHT's servers with their live figures; read at most once per OVERVIEW_TTL however
        many dashboards poll."""
        cached = self._overview
        if cached is None or time.monotonic() - cached[0] > OVERVIEW_TTL:
            client = self.model.client
            job = asyncio.run_coroutine_threadsafe(client.overview(), self.model.runtime.loop)
            overview = await asyncio.wrap_future(job)
            cached = self._overview = (time.monotonic(), {**overview.to_dict(), **client.findings()})
            cached[1]["served_model"] = self.name
        return cached[1]

    # --- endpoints -----------------------------------------------------------------------------------------

    async def create_completion(
        self, request: CompletionRequest, fmt: type[ResponseFormat] = CompletionFormat
    ) -> Result:
        tokenizer = self.model.tokenizer
        prompts = [p if isinstance(p, list) else tokenizer(p).input_ids for p in request.prompts()]
        vocab = self.model.config.vocab_size
        for ids in prompts:
            if any(not 0 <= t < vocab for t in ids):
                return _invalid(f"prompt holds token ids outside the vocabulary of {vocab}", "prompt")
        grammar = chat.format_grammar(request, request.max_tokens)
        if isinstance(grammar, ErrorResponse):
            return grammar
        return await self._generate(request, prompts, request.max_tokens, request.logprobs, fmt, grammar)

    async def create_chat_completion(
        self, request: ChatCompletionRequest, fmt: type[ResponseFormat] = ChatFormat
    ) -> Result:
        """A chat completion, answered in `fmt`'s shapes (OpenAI's; api/ollama.py's for Ollama's API)."""
        prompt = chat.prepare(self.model.tokenizer, request)
        if isinstance(prompt, ErrorResponse):
            return prompt
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        return await self._generate(
            request, [prompt.ids], request.token_limit, logprobs, fmt, prompt.grammar, prompt.calls
        )

    # --- generation ----------------------------------------------------------------------------------------

    async def _generate(
        self,
        request: SamplingRequest,
        prompts: list[list[int]],
        max_tokens: int | None,
        logprobs: int | None,
        fmt: type[ResponseFormat],
        grammar: str | None = None,
        calls: CallFormat | None = None,
    ) -> Result:
        checked = limits.checked_max_tokens(request, prompts, max_tokens, fmt, self.max_model_len)
        if isinstance(checked, ErrorResponse):
            return checked
        max_tokens = checked
        try:
            vocab = self.model.config.vocab_size
            params = request.to_sampling_params(
                max_tokens, logprobs, vocab, grammar, self.default_temperature
            )
        except (InvalidRequest, ValueError) as e:
            return _invalid(str(e))
        request_id = new_id(fmt.id_prefix)
        choices = self._choices(len(prompts) * request.n, params, calls)
        num_prompt_tokens = sum(len(p) for p in prompts)
        output = fmt(self.model.tokenizer, request_id, self.name, request, num_prompt_tokens)
        steps = self.tracker.add(request_id, self._job(prompts, request.n, params, request.stream))
        self.metrics.active_requests.inc()
        self.metrics.prompt_tokens.inc(num_prompt_tokens)
        record = self.log.start(request_id, self.name, num_prompt_tokens)
        steps = self._timed(steps, record, output)
        events = self._events(steps if request.stream else settled(steps), choices, record, max_tokens)
        end = self._ender(record, events)
        try:
            first = await anext(events, None)
            if not request.stream:
                async for _ in events:
                    pass
        except Exception as e:
            self.metrics.errors.labels(type(e).__name__).inc()
            error = error_for(e)
            record.status = str(error.status)
            await end()
            return error
        except BaseException:
            await end()
            raise
        if not request.stream:
            await end()
            return output.response(choices)
        return EventStream(self._sse(events, first, output, choices, record), end, output.media_type)

    def _choices(self, count: int, params: Any, calls: CallFormat | None) -> list[Choice]:
        """A request's choices, each with its own detokenizer (stop strings held back) and calls parser."""
        model = self.model
        texts = (
            IncrementalText(model.tokenizer, params.stop, model.eos_token_ids, params.ignore_eos)
            for _ in range(count)
        )
        return [Choice(i, text, calls=calls) for i, text in enumerate(texts)]

    def _job(
        self, prompts: list[list[int]], n: int, params: Any, stream: bool
    ) -> Callable[[], AsyncIterator[Any]]:
        """Generations of every prompt (n rows each), run concurrently; yields (prompt index, step). Tokens
        a spot check withdraws end a stream (they are out already) and are redone for a whole answer."""
        model = self.model
        withdrawals = "fail" if stream else "redo"

        async def one(index: int, ids: list[int]) -> AsyncIterator[tuple[int, GenerationStep]]:
            async for step in model.agenerate_steps(torch.tensor([ids] * n), params, withdrawals=withdrawals):
                yield index, step

        def job() -> AsyncIterator[Any]:
            return merge([one(i, ids) for i, ids in enumerate(prompts)])

        return job

    async def _timed(
        self, stream: Any, record: Record, output: ResponseFormat
    ) -> AsyncIterator[tuple[int, GenerationStep]]:
        """The steps as they come, their times observed, and the prompt tokens the servers held."""
        last = None
        async for prompt_index, step in stream:
            if step.cached_tokens:
                output.cached_tokens += step.cached_tokens
                self.metrics.cached_tokens.inc(step.cached_tokens)
            if not step.withdrawn:
                now = time.perf_counter()
                if last is None:
                    record.first_token = output.first_token_at = now
                    self.metrics.time_to_first_token.observe(now - record.started)
                else:
                    self.metrics.time_per_token.observe(now - last)
                last = now
            yield prompt_index, step

    async def _events(
        self, stream: Any, choices: list[Choice], record: Record, max_tokens: int
    ) -> AsyncIterator[list[Moved]]:
        """Per step, (choice, released text, token) for each choice that moved; a choice's last entry
        comes with its finish_reason set."""
        async for prompt_index, step in stream:
            moved = advance(choices, prompt_index, step, max_tokens)
            record.completion_tokens += len(moved)
            self.log.generated(len(moved))
            self.metrics.generated_tokens.inc(len(moved))
            yield moved
        unfinished = [(c, c.text.finish("length"), None) for c in choices if c.text.finish_reason is None]
        if unfinished:
            yield unfinished

    def _sse(
        self,
        events: AsyncIterator[list[Moved]],
        first: list[Moved] | None,
        output: ResponseFormat,
        choices: list[Choice],
        record: Record,
    ) -> AsyncIterator[str]:
        async def sse() -> AsyncIterator[str]:
            try:
                # one write per step: the opening events go out with the first token's
                head = "".join(output.sse(chunk) for chunk in output.first_chunks(len(choices)))
                moved = first
                while moved is not None:
                    text = head + "".join(output.sse(chunk) for chunk in output.chunks(moved))
                    if text:
                        yield text
                        head = ""
                    moved = await anext(events, None)
                if output.request.include_usage:
                    yield output.sse(output.usage_chunk(choices))
            except Exception as e:  # the stream has begun: the error becomes its last event
                self.metrics.errors.labels(type(e).__name__).inc()
                error = error_for(e)
                record.status = str(error.status)
                yield output.sse(error.model_dump())
            if output.stream_end:
                yield output.stream_end

        return sse()

    def _ender(self, record: Record, events: AsyncIterator[Any]) -> Callable[[], Awaitable[None]]:
        """What ends a request, once: abort its generation if it still runs (the client went away)."""
        ended = False

        async def end() -> None:
            nonlocal ended
            if ended:
                return
            ended = True
            self.metrics.active_requests.dec()
            if self.tracker.abort(record.id):
                self.metrics.aborted.inc()
                record.status = "aborted"
            await events.aclose()
            self.log.end(record)

        return end
