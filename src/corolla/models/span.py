"""A contiguous span of a model's transformer blocks: loaded alone, run alone.

`Span.load(folder, start, end)` builds blocks [start, end) on the meta device and fills them with just
those blocks' tensors from the checkpoint, so a server hosting 10 of 30 layers never allocates the other
20. `Span.forward` runs any sub-range of the span over hidden states at absolute positions, with an
attention context that owns the cache (or none for a plain forward pass).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from corolla.errors import InvalidRequest
from corolla.models.attention import AttentionContext, NoCache
from corolla.models.checkpoint import Checkpoint
from corolla.models.config import ModelConfig
from corolla.models.llama import LlamaBlock
from corolla.models.rotary import RotaryEmbedding


class Span(nn.Module):
    def __init__(self, config: ModelConfig, start: int, end: int):
        super().__init__()
        if not 0 <= start < end <= config.num_hidden_layers:
            raise InvalidRequest(
                f"blocks {start}:{end} are not a non-empty range inside the model's "
                f"{config.num_hidden_layers} blocks"
            )
        self.config, self.start, self.end = config, start, end
        self.rotary = RotaryEmbedding(config.rope, config.head_dim)
        with torch.device("meta"):
            self.blocks = nn.ModuleList(LlamaBlock(config, i) for i in range(start, end))

    @classmethod
    def load(cls, folder: str | Path, start: int, end: int, dtype: torch.dtype = torch.float32) -> Span:
        config = ModelConfig.from_folder(folder)
        span = cls(config, start, end)
        checkpoint = Checkpoint(folder)
        # a progress bar on a terminal (tqdm leaves logs and pipes alone): big spans take minutes to read
        blocks = tqdm(
            span.blocks, desc=f"Loading blocks {start}:{end}", unit="block", disable=None, leave=False
        )
        for offset, block in enumerate(blocks):
            block.load_state_dict(checkpoint.read_block(start + offset, dtype), strict=True, assign=True)
        span.requires_grad_(False)
        return span.eval()

    @property
    def dtype(self) -> torch.dtype:
        return self.blocks[0].input_layernorm.weight.dtype

    def forward(
        self,
        hidden: torch.Tensor,
        context: AttentionContext | None = None,
        position: int = 0,
        prompts: torch.Tensor | None = None,
        blocks: tuple[int, int] | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run blocks [a, b) of the model (absolute indices, default: the whole span).

        hidden: [B, T, hidden] for tokens at positions [position, position + T), or at `positions` [T]
        when given (packed batches of several sequences).
        prompts: optional deep-prompt additions aligned with hidden, [b - a, B or 1, T, hidden] (see
        `align_prompts`), added to each block's input. The context's cache layer i belongs to block a + i.
        """
        first, last = blocks or (self.start, self.end)
        context = context or NoCache()
        if positions is None:
            positions = torch.arange(position, position + hidden.shape[1])
        rotary = self.rotary(positions, hidden.dtype)
        for layer, block in enumerate(self.blocks[first - self.start : last - self.start]):
            if prompts is not None:
                hidden = hidden + prompts[layer].to(hidden.dtype)
            hidden = block(hidden, rotary, context, layer)
        return hidden


def align_prompts(prompts: torch.Tensor | None, position: int, length: int) -> torch.Tensor | None:
    """Deep prompts [blocks, B, P, H] as additions for positions [position, position + length), or None.

    prompts[:, :, p] is added to the token at absolute position p; positions >= P get nothing.
    """
    if prompts is None or prompts.numel() == 0 or position >= prompts.shape[2]:
        return None
    aligned = prompts.new_zeros(prompts.shape[0], prompts.shape[1], length, prompts.shape[3])
    covered = min(prompts.shape[2], position + length) - position
    aligned[:, :, :covered] = prompts[:, :, position : position + covered]
    return aligned
