"""How generated choices become OpenAI responses and stream chunks, for completions and for chat."""

from __future__ import annotations

import json
from typing import Any

from corolla.api import tool_calls
from corolla.api.choices import Choice, Moved, Step
from corolla.api.outputs import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    DeltaMessage,
    PromptTokensDetails,
    RoutedChunk,
    ServedHop,
    TokenLogprob,
    ToolCallDelta,
    TopLogprob,
    Usage,
)


def _steps(step: Step | None) -> list[Step]:
    return [] if step is None else [step]


class ResponseFormat:
    id_prefix = ""
    prompt_param = "prompt"
    limit_param = "max_tokens"
    media_type = "text/event-stream"  # of a streamed answer, each event written by `sse`
    stream_end = "data: [DONE]\n\n"

    def __init__(self, tokenizer: Any, request_id: str, model: str, request: Any, prompt_tokens: int):
        self.tokenizer = tokenizer
        self.id = request_id
        self.model = model
        self.request = request
        self.prompt_tokens = prompt_tokens
        self.cached_tokens = 0  # of them, those the servers held already (each prompt's first step says)
        self.first_token_at: float | None = None  # perf_counter time of the first token

    def usage(self, choices: list[Choice]) -> Usage:
        completion = sum(len(choice.text.token_ids) for choice in choices)
        return Usage(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=completion,
            total_tokens=self.prompt_tokens + completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=self.cached_tokens),
        )

    def token_text(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=False, clean_up_tokenization_spaces=False)

    @staticmethod
    def sse(payload: Any) -> str:
        data = payload.model_dump(exclude_none=False) if hasattr(payload, "model_dump") else payload
        return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"

    def first_chunks(self, num_choices: int) -> list[Any]:
        return []

    def usage_chunk(self, choices: list[Choice]) -> Any:
        raise NotImplementedError

    def chunks(self, moved: list[Moved]) -> list[Any]:
        raise NotImplementedError

    def response(self, choices: list[Choice]) -> Any:
        raise NotImplementedError


class CompletionFormat(ResponseFormat):
    id_prefix = "cmpl"

    def logprobs(self, steps: list[Step], offset: int = 0) -> CompletionLogprobs | None:
        if self.request.logprobs is None:  # type: ignore[attr-defined]
            return None
        result = CompletionLogprobs()
        for token, logprob, top in steps:
            text = self.token_text(token)
            result.tokens.append(text)
            result.token_logprobs.append(logprob)
            result.top_logprobs.append({self.token_text(t): lp for t, lp in top})
            result.text_offset.append(offset)
            offset += len(text)
        return result

    def response(self, choices: list[Choice]) -> CompletionResponse:
        return CompletionResponse(
            id=self.id,
            model=self.model,
            choices=[
                CompletionChoice(
                    index=c.index,
                    text=c.text.text,
                    logprobs=self.logprobs(c.steps),
                    finish_reason=c.text.finish_reason,
                )
                for c in choices
            ],
            usage=self.usage(choices),
        )

    def chunks(self, moved: list[Moved]) -> list[CompletionResponse]:
        return [
            CompletionResponse(
                id=self.id,
                model=self.model,
                choices=[
                    CompletionChoice(
                        index=choice.index,
                        text=delta,
                        logprobs=self.logprobs(_steps(step), len(choice.text.text) - len(delta)),
                        finish_reason=choice.text.finish_reason,
                    )
                ],
            )
            for choice, delta, step in moved
        ]

    def usage_chunk(self, choices: list[Choice]) -> CompletionResponse:
        return CompletionResponse(id=self.id, model=self.model, choices=[], usage=self.usage(choices))


class ChatFormat(ResponseFormat):
    id_prefix = "chatcmpl"
    prompt_param = "messages"

    def logprobs(self, steps: list[Step]) -> ChatLogprobs | None:
        if not self.request.logprobs:  # type: ignore[attr-defined]
            return None
        return ChatLogprobs(
            content=[
                TokenLogprob(
                    **self._top(token, logprob),
                    top_logprobs=[TopLogprob(**self._top(t, lp)) for t, lp in top],
                )
                for token, logprob, top in steps
            ]
        )

    def _top(self, token: int, logprob: float | None) -> dict:
        text = self.token_text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    def response(self, choices: list[Choice]) -> ChatCompletionResponse:
        return ChatCompletionResponse(
            id=self.id,
            model=self.model,
            choices=[self._choice(c) for c in choices],
            usage=self.usage(choices),
        )

    def _choice(self, choice: Choice) -> ChatChoice:
        text = choice.text.text
        stream = choice.calls
        content, calls = (text, []) if stream is None else tool_calls.parse(text, stream.format)
        return ChatChoice(
            index=choice.index,
            message=AssistantMessage(content=content, tool_calls=calls or None),
            logprobs=self.logprobs(choice.steps),
            finish_reason="tool_calls"
            if calls and choice.text.finish_reason == "stop"
            else choice.text.finish_reason,
        )

    def first_chunks(self, num_choices: int) -> list[ChatCompletionChunk]:
        return [
            ChatCompletionChunk(
                id=self.id,
                model=self.model,
                choices=[ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))],
            )
            for i in range(num_choices)
        ]

    def chunks(self, moved: list[Moved]) -> list[ChatCompletionChunk]:
        return [self._chunk(choice, delta, step) for choice, delta, step in moved]

    def _chunk(self, choice: Choice, text: str, step: Step | None) -> ChatCompletionChunk:
        """The text released, less what belongs to tool calls, which go out whole once written."""
        finish_reason = choice.text.finish_reason
        delta = DeltaMessage(content=text)
        if choice.calls is not None:
            content, calls = choice.calls.feed(text)
            if finish_reason is not None:
                rest, last = choice.calls.finish()
                content = content + rest
                calls = calls + last
                finish_reason = (
                    "tool_calls" if choice.calls.count and finish_reason == "stop" else finish_reason
                )
            first = choice.calls.count - len(calls)
            deltas = [
                ToolCallDelta(index=first + i, id=c.id, function=c.function) for i, c in enumerate(calls)
            ]
            delta = DeltaMessage(
                content=content if content or not deltas else None, tool_calls=deltas or None
            )
        chunk = ChatChunkChoice(
            index=choice.index, delta=delta, logprobs=self.logprobs(_steps(step)), finish_reason=finish_reason
        )
        if not self.request.return_servers:  # type: ignore[attr-defined]
            return ChatCompletionChunk(id=self.id, model=self.model, choices=[chunk])
        servers = [ServedHop(peer_id=hop.peer_id, blocks=(hop.start, hop.end)) for hop in choice.route]
        return RoutedChunk(id=self.id, model=self.model, choices=[chunk], servers=servers)

    def usage_chunk(self, choices: list[Choice]) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.id, model=self.model, choices=[], usage=self.usage(choices))
