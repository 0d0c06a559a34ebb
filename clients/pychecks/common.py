"""What the Python clients' checks share: the setup, the requests' contents, the schemas and the checks of
answers' shapes. Plain Python and pydantic (every client brings pydantic): no client is imported here.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict

EMBEDDING_SIZE = 576  # SmolLM2-135M's hidden size
TEXTS = ["The sky is blue because of Rayleigh scattering.", "Corolla runs language models on a swarm."]
WEATHER = json.dumps({"city": "Paris", "sky": "sunny", "celsius": 21})  # the tool's result
# the city is bounded (maxLength): constrained decoding keeps a random-weight model inside a string for as
# long as the schema allows
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 24}},
            "required": ["city"],
        },
    },
}
FORCE_WEATHER = {"type": "function", "function": {"name": "get_weather"}}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]
SAY_HELLO = [{"role": "user", "content": "Say hello."}]
ASK_CAPITAL = [
    {
        "role": "user",
        "content": "What is the capital of France? Answer in JSON with the city and its country.",
    }
]
ASK_FORECAST = [{"role": "user", "content": "Is it sunny in Paris? Answer in JSON."}]
# max_tokens of a tool call, an answer, a JSON answer. The tiny model's tokenizer spends a token per byte:
# a call is ~60 tokens around its city, and a random model's city can be 24 four-byte characters
CALL_TOKENS, ANSWER_TOKENS, JSON_TOKENS = 200, 16, 200


class Forecast(BaseModel):
    """For the tiny random model: enums and a boolean only, so whatever it chooses ends."""

    model_config = ConfigDict(extra="forbid")
    city: Literal["Paris", "Oslo", "Lima"]
    sunny: bool


class Capital(BaseModel):
    """For SmolLM2: two free strings."""

    model_config = ConfigDict(extra="forbid")
    city: str
    country: str


class CheckFailed(Exception):
    """An answer that came back in the wrong shape."""


@dataclass(frozen=True)
class Setup:
    key: str
    tool_url: str
    tool_model: str
    smol_url: str
    smol_model: str


def require(condition: object, message: str) -> None:
    if not condition:
        raise CheckFailed(message)


def expect_error(error_type: type[Exception], call: Callable[[], object]) -> Exception:
    """The error `call` raises, which must be an `error_type` (anything else propagates)."""
    try:
        answer = call()
    except error_type as error:
        return error
    raise CheckFailed(f"expected {error_type.__name__}, got an answer: {str(answer)[:300]}")


def check_tool_call(
    name: str | None, arguments: str | dict | None, finish_reason: str | None, content: str | None
) -> str:
    """A get_weather call with a string city (arguments as JSON text, or already parsed by the client).

    The call was forced (tool_choice), so the answer's grammar holds calls only: any content is the
    call markup's text leaking out (e.g. an unfinished second call cut by max_tokens)."""
    require(name == "get_weather", f"the tool call names {name!r}, not get_weather")
    parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
    require(isinstance(parsed, dict), f"the arguments are not a JSON object: {arguments!r}")
    require(isinstance(parsed.get("city"), str), f"the arguments have no string city: {arguments!r}")
    require(finish_reason == "tool_calls", f"finish_reason is {finish_reason!r}, not 'tool_calls'")
    require(not content, f"a forced call came with content {content!r} (finish_reason {finish_reason!r})")
    return f"get_weather({json.dumps(parsed, ensure_ascii=False)})"


def check_answer(content: object, finish_reason: str | None = None) -> str:
    require(isinstance(content, str), f"the final answer's content is {content!r}, not a string")
    return f"answer {content!r}" + (f" ({finish_reason})" if finish_reason else "")


def check_vectors(vectors: list[list[float]]) -> None:
    require(len(vectors) == 2, f"{len(vectors)} embeddings for 2 texts")
    sizes = [len(vector) for vector in vectors]
    require(sizes == [EMBEDDING_SIZE] * 2, f"embedding sizes {sizes}, expected {EMBEDDING_SIZE}")
    require(all(isinstance(x, float) for v in vectors for x in v), "the embeddings are not lists of floats")
    require(vectors[0] != vectors[1], "the two texts have the same embedding")


def check_same(first: list[list[float]], again: list[list[float]], what: str) -> None:
    """`again` has the right shape and equals `first` (within float32 printing's rounding)."""
    check_vectors(again)
    pairs = zip(first, again, strict=True)
    difference = max(abs(x - y) for u, v in pairs for x, y in zip(u, v, strict=True))
    require(difference <= 1e-5, f"{what} differs from the first call by up to {difference:.3g}")


def embeddings_detail(vectors: list[list[float]], calls: str) -> str:
    head = ", ".join(f"{x:.4f}" for x in vectors[0][:3])
    return f"2 x {len(vectors[0])} ([{head}, ...]), identical on {calls}"
