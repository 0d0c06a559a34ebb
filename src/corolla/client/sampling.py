"""Per-request sampling parameters and the logits -> next-token step.

Processing order and semantics follow transformers' `generate`: repetition penalty, then temperature,
top-k and top-p, then a draw from the resulting distribution (greedy takes the argmax after the
repetition penalty). A seed makes sampling reproducible: each request owns its `torch.Generator`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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

    def make_generator(self) -> torch.Generator:
        generator = torch.Generator()
        generator.manual_seed(self.seed if self.seed is not None else torch.seed())
        return generator


def apply_repetition_penalty(logits: torch.Tensor, context_ids: torch.Tensor, penalty: float) -> torch.Tensor:
    """logits [B, V]; context_ids [B, T]: every token already present is made less likely."""
    if penalty == 1.0:
        return logits
    scores = torch.gather(logits, 1, context_ids)
    scores = torch.where(scores < 0, scores * penalty, scores / penalty)
    return logits.scatter(1, context_ids, scores)


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


def next_tokens(
    logits: torch.Tensor, context_ids: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> torch.Tensor:
    """Choose the next token of each row: logits [B, V] (float32), context_ids [B, T] -> [B]."""
    logits = apply_repetition_penalty(logits.float(), context_ids, params.repetition_penalty)
    if not params.do_sample:
        return logits.argmax(dim=-1)
    probs = warp(logits, params).softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)
