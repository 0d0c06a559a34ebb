"""Whether two servers' results agree: the one comparison spot checks make.

`deviation`: per position, the L2 distance between two servers' hidden states relative to the
reference's norm. Honest replicas in other precisions (bfloat16, float16, int8, int4) stay well within
TOLERANCE; every simulated fault (server/faults.py) goes far past it (bench/trust/spot_check_calibration.py
measures both).
"""

from __future__ import annotations

import torch

EPSILON = 1e-6
# SmolLM2, every pair of float32, bfloat16, float16, int8 and int4 replicas: at most 0.09 over 10 blocks and
# 0.14 over all 30 (bfloat16 vs int8); every simulated fault has a median of 0.14 (noise:0.03) to 1.4
TOLERANCE = 0.25
# gradients drift more: SmolLM2's gradients wrt a span's inputs, as one vector, differ by at most 0.08
# between precisions over 10 blocks and 0.23 over all 30 (bfloat16 vs int8); faults' medians are 0.21
# (noise:0.03) to 1.34, so the subtlest faults are left to the forward checks
GRADIENT_TOLERANCE = 0.5


def deviation(outputs: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """[..., T, H] x [..., T, H] -> [..., T]: |outputs - reference| / |reference| per position."""
    outputs = outputs.float()
    reference = reference.float()
    return (outputs - reference).norm(dim=-1) / reference.norm(dim=-1).clamp_min(EPSILON)


def outputs_agree(result: torch.Tensor, reference: torch.Tensor) -> bool:
    """Whether hidden states [B, T, H] agree with the reference's at every position (within TOLERANCE)."""
    return first_wrong(result, reference) is None


def gradients_agree(result: torch.Tensor, reference: torch.Tensor) -> bool:
    """Whether a backward's gradients agree with the reference's: compared as one vector (a position's
    gradient can be tiny, so positions are not compared alone), within GRADIENT_TOLERANCE."""
    return float(deviation(result.reshape(1, -1), reference.reshape(1, -1))) <= GRADIENT_TOLERANCE


def first_wrong(outputs: torch.Tensor, reference: torch.Tensor) -> int | None:
    """The first position [B, T, H] where any row deviates past TOLERANCE (None: all agree)."""
    wrong = (deviation(outputs, reference) > TOLERANCE).any(dim=0).nonzero()
    return int(wrong[0]) if len(wrong) else None


def first_change(old: torch.Tensor | None, new: torch.Tensor | None) -> int:
    """How many leading positions [B, T, H] of `new` are exactly those of `old` (bit for bit)."""
    if old is None or new is None or old.shape[0] != new.shape[0]:
        return 0
    if old is new:
        return old.shape[1]
    length = min(old.shape[1], new.shape[1])
    changed = (old[:, :length] != new[:, :length]).flatten(2).any(dim=2).any(dim=0).nonzero()
    return int(changed[0]) if len(changed) else length
