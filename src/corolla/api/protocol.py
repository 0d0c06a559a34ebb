"""The OpenAI API's wire models (pydantic): requests, responses, stream chunks and errors.

Fields follow https://platform.openai.com/docs/api-reference (completions and chat completions), in
its order. Extensions that OpenAI lacks (top_k, repetition_penalty, ignore_eos) are marked as such.
Unknown fields are accepted and ignored with a log line, as OpenAI's own server does with fields it
does not know. `to_sampling_params` is the one place a request becomes corolla's `SamplingParams`.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from corolla.client.sampling import SamplingParams

logger = logging.getLogger(__name__)

MAX_STOPS = 4
MAX_N = 16


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="allow")

    @model_validator(mode="after")
    def _log_ignored_fields(self) -> OpenAIBaseModel:
        if self.model_extra:
            logger.info("Ignoring unknown fields in a %s: %s", type(self).__name__, sorted(self.model_extra))
        return self


Probability = Annotated[float, Field(ge=0, le=1)]
Penalty = Annotated[float, Field(ge=-2, le=2)]


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False


class SamplingRequest(OpenAIBaseModel):
    """The fields completions and chat completions share."""

    model: str
    frequency_penalty: Penalty = 0.0
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    presence_penalty: Penalty = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    user: str | None = None
    # corolla's extensions (vLLM and transformers name them the same way)
    top_k: int | None = Field(None, description="extension: keep the k likeliest tokens (-1 or null: all)")
    repetition_penalty: float = Field(1.0, gt=0, description="extension: transformers' repetition penalty")
    ignore_eos: bool = Field(False, description="extension: keep generating past the end-of-text token")
    speculative: bool = Field(
        True,
        description="extension: with a server started with --draft, draft and verify several tokens per "
        "step (false: one token per step); the output is the same either way",
    )

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, stop: str | list[str] | None) -> list[str]:
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if len(stops) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop sequences are allowed, got {len(stops)}")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty strings")
        return stops

    @field_validator("top_k")
    @classmethod
    def _check_top_k(cls, top_k: int | None) -> int | None:
        if top_k is not None and top_k != -1 and top_k < 1:
            raise ValueError(f"top_k must be -1 (all tokens) or at least 1, got {top_k}")
        return None if top_k == -1 else top_k

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for key in bias or {}:
            if not key.isdigit():
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
        return bias

    @model_validator(mode="after")
    def _check_stream_options(self) -> SamplingRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def to_sampling_params(self, max_tokens: int, logprobs: int | None, vocab_size: int) -> SamplingParams:
        bias = tuple((int(token), value) for token, value in (self.logit_bias or {}).items())
        for token, _ in bias:
            if token >= vocab_size:
                raise ValueError(f"logit_bias: token id {token} is outside the vocabulary of {vocab_size}")
        return SamplingParams(
            max_new_tokens=max_tokens,
            do_sample=self.temperature > 0,
            temperature=self.temperature if self.temperature > 0 else 1.0,
            top_k=self.top_k,
            top_p=self.top_p,
            repetition_penalty=self.repetition_penalty,
            seed=self.seed,
            stop=tuple(self.stop or ()),
            ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logit_bias=bias,
            logprobs=logprobs,
            speculative=self.speculative,
        )


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = 16
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, prompt: Any) -> Any:
        if isinstance(prompt, list) and (not prompt or any(isinstance(p, list) and not p for p in prompt)):
            raise ValueError("prompt must not be empty")
        return prompt

    @model_validator(mode="after")
    def _check_unsupported(self) -> CompletionRequest:
        if self.echo:
            raise ValueError("echo is not supported")
        if self.suffix:
            raise ValueError("suffix is not supported")
        return self

    def prompts(self) -> list[str | list[int]]:
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]
        return list(prompt)


class TextPart(OpenAIBaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(OpenAIBaseModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    logprobs: bool = False
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None  # OpenAI's older name for the same limit
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None

    @model_validator(mode="after")
    def _check_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")
        return self

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def template_messages(self) -> list[dict[str, str]]:
        """Messages as chat templates take them (`developer` is the newer name of `system`)."""
        return [
            {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            for m in self.messages
        ]


# --- responses --------------------------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "corolla"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
    status: int = Field(exclude=True)

    @classmethod
    def make(cls, status: int, message: str, kind: str, param: str | None = None, code: str | None = None):
        return cls(error=ErrorInfo(message=message, type=kind, param=param, code=code), status=status)
