"""Per-request sampling parameters and the logits -> next-token step.

Processing order and semantics follow transformers' `generate`: repetition penalty, then temperature,
top-k and top-p, then a draw from the resulting distribution (greedy takes the argmax after the
penalties). OpenAI's presence and frequency penalties and logit bias come first: they subtract
`presence * (count > 0) + frequency * count` from each token's logit, counting only the tokens generated
so far (not the prompt), as OpenAI documents. A seed makes sampling reproducible: each request owns its
`torch.Generator` (without a seed, seeded from torch's global generator: `torch.manual_seed` holds too).
Log-probabilities, when asked for, are those of the model's raw distribution.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from corolla.errors import InvalidRequest


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 32
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()  # stop strings: generation ends once the text contains one
    ignore_eos: bool = False
    eos_token_ids: tuple[int, ...] | None = None  # the tokens that end a row (None: the model's)
    pad_token_id: int | None = None  # what fills a finished row (None: the model's)
    # transformers' LogitsProcessor / StoppingCriteria callables, applied as its generate applies them
    logits_processors: tuple[Any, ...] = ()
    stopping_criteria: tuple[Any, ...] = ()
    presence_penalty: float = 0.0  # OpenAI's: subtracted once from every token already generated
    frequency_penalty: float = 0.0  # OpenAI's: subtracted once per earlier occurrence in the output
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    logprobs: int | None = None  # report the chosen token's log-probability and this many alternatives
    speculative: bool = True  # draft and verify when the model has a drafter (never changes the tokens)
    # transformers' output_scores / output_logits: each step's processed scores / raw logits [B, V]
    output_scores: bool = False
    output_logits: bool = False
    grammar: str | None = None  # llguidance's grammar the output must match (decoding/constraints.py)

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise InvalidRequest(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise InvalidRequest(f"temperature must be a positive number, got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise InvalidRequest(f"top_k must be at least 1, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise InvalidRequest(f"top_p must lie in (0, 1], got {self.top_p}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise InvalidRequest(
                f"repetition_penalty must be a positive number, got {self.repetition_penalty}"
            )
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequest("stop strings must be non-empty strings")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (math.isfinite(value) and -2 <= value <= 2):
                raise InvalidRequest(f"{name} must lie in [-2, 2], got {value}")
        self._check_outputs()

    def _check_outputs(self) -> None:
        if self.grammar is not None and self.ignore_eos:
            raise InvalidRequest("ignore_eos cannot go with a grammar: a complete output ends with EOS")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise InvalidRequest(f"logprobs must lie in 0..20, got {self.logprobs}")

    @property
    def penalizes_output(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0

    def make_generator(self) -> torch.Generator:
        """The request's own generator: from its seed, else seeded by a draw from torch's global generator
        (so `torch.manual_seed` makes sampling reproducible, as in transformers, and the global generator is
        advanced, never re-seeded)."""
        seed = self.seed if self.seed is not None else int(torch.randint(0, 2**62, ()).item())
        return torch.Generator().manual_seed(seed)


def apply_repetition_penalty(logits: torch.Tensor, context_ids: torch.Tensor, penalty: float) -> torch.Tensor:
    """logits [B, V]; context_ids [B, T]: every token already present is made less likely."""
    if penalty == 1.0:
        return logits
    scores = torch.gather(logits, 1, context_ids)
    scores = torch.where(scores < 0, scores * penalty, scores / penalty)
    return logits.scatter(1, context_ids, scores)


def apply_openai_penalties(
    logits: torch.Tensor, output_ids: torch.Tensor, params: SamplingParams
) -> torch.Tensor:
    """logits [B, V]; output_ids [B, t]: the tokens generated so far. Adds logit_bias, subtracts penalties."""
    if params.logit_bias:
        ids, biases = zip(*params.logit_bias, strict=True)
        logits = logits.index_add(
            1, torch.tensor(ids), torch.tensor(biases, dtype=logits.dtype)[None].expand(len(logits), -1)
        )
    if params.penalizes_output and output_ids.shape[1]:
        counts = torch.zeros_like(logits).scatter_add_(
            1, output_ids, torch.ones_like(output_ids, dtype=logits.dtype)
        )
        logits = (
            logits
            - params.frequency_penalty * counts
            - params.presence_penalty * (counts > 0).to(logits.dtype)
        )
    return logits


def warp(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, then top-p (nucleus) filtering; filtered logits become -inf."""
    logits = logits / params.temperature
    if params.top_k is not None and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, -math.inf)
    if params.top_p < 1.0:
        sorted_logits, sorted_idx = torch.sort(logits, descending=False, dim=-1)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove = cumulative <= 1 - params.top_p
        remove[..., -1] = False  # always keep the most likely token
        logits = logits.masked_fill(remove.scatter(1, sorted_idx, remove), -math.inf)
    return logits


def processed_scores(
    logits: torch.Tensor, context_ids: torch.Tensor, params: SamplingParams, output_ids: torch.Tensor | None
) -> torch.Tensor:
    """The scores a token is chosen from (transformers' `scores`): logits [B, V] after the penalties, the
    sampling warpers, then the caller's logits processors (run last, as transformers runs custom ones)."""
    logits = logits.float()
    if params.logit_bias or params.penalizes_output:
        none = context_ids[:, :0]
        logits = apply_openai_penalties(logits, none if output_ids is None else output_ids, params)
    logits = apply_repetition_penalty(logits, context_ids, params.repetition_penalty)
    if params.do_sample:
        logits = warp(logits, params)
    for processor in params.logits_processors:
        logits = processor(context_ids, logits)
    return logits


def pick(scores: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """The argmax of each row's scores [B, V], or a draw from their softmax with `generator`."""
    if not params.do_sample:
        return scores.argmax(dim=-1)
    return torch.multinomial(scores.softmax(dim=-1), 1, generator=generator).squeeze(1)


def top_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The raw model log-probabilities: of the chosen tokens [B], and the k best (values, ids) [B, k]."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, tokens[:, None]).squeeze(1)
    best = torch.topk(logprobs, k, dim=-1) if k else (logprobs[:, :0], tokens[:, None][:, :0])
    return chosen, best[0], best[1]
