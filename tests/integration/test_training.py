"""Fine-tuning SmolLM2 through a real swarm: the loss and gradients of a model tuned with deep prompts,
through 3 servers, equal local autograd's (tests/autograd_reference.py). Training on tiny
models, failover included, is tested socket-free in tests/unit/client/test_training*.py."""

from __future__ import annotations

import torch

from autograd_reference import PREFIX, check_gradients
from swarm_helpers import SMOL_CHAINS, connect


def test_smollm2_gradients_match_local_autograd(smollm2_path, smol_swarm, smol_reference):
    tokenizer_ids = torch.tensor(
        [[1, 504, 3458, 282, 4649, 314, 7042, 30], [1, 2683, 314, 260, 1326, 2, 2, 2]]
    )
    labels = tokenizer_ids.clone()
    labels[1, -3:] = -100
    with connect(
        smollm2_path, smol_swarm, SMOL_CHAINS[3], tuning_mode="deep_ptune", pre_seq_len=PREFIX
    ) as model:
        check_gradients(model, smol_reference, tokenizer_ids, labels)
