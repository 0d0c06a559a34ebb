"""A request's choices (one per prompt and n) and how each generation step moves them: tokens become
text that never shows a stop string (decoding/text.py), with the finish reason once a choice ends."""

from __future__ import annotations

from corolla.api.tool_calls import CallFormat, CallStream
from corolla.decoding.chooser import GenerationStep
from corolla.decoding.text import IncrementalText

Step = tuple[int, float | None, list[tuple[int, float]]]  # token, its logprob, [(alternative, logprob)]


class Choice:
    def __init__(self, index: int, text: IncrementalText, calls: CallFormat | None = None):
        self.index = index
        self.text = text
        self.steps: list[Step] = []
        self.calls = CallStream(calls) if calls else None  # with tools: the calls apart from the content
        self.route: tuple = ()  # the servers that computed its last token (Hops)


Moved = tuple[Choice, str, Step | None]  # a choice, the text it released, the token that released it


def advance(choices: list[Choice], prompt_index: int, step: GenerationStep, max_tokens: int) -> list[Moved]:
    """(choice, released text, token) for each choice of prompt `prompt_index` that this step moved."""
    moved = []
    rows = step.tokens.shape[0]
    for row in range(rows):
        choice = choices[prompt_index * rows + row]
        if choice.text.finish_reason is not None:
            continue
        token = int(step.tokens[row])
        delta = choice.text.add(token)
        if bool(step.finished[row]):
            delta += choice.text.finish("stop")  # no-op unless the generator saw a stop string first
        elif len(choice.text.token_ids) >= max_tokens:
            delta += choice.text.finish("length")
        entry = step_logprobs(step, row, token)
        choice.steps.append(entry)
        choice.route = step.route
        moved.append((choice, delta, entry))
    return moved


def step_logprobs(step: GenerationStep, row: int, token: int) -> Step:
    if step.logprobs is None:
        return token, None, []
    top = list(zip(step.top_ids[row].tolist(), step.top_values[row].tolist(), strict=True))
    return token, float(step.logprobs[row]), top
