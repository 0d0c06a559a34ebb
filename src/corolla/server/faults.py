"""A testing aid: a server that computes wrong outputs on purpose (`--simulate-faulty MODE`).

Clients spot-check servers (client/checks/spot_checks.py); these modes make the faults they must catch
reproducible, through the span's own modules (forward hooks and weights), so every path (inference
steps, pushes, forward and backward passes) carries the fault:

- `noise[:SCALE]`: every block output of the span gets Gaussian noise of SCALE x its RMS (default 0.1);
- `skip-layer`: the span's last block returns its input (a server that skips work);
- `wrong-weights`: the first block's MLP output projection is permuted (a server with other weights);
- `garbage-after:N`: after N passes of the span, its outputs are random numbers of the same RMS.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from corolla.errors import InvalidRequest

logger = logging.getLogger(__name__)

FAULT_MODES = ("noise", "skip-layer", "wrong-weights", "garbage-after")
DEFAULT_NOISE = 0.1


@dataclass(frozen=True)
class Fault:
    mode: str
    amount: float = 0.0  # noise: the relative scale; garbage-after: the passes served honestly

    @classmethod
    def parse(cls, text: str) -> Fault:
        mode, _, value = text.partition(":")
        if mode not in FAULT_MODES:
            raise InvalidRequest(f"--simulate-faulty {text!r}: MODE must be one of {', '.join(FAULT_MODES)}")
        if mode in ("skip-layer", "wrong-weights"):
            if value:
                raise InvalidRequest(f"--simulate-faulty {mode} takes no value, got {value!r}")
            return cls(mode)
        try:
            amount = float(value) if value else (DEFAULT_NOISE if mode == "noise" else -1.0)
        except ValueError:
            amount = -1.0
        if amount < 0 or (mode == "garbage-after" and not amount.is_integer()):
            what = "a scale >= 0" if mode == "noise" else "a number of passes N >= 0"
            raise InvalidRequest(f"--simulate-faulty {text!r}: {mode} takes {what} (e.g. {mode}:8)")
        return cls(mode, amount)

    def apply(self, blocks: nn.ModuleList) -> None:
        """Make the span's blocks faulty (their weights, or hooks on their outputs)."""
        logger.warning("Simulating a faulty server: %s", self)
        if self.mode == "noise":
            for block in blocks:
                block.register_forward_hook(self._noise)
        elif self.mode == "skip-layer":
            blocks[-1].register_forward_hook(lambda module, args, output: args[0])
        elif self.mode == "wrong-weights":
            linear = _mlp_output(blocks[0])
            with torch.no_grad():
                generator = torch.Generator().manual_seed(0)
                linear.weight.copy_(
                    linear.weight[:, torch.randperm(linear.weight.shape[1], generator=generator)]
                )
        else:
            passes = [0]
            blocks[-1].register_forward_hook(lambda module, args, output: self._garbage(output, passes))

    def _noise(self, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        return output + torch.randn_like(output) * _rms(output) * self.amount

    def _garbage(self, output: torch.Tensor, passes: list[int]) -> torch.Tensor:
        passes[0] += 1
        return output if passes[0] <= self.amount else torch.randn_like(output) * _rms(output)

    def __str__(self) -> str:
        if self.mode == "noise":
            return f"noise of {self.amount:g} x the RMS of every block's outputs"
        if self.mode == "garbage-after":
            return f"random outputs after {int(self.amount)} passes"
        return self.mode


def _rms(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.float().pow(2).mean(dim=-1, keepdim=True).sqrt().to(tensor.dtype)


def _mlp_output(block: nn.Module) -> nn.Linear:
    """The last linear layer of a block's MLP (down_proj, fc2, ...): the weights a wrong model differs in."""
    mlp = getattr(block, "mlp", None) or getattr(block, "feed_forward", None) or block
    linears = [m for m in mlp.modules() if isinstance(m, nn.Linear)]
    if not linears:
        raise InvalidRequest("--simulate-faulty wrong-weights: this model's blocks have no linear layers")
    return linears[-1]
