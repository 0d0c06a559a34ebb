"""A request's limits, checked before it runs: how many choices, and how many tokens the model's context
leaves for its answer (serving.py)."""

from __future__ import annotations

from corolla.api.chat import invalid
from corolla.api.formats import ResponseFormat
from corolla.api.protocol import ErrorResponse, SamplingRequest

MAX_CHOICES = 64  # prompts x n per request: each choice is a row of a generation on the swarm


def checked_max_tokens(
    request: SamplingRequest,
    prompts: list[list[int]],
    max_tokens: int | None,
    fmt: type[ResponseFormat],
    max_model_len: int,
) -> int | ErrorResponse:
    """The request's max_tokens (filled in when absent: what the context leaves), or the error naming the
    limit it breaks: choices per request, the prompt's length, or the prompt and max_tokens together."""
    if len(prompts) * request.n > MAX_CHOICES:
        return invalid(
            f"{len(prompts)} prompts x n={request.n} make {len(prompts) * request.n} choices; "
            f"at most {MAX_CHOICES} per request",
            "n" if len(prompts) == 1 else fmt.prompt_param,
        )
    longest = max(len(ids) for ids in prompts)
    if longest >= max_model_len:
        return invalid(
            f"the prompt has {longest} tokens; this model's context is {max_model_len}",
            fmt.prompt_param,
        )
    if max_tokens is None:
        max_tokens = max_model_len - longest
    if longest + max_tokens > max_model_len:
        return invalid(
            f"max_tokens={max_tokens} plus the prompt's {longest} tokens exceed this model's context of "
            f"{max_model_len} tokens",
            fmt.limit_param,
        )
    return max_tokens
