"""What code written for a transformers model reads from one, on corolla's client (client/model.py).

`config` is the checkpoint's transformers `PretrainedConfig` (corolla's own view of it: `model_config`),
`generation_config` its `GenerationConfig`; `device` and `dtype` are those of the parts computed here
(the embeddings and the LM head); `eval()` and `train()` switch those parts and return the model, as
`nn.Module`'s do; `to(device, dtype)` moves those parts (hidden states still cross the network on the
CPU). The blocks live on the servers and have no device here. `compute_transition_scores` is
transformers' own, over `generate(..., return_dict_in_generate=True, output_scores=True)`'s scores.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import GenerationMixin

from corolla.models.head import ModelHead
from corolla.models.model_config import ModelConfig


class TransformersModel:
    model_config: ModelConfig
    head: ModelHead

    @property
    def config(self) -> Any:
        """The checkpoint's transformers PretrainedConfig (of the language model)."""
        return self.model_config.hf

    @property
    def device(self) -> torch.device:
        return self.head.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.head.dtype

    def eval(self) -> TransformersModel:
        self.head.eval()
        return self

    def train(self, mode: bool = True) -> TransformersModel:
        self.head.train(mode)
        return self

    def to(self, *args: Any, **kwargs: Any) -> TransformersModel:
        """`nn.Module.to` of the parts computed here (embeddings, final norm, LM head)."""
        self.head.to(*args, **kwargs)
        return self

    def can_generate(self) -> bool:
        return True

    compute_transition_scores = GenerationMixin.compute_transition_scores
