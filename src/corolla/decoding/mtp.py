"""The model's own multi-token prediction (MTP) layers as a drafter.

Checkpoints of DeepSeek-V3 and V3.2, GLM-4.5 and others carry `num_nextn_predict_layers` layers after their
last block (stored as layers N, N+1, ...). The first takes the model's final hidden state at a position i
(after the final norm, as transformers feeds it) and the embedding of the token at i + 1, runs one decoder
layer of the model's own kind over a cache of its own, and predicts the token at i + 2 with the model's LM
head. transformers builds these layers (`MtpModel`, modeling_layers.py) from the model's own classes;
`MtpDrafter.load` fills them through transformers' weight conversions, sharing the client's embeddings and
LM head (no copy).

The client sees the final hidden states of every position the swarm computes for it, and the generation
loop hands each verified one to the session with the token chosen from it (`observe`). A draft runs the
layer over the verified positions not yet in its cache (they stay), then on from there over tokens not
verified yet and the drafted ones, each time on the layer's own output instead of the model's hidden
state (as vLLM drafts past a checkpoint's MTP layers); those positions are cropped from the cache after.
A checkpoint with several MTP layers drafts with its first one only.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from corolla.decoding.drafting import Draft
from corolla.errors import InvalidRequest, UnsupportedModel

if TYPE_CHECKING:
    from corolla.models.head import ModelHead
    from corolla.models.model_config import ModelConfig

MTP = "mtp"  # the drafter's name (--draft mtp)


def mtp_layers(config: ModelConfig) -> int:
    """How many MTP layers the model's config announces (0: none)."""
    return int(getattr(config.hf.get_text_config(), "num_mtp_layers", None) or 0)


class MtpDrafter:
    name = MTP

    def __init__(self, model: torch.nn.Module, norm: torch.nn.Module):
        self.model = model  # transformers' MtpModel, its embeddings and head the client's
        self.norm = norm  # the model's final norm (the client head's)

    @classmethod
    def load(cls, folder: Path, config: ModelConfig, head: ModelHead) -> MtpDrafter:
        from transformers.modeling_layers import MtpModel

        from corolla.models.checkpoint import Checkpoint
        from corolla.models.loading import build_empty, empty_model, load_converted, missing_on_meta

        layers = mtp_layers(config)
        if layers < 1:
            raise InvalidRequest(
                f"--draft mtp: {folder} ({config.model_type}) has no multi-token prediction layers "
                "(its config has no num_nextn_predict_layers); draft with lookup or a draft model"
            )
        if not config.wire.plain:
            raise UnsupportedModel(
                f"--draft mtp: {config.model_type} hands its blocks more than hidden states"
            )
        main = empty_model(config, "sdpa", head.dtype)  # meta: only its classes and rotary embedding are used
        model = build_empty(lambda: MtpModel(main, layers))
        checkpoint = Checkpoint(folder)
        first = config.num_hidden_layers
        stored = [f"{checkpoint.prefix}layers.{first + k}." for k in range(layers)]
        names = [n for n in checkpoint.weight_map if n.startswith(tuple(stored))]
        if not any(n.startswith(stored[0]) for n in names):
            raise UnsupportedModel(
                f"--draft mtp: {folder} announces {layers} MTP layer(s) but stores no tensors for layer "
                f"{first} (some releases leave them out)"
            )
        tensors = checkpoint.read(names, owned=True)  # an MoE block: its experts are fused
        load_converted(model, tensors, model.get_weight_conversions(main), head.dtype, checkpoint)
        model.embed_tokens = head.embed_tokens  # shared with the head: one copy
        model.shared_head = head.lm_head
        missing = missing_on_meta(model)
        if missing:
            raise UnsupportedModel(f"--draft mtp: {folder} lacks the MTP layers' tensors {missing[:5]}")
        model.requires_grad_(False)
        return cls(model.eval(), head.norm)

    def start(self, max_length: int) -> MtpSession:
        return MtpSession(self)


