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

from corolla.decoding.constraints import json_schema_grammar
from corolla.decoding.sampling import SamplingParams
from corolla.errors import CorollaError, InvalidRequest, MissingBlocks

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


class JsonSchemaFormat(OpenAIBaseModel):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    schema_: dict[str, Any] | bool = Field(True, alias="schema")
    strict: bool | None = None  # enforced either way: the output always matches the schema


class RequestedFormat(OpenAIBaseModel):
    """`text` (free), `json_object` (any JSON object) or `json_schema`, enforced by constrained decoding."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _check_schema(self) -> RequestedFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema goes with type json_schema, and only with it")
        return self

    def answer_schema(self) -> dict[str, Any] | bool | None:
        """The JSON schema answers must match (None for free text)."""
        if self.type == "json_object":
            return {"type": "object"}
        return None if self.json_schema is None else self.json_schema.schema_

    def grammar(self, max_tokens: int | None = None) -> str | None:
        """llguidance's grammar for this format (None for free text), its open bounds fitted to
        `max_tokens`; raises InvalidRequest."""
        schema = self.answer_schema()
        return None if schema is None else json_schema_grammar(schema, max_tokens)


class SamplingRequest(OpenAIBaseModel):
    """The fields completions and chat completions share."""

    model: str
    frequency_penalty: Penalty = 0.0
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    presence_penalty: Penalty = 0.0
    response_format: RequestedFormat | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None  # None: the API's default (1.0)
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    user: str | None = None
    # corolla's extensions (vLLM and transformers name them the same way)
    top_k: int | None = Field(None, description="extension: keep the k likeliest tokens (-1 or null: all)")
    repetition_penalty: float = Field(1.0, gt=0, description="extension: transformers' repetition penalty")
    ignore_eos: bool = Field(False, description="extension: keep generating past the end-of-text token")
    return_servers: bool = Field(
        False,
        description="extension: each streamed chunk names the servers (peer id and blocks) that computed "
        "its token, as `servers`",
    )
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

    def to_sampling_params(
        self,
        max_tokens: int,
        logprobs: int | None,
        vocab_size: int,
        grammar: str | None = None,
        default_temperature: float | None = None,
    ) -> SamplingParams:
        """The request's sampling; `grammar`: what the output must match (response format, tool calls);
        `default_temperature` where the request says none (`corolla api --default-temperature`)."""
        temperature = self.temperature if self.temperature is not None else default_temperature
        temperature = 1.0 if temperature is None else temperature
        bias = tuple((int(token), value) for token, value in (self.logit_bias or {}).items())
        for token, _ in bias:
            if token >= vocab_size:
                raise ValueError(f"logit_bias: token id {token} is outside the vocabulary of {vocab_size}")
        return SamplingParams(
            max_new_tokens=max_tokens,
            do_sample=temperature > 0,
            temperature=temperature if temperature > 0 else 1.0,
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
            grammar=grammar,
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


# --- responses --------------------------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    """A fresh id: `chatcmpl-<hex>` as OpenAI's older APIs write them, `resp_<hex>` for prefixes with `_`."""
    joint = "" if prefix.endswith("_") else "-"
    return f"{prefix}{joint}{uuid.uuid4().hex}"


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


def error_for(e: BaseException) -> ErrorResponse:
    """The OpenAI-shaped error for an exception raised while generating."""
    if isinstance(e, MissingBlocks):
        return ErrorResponse.make(503, str(e), "service_unavailable", code="missing_blocks")
    if isinstance(e, (InvalidRequest, ValueError)):
        return ErrorResponse.make(400, str(e), "invalid_request_error")
    if isinstance(e, CorollaError):  # the swarm could not serve it: servers failed, full, or timed out
        return ErrorResponse.make(503, str(e), "service_unavailable", code=type(e).__name__)
    logger.error("Generation failed", exc_info=e)
    return ErrorResponse.make(500, f"{type(e).__name__}: {e}", "server_error")
