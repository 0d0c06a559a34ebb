"""What a client holds locally: token embeddings, the final norm and the LM head.

Loaded alone from the checkpoint (no transformer block is read). With tied embeddings the LM head shares
the embedding matrix, as in the original model, so trainable embeddings stay tied.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from corolla.models.checkpoint import Checkpoint
from corolla.models.config import ModelConfig
from corolla.models.llama import RMSNorm


class ModelHead(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        with torch.device("meta"):
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    @classmethod
    def load(cls, folder: str | Path, dtype: torch.dtype = torch.float32) -> ModelHead:
        config = ModelConfig.from_folder(folder)
        head = cls(config)
        tensors = Checkpoint(folder).read_head(config.tie_word_embeddings, dtype)
        head.embed_tokens.load_state_dict({"weight": tensors["embed_tokens.weight"]}, assign=True)
        head.norm.load_state_dict({"weight": tensors["norm.weight"]}, assign=True)
        if config.tie_word_embeddings:
            head.lm_head.weight = head.embed_tokens.weight
        else:
            head.lm_head.load_state_dict({"weight": tensors["lm_head.weight"]}, assign=True)
        head.requires_grad_(False)
        return head.eval()

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)  # [B, T] -> [B, T, hidden]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))  # [B, T, hidden] -> [B, T, vocab]