@dataclass
class MtpSession:
    """One generation's MTP state: the layer's cache over the verified positions it has run (from the
    context index `start`), and what was observed since."""

    drafter: MtpDrafter
    cache: object = None
    start: int | None = None  # the context index of the cache's first position
    cached: int = 0  # positions in the cache
    hidden: list[torch.Tensor] = field(default_factory=list)  # observed after those: [1, H] each
    chosen: list[int] = field(default_factory=list)  # the token chosen from each of them
    tail: torch.Tensor | None = None  # the layer's output at the cache's last position [1, 1, H]
    after: int | None = None  # the token chosen there: the first token the tail is followed by
    _observed: list = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def observe(self, index: int, hidden: torch.Tensor, chosen: list[int]) -> None:
        """The last block's outputs [T, H] at context indices index, index + 1, ... (verified: everything
        drafted after them is dropped), and the token chosen from each. Called from the decode loop; the
        work waits for the next draft (in the drafter's thread)."""
        with self._lock:
            self._observed.append((index, hidden.detach(), list(chosen)))

    def propose(self, context: list[int], depth: int, max_tokens: int) -> Draft:
        self._take()
        if self.start is None:
            return Draft()
        with torch.no_grad():
            self._run_verified()
            frontier = self.start + self.cached  # the context index whose token the tail predicts after
            if self.tail is None or frontier >= len(context) or context[frontier] != self.after:
                return Draft()  # asked for text the verified outputs have left (a dropped epoch)
            tokens = self._draft(context[frontier:], min(depth, max_tokens))
            self._crop()
        return Draft(tokens, list(range(-1, len(tokens) - 1)))

    def _take(self) -> None:
        with self._lock:
            observed = self._observed
            self._observed = []
        for index, hidden, chosen in observed:
            self._forget_from(index)
            normed = self.drafter.norm(hidden.to(self.drafter.norm.weight.dtype))
            self.hidden += list(normed.unsqueeze(1))
            self.chosen += chosen[: hidden.shape[0]]

    def _forget_from(self, index: int) -> None:
        """Make `index` the next position observed: forget what was observed from it on (a rollback), or
        start over where it does not follow what was observed (the first observation, or a gap)."""
        if self.start is None or not self.start <= index <= self.start + self.cached + len(self.chosen):
            self._reset(index)
        elif index < self.start + self.cached:  # into what the cache holds
            self.cached = index - self.start
            self._crop()
            self.tail = None
            self.hidden = []
            self.chosen = []
        else:
            keep = index - self.start - self.cached
            del self.hidden[keep:]
            del self.chosen[keep:]

    def _crop(self) -> None:
        """Drop the cache's positions after the verified ones."""
        extra = self.cache.get_seq_length() - self.cached
        if extra > 0:
            self.cache.crop(-extra)

    def _reset(self, index: int) -> None:
        from transformers.cache_utils import MtpCache

        self.cache = MtpCache(config=self.drafter.model.config)
        self.start = index
        self.cached = 0
        self.tail = None
        self.hidden = []
        self.chosen = []

    def _run_verified(self) -> None:
        """Run the layer over the observed positions not in the cache yet (they stay)."""
        if not self.chosen:
            return
        hidden = torch.cat(self.hidden, dim=0)[None]  # [1, T, H]
        outputs = self._layer(torch.tensor([self.chosen]), hidden)
        self.cached += len(self.chosen)
        self.tail = outputs[:, -1:]
        self.after = self.chosen[-1]
        self.hidden = []
        self.chosen = []

    def _draft(self, unverified: list[int], depth: int) -> list[int]:
        """From the tail: the tokens after `unverified` (the context from the frontier: its first token is
        the one chosen after the cache's last position), then `depth` drafted ones, each position on the
        layer's previous output."""
        out = self.tail
        for token in unverified[1:]:  # text not verified yet: the layer runs on its own outputs
            out = self._layer(torch.tensor([[token]]), out)
        drafted: list[int] = []
        while len(drafted) < depth:
            logits = self.drafter.model._project_to_logits(out[:, -1])
            drafted.append(int(logits.argmax(dim=-1)))
            if len(drafted) < depth:
                out = self._layer(torch.tensor([drafted[-1:]]), out)
        return drafted

    def _layer(self, tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The first MTP layer over tokens [1, T] and the hidden states before them [1, T, H], at the
        cache's next positions (as transformers numbers them: the tokens' own positions)."""
        length = self.cache.get_seq_length()
        positions = torch.arange(length + 1, length + 1 + tokens.shape[1])[None]
        model = self.drafter.model
        device = model.embed_tokens.weight.device
        return model.forward_layer(
            0, hidden.to(device), positions.to(device), self.cache, input_ids=tokens.to(device)
        )
