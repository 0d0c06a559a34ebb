"""Trainable prompts on the client: prompt tuning and deep prompt tuning.

- "ptune": `pre_seq_len` trainable embeddings are put before every input's token embeddings.
- "deep_ptune": the same, plus a trainable prompt per block: `deep_prompts[i]` is added to the first
  `pre_seq_len` positions of block i's input on the server (sent with each forward/backward request).
Both start so that the model behaves as it did untrained: the input prefix from the embeddings of
ordinary tokens, the deep prompts at zero.
"""

from __future__ import annotations

import torch
from torch import nn

from corolla.errors import InvalidRequest

TUNING_MODES = (None, "ptune", "deep_ptune")


class PromptTuning(nn.Module):
    def __init__(self, mode: str, pre_seq_len: int, num_blocks: int, embeddings: nn.Embedding, seed: int = 0):
        super().__init__()
        if mode not in TUNING_MODES[1:]:
            raise InvalidRequest(f"tuning_mode must be one of {TUNING_MODES}, got {mode!r}")
        if pre_seq_len < 1:
            raise InvalidRequest(
                f"pre_seq_len must be at least 1 with tuning_mode={mode!r}, got {pre_seq_len}"
            )
        self.mode = mode
        self.pre_seq_len = pre_seq_len
        generator = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, embeddings.num_embeddings, (pre_seq_len,), generator=generator)
        self.prompt_embeddings = nn.Parameter(embeddings.weight[ids].detach().clone())
        hidden = embeddings.embedding_dim
        self.deep_prompts = (
            nn.Parameter(torch.zeros(num_blocks, pre_seq_len, hidden, dtype=embeddings.weight.dtype))
            if mode == "deep_ptune"
            else None
        )

    def prefix(self, batch: int) -> torch.Tensor:
        """[B, P, H] embeddings to put before the inputs'."""
        return self.prompt_embeddings[None].expand(batch, -1, -1)

    def block_prompts(self) -> torch.Tensor:
        """[blocks, 1, P, H] for the servers (the same for every row), or an empty tensor."""
        if self.deep_prompts is None:
            return self.prompt_embeddings.new_empty(0)
        return self.deep_prompts[:, None]
