"""corolla: run large language models across a swarm of ordinary machines.

Public API: `DistributedModelForCausalLM` (client; `AutoDistributedModelForCausalLM` is the same class: one
client serves every family), `SamplingParams`, and the error types. Importing
corolla has one side effect: torchao, which transformers imports whenever it is installed, logs at import
that it cannot load its CUDA-only extensions on a CPU machine and torch deprecation notes about its
enums, and bitsandbytes (blockwise 8-bit wire encoding) that a 4-bit CPU kernel it offers is missing;
those loggers only report errors. Heavy modules load when first used.
"""

from __future__ import annotations

import logging

from corolla.version import __version__

for _noisy in ("torchao", "torch.utils._pytree", "bitsandbytes"):
    logging.getLogger(_noisy).setLevel(logging.ERROR)

__all__ = ["AutoDistributedModelForCausalLM", "DistributedModelForCausalLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # lazy: a server process must not pay for the client's imports (tokenizers, transformers)
    if name in ("DistributedModelForCausalLM", "AutoDistributedModelForCausalLM"):
        from corolla.client.model import DistributedModelForCausalLM

        return DistributedModelForCausalLM
    if name == "SamplingParams":
        from corolla.decoding.sampling import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'corolla' has no attribute {name!r}")
