"""Random-weight checkpoints with a real model's shapes, saved as Hugging Face folders.

A benchmark at a real model's size needs its shapes, not its weights: transformers builds the model from
a config (its own initialisation, seeded, so every run saves the same weights) and saves it where a
server and transformers both load it. Owns building and saving only; the configs are each script's.
"""

from __future__ import annotations

from pathlib import Path

import torch


def save_random(config, folder: str | Path, model_class=None, dtype: torch.dtype = torch.bfloat16) -> None:
    """Save a model of `config` with seeded random weights in `dtype` to `folder`; `model_class`: a
    concrete transformers class (a multimodal wrapper, say), else the causal LM `config` maps to."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    if model_class is None:
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    else:
        model = model_class._from_config(config, dtype=dtype)
    model.save_pretrained(folder)
