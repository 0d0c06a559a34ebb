"""What transformers' `generate` returns with `return_dict_in_generate`, from corolla's generation steps
(client/hf/generate.py).

`GenerateDecoderOnlyOutput`: `sequences`, and with `output_scores` / `output_logits` one [B, V] tensor per
new token: the scores the token was chosen from (after penalties, warpers and the caller's processors) /
the model's raw logits, as transformers keeps them. Rows of a padded batch run apart (each its own
session); a row that ended before the longest has, for each later step, scores that make its padding
certain (0 for `pad_token_id`, -inf elsewhere), so `compute_transition_scores` gives 0 there. Beam search
returns `GenerateBeamDecoderOnlyOutput`: sequences, beam_indices, and with `output_scores` the sequences'
scores and each step's log-probabilities (one prompt per call for those). Attentions, hidden states and
the cache stay on the servers: asking for them is refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers.generation.utils import GenerateBeamDecoderOnlyOutput, GenerateDecoderOnlyOutput

from corolla.client.hf.beam_search import BeamResult
from corolla.decoding.chooser import GenerationStep


@dataclass
class StepRecord:
    """The steps of one generation [B rows], withdrawn steps (a spot check's rewind) removed."""

    tokens: list[torch.Tensor] = field(default_factory=list)  # [B] each
    scores: list[torch.Tensor] = field(default_factory=list)  # [B, V] each (output_scores)
    logits: list[torch.Tensor] = field(default_factory=list)  # [B, V] each (output_logits)

    def add(self, step: GenerationStep) -> None:
        if step.withdrawn:
            for kept in (self.tokens, self.scores, self.logits):
                del kept[max(0, len(kept) - step.withdrawn) :]
            return
        self.tokens.append(step.tokens)
        if step.scores is not None:
            self.scores.append(step.scores)
        if step.logits is not None:
            self.logits.append(step.logits)

    def sequences(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[B, T + new]: the inputs, then the new tokens."""
        new = [tokens[:, None].to(input_ids.dtype) for tokens in self.tokens]
        return torch.cat([input_ids, *new], dim=1)


def merge_rows(records: list[StepRecord], pad_token_id: int) -> StepRecord:
    """Records of one row each -> one of every row, a row that ended early padded (its padding certain)."""
    longest = max(len(record.tokens) for record in records)
    pad = torch.tensor([pad_token_id])
    merged = StepRecord()
    for index in range(longest):
        merged.tokens.append(torch.cat([_at(r.tokens, index, pad) for r in records]))
    for name in ("scores", "logits"):
        kept = [getattr(record, name) for record in records]
        if not all(kept):
            continue
        vocab = kept[0][0].shape[-1]
        certain = torch.full((1, vocab), -torch.inf)
        certain[0, pad_token_id] = 0.0
        for index in range(longest):
            getattr(merged, name).append(torch.cat([_at(rows, index, certain) for rows in kept]))
    return merged


def _at(steps: list[torch.Tensor], index: int, missing: torch.Tensor) -> torch.Tensor:
    return steps[index] if index < len(steps) else missing


def decoder_output(sequences: torch.Tensor, record: StepRecord) -> GenerateDecoderOnlyOutput:
    return GenerateDecoderOnlyOutput(
        sequences=sequences,
        scores=tuple(record.scores) or None,
        logits=tuple(record.logits) or None,
    )


def beam_output(found: BeamResult, with_scores: bool) -> GenerateBeamDecoderOnlyOutput:
    return GenerateBeamDecoderOnlyOutput(
        sequences=found.sequences,
        sequences_scores=found.sequences_scores if with_scores else None,
        scores=found.scores,
        logits=found.logits,
        beam_indices=found.beam_indices,
    )
