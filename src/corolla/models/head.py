"""What a client holds locally: token embeddings, the final norm and the LM head, as the family has them.

The head is the family's own causal LM from transformers, with its decoder layers left on the meta
device (never loaded). Embedding and logits run the family's own code, so whatever a family does around
its blocks comes with it, read from the checkpoint's config rather than written per family: scaled
embeddings (Gemma, Granite's multiplier), the final norm's variant, tied or separate LM heads, logit
scaling (Granite) and final logit soft-capping (Gemma 2/3).

- `embed` runs the decoder's forward up to its first layer and returns what that layer would receive.
- `logits` runs the causal LM's forward over given final hidden states: the decoder is swapped for
  `_FinalNorm`, which only applies the final norm, so the LM head and anything after it run unchanged.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from transformers.modeling_outputs import BaseModelOutputWithPast

from corolla.errors import UnsupportedModel
from corolla.models.checkpoint import Checkpoint
from corolla.models.handoff import WireLayout, merge_streams, wire_modules, with_handed
from corolla.models.loading import (
    check_layer_inputs,
    decoder_of,
    empty_model,
    final_norm,
    load_weights,
    missing_on_meta,
    target_name,
)
from corolla.models.model_config import ATTENTION_NAME, ModelConfig


class _Embedded(Exception):
    def __init__(self, hidden: torch.Tensor):
        self.hidden = hidden


def _stop_at_first_layer(module: nn.Module, args: tuple, kwargs: dict) -> None:
    raise _Embedded(args[0] if args else kwargs["hidden_states"])


class _Outputs(BaseModelOutputWithPast):
    """The decoder's outputs as the causal LM reads them; extras it may look for (an MoE model's
    router_logits) are None, as in a forward without them."""

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        return None


class _FinalNorm(nn.Module):
    """Stands in for the decoder inside the causal LM: its `inputs_embeds` are what the last block hands
    on (models/handoff.py), to which it applies what the decoder does after its layers: merging parallel
    streams (Gemma 3n, HY-V4), then the final norm. Plain attributes the causal LM reads from its decoder
    (Falcon-H1's `lm_head_multiplier`) are the decoder's."""

    def __init__(self, norm: nn.Module, decoder: nn.Module, wire: WireLayout):
        super().__init__()
        self.norm = norm
        self._decoder = [decoder]  # a list: not a submodule
        self._wire = wire

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            value = getattr(self.__dict__["_decoder"][0], name)
            if isinstance(value, (nn.Module, torch.Tensor)):
                raise
            return value

    def forward(self, *args, inputs_embeds: torch.Tensor, **kwargs) -> BaseModelOutputWithPast:
        hidden, _ = self._wire.unpack(inputs_embeds)
        decoder = self._decoder[0]
        if self._wire.streams > 1 and self._wire.streams_first:  # Gemma 3n's AltUp
            hidden = merge_streams(hidden, decoder.altup_unembed_projections)
        elif self._wire.streams > 1:  # hyper-connections: the decoder's own head
            hidden = decoder.hc_head(hidden)
        return _Outputs(last_hidden_state=self.norm(hidden))


class ModelHead(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.config = config
        model = empty_model(config, ATTENTION_NAME, dtype)  # attention never runs here
        prefix, decoder = decoder_of(model)
        # what servers would refuse, said at once
        check_layer_inputs(config.model_type, decoder.layers, config.wire.carries)
        self.embed_tokens = decoder.get_input_embeddings()
        self.norm = final_norm(decoder)
        self.lm_head = model.get_output_embeddings()
        self.wire = config.wire
        self.wire_modules = nn.ModuleDict(wire_modules(decoder))  # the head's own, loaded and moved with it
        decoder.layers[0].register_forward_pre_hook(_stop_at_first_layer, with_kwargs=True)
        # lists: not submodules (only the embeddings, norm and head above are the head's own modules)
        self._model = [model]
        self._decoder = [decoder]
        self._decoder_name = prefix[:-1]

    @classmethod
    def load(cls, folder: str | Path, dtype: torch.dtype = torch.float32) -> ModelHead:
        head = cls(ModelConfig.from_folder(folder), dtype)
        checkpoint = Checkpoint(folder)
        names = _language_model_names(checkpoint, head._decoder_name)
        model = head._model[0]
        if head.config.wrapper is not None:  # a wrapper's generation class: its language model's part only
            target = target_name(model)
            lm_head = next(n for n, m in model.named_modules() if m is head.lm_head)
            wanted = (head._decoder_name + ".", lm_head + ".")
            names = [n for n in names if (target(n) or head._decoder_name + ".").startswith(wanted)]
        load_weights(model, checkpoint, names, dtype)
        if head.config.tie_word_embeddings:
            head.lm_head.weight = head.embed_tokens.weight
        missing = missing_on_meta(head)
        if missing:
            raise UnsupportedModel(f"{folder}: the checkpoint lacks the head's tensors {missing[:5]}")
        # logits() runs the LM's forward from the final hidden states, the decoder swapped for its norm
        parent, _, name = head._decoder_name.rpartition(".")
        final = _FinalNorm(head.norm, head._decoder[0], head.wire)
        setattr(model.get_submodule(parent), name, final)
        head.requires_grad_(False)
        return head.eval()

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[B, T] token ids -> [B, T, width], what the first block receives: its hidden states (or parallel
        streams), and every layer's per-layer input where the family has them (models/handoff.py)."""
        if input_ids.dim() != 2:
            return self.embed(input_ids.reshape(1, -1)).view(*input_ids.shape, -1)
        input_ids = input_ids.to(self.embed_tokens.weight.device)
        decoder = self._decoder[0]
        try:
            decoder(input_ids=input_ids, use_cache=False)
        except _Embedded as embedded:
            hidden = embedded.hidden
        else:
            raise RuntimeError("the decoder returned without reaching its first layer")
        per_layer_inputs = None
        if self.wire.per_layer:  # the decoder's own steps, which its forward hands layer by layer
            token_part = decoder.get_per_layer_inputs(input_ids)
            per_layer_inputs = decoder.project_per_layer_inputs(self.embed_tokens(input_ids), token_part)
        return self.wire.pack(with_handed(hidden, self.wire), per_layer_inputs, input_ids)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., width] outputs of the last block -> [..., vocab]."""
        weight = self.embed_tokens.weight  # the servers' outputs, where and as the head computes
        packed = hidden.reshape(1, -1, hidden.shape[-1]).to(weight.device, weight.dtype)
        logits = self._model[0](inputs_embeds=packed, use_cache=False).logits
        return logits.view(*hidden.shape[:-1], logits.shape[-1])


def _language_model_names(checkpoint: Checkpoint, decoder_name: str) -> list[str]:
    """The checkpoint's tensors outside the blocks that belong to the language model: a multimodal
    checkpoint keeps other towers beside it. Under a root of its own (Llama 4: `language_model.model.` and
    `language_model.lm_head`), everything under that root; beside the towers (Qwen-VL:
    `model.language_model.`, `model.visual.`, `lm_head`), everything outside their common root but the
    language model's own."""
    prefix = checkpoint.prefix
    if prefix.endswith(f".{decoder_name}."):
        root = prefix[: -len(decoder_name) - 1]
        return [n for n in checkpoint.head_names() if n.startswith(root)]
    other_towers = prefix.split(".")[0] + "." if prefix.count(".") > 1 else None
    return [
        n
        for n in checkpoint.head_names()
        if n.startswith(prefix) or not (other_towers and n.startswith(other_towers))
    ]
