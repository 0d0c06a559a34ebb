"""A causal LM's forward pass around the swarm: the first block's inputs (with trained prompts) and the
logits and loss from the last block's outputs. The blocks themselves run on servers
(client/training/remote_chain.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from corolla.client.training.ptune import PromptTuning
from corolla.errors import InvalidRequest
from corolla.models.head import ModelHead


@dataclass
class CausalLMOutput:
    logits: torch.Tensor  # [B, T, vocab]
    hidden_states: torch.Tensor  # [B, T, hidden], the last block's outputs (before the final norm)
    loss: torch.Tensor | None = None  # next-token cross-entropy, when labels were given


def chain_inputs(
    head: ModelHead, ptune: PromptTuning | None, input_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first block's inputs [B, (P +) T, H] and the deep prompts (or an empty tensor)."""
    hidden = head.embed(input_ids)
    if ptune is None:
        return hidden, hidden.new_empty(0)
    hidden = torch.cat([ptune.prefix(hidden.shape[0]).to(hidden.dtype), hidden], dim=1)
    return hidden, ptune.block_prompts()


def causal_lm_output(
    head: ModelHead, ptune: PromptTuning | None, outputs: torch.Tensor, labels: torch.Tensor | None
) -> CausalLMOutput:
    """Logits of the last block's outputs [B, (P +) T, H] (the trained prefix dropped) and, with `labels`
    [B, T] (-100 = ignored), the next-token cross-entropy."""
    if ptune is not None:
        outputs = outputs[:, ptune.pre_seq_len :]
    logits = head.logits(outputs)
    loss = None
    if labels is not None:
        if labels.shape != logits.shape[:2]:
            raise InvalidRequest(f"labels must have the inputs' shape {list(logits.shape[:2])}")
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten().long(), ignore_index=-100
        )
    return CausalLMOutput(logits, outputs, loss)
