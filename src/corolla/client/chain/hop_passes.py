"""Cache-free passes through servers: a hop's forward or backward in row groups, and forward along hops.

Big batches are split into requests of at most `max_request_tokens` tokens (rows x length). Deep prompts
travel as [blocks, B or 1, P, H]: the same for every row when their second dimension is 1.
"""

from __future__ import annotations

import torch

from corolla.client.routing.swarm_access import SwarmAccess
from corolla.swarm.policy.routing import Hop


async def forward_hop(
    swarm: SwarmAccess, hop: Hop, hidden: torch.Tensor, prompts: torch.Tensor | None
) -> torch.Tensor:
    """hop's blocks over hidden states [B, T, H] (prompts: every block's, [blocks, B or 1, P, H])."""
    hop_prompts = _blocks(prompts, hop)
    outputs = [
        await swarm.peers.forward(hop, hidden[rows], _rows(hop_prompts, rows))
        for rows in _row_groups(hidden, swarm.config.max_request_tokens)
    ]
    return torch.cat(outputs)


async def forward_along(
    swarm: SwarmAccess, hops: list[Hop], hidden: torch.Tensor, prompts: torch.Tensor | None = None
) -> torch.Tensor:
    """hidden [B, T, H] through `hops` in order (no failover: a failure is raised)."""
    for hop in hops:
        hidden = await forward_hop(swarm, hop, hidden, prompts)
    return hidden


async def backward_hop(
    swarm: SwarmAccess, hop: Hop, inputs: torch.Tensor, grad: torch.Tensor, prompts: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gradients wrt hop's inputs [B, T, H] and wrt its blocks' deep prompts (None without prompts), given
    the gradient of its outputs."""
    hop_prompts = _blocks(prompts, hop)
    grads = []
    grad_prompts = None
    for rows in _row_groups(inputs, swarm.config.max_request_tokens):
        grad_inputs, part = await swarm.peers.backward(
            hop, inputs[rows], grad[rows], _rows(hop_prompts, rows)
        )
        grads.append(grad_inputs)
        if part is None:
            continue
        if hop_prompts.shape[1] == 1:  # shared by every row: the rows' gradients add up
            grad_prompts = part if grad_prompts is None else grad_prompts + part
        else:
            grad_prompts = part if grad_prompts is None else torch.cat([grad_prompts, part], dim=1)
    return torch.cat(grads), grad_prompts


def _blocks(prompts: torch.Tensor | None, hop: Hop) -> torch.Tensor | None:
    return None if prompts is None else prompts[hop.start : hop.end]


def _row_groups(hidden: torch.Tensor, max_tokens: int) -> list[slice]:
    rows = max(1, max_tokens // hidden.shape[1])
    return [slice(i, i + rows) for i in range(0, hidden.shape[0], rows)]


def _rows(prompts: torch.Tensor | None, rows: slice) -> torch.Tensor | None:
    return prompts if prompts is None or prompts.shape[1] == 1 else prompts[:, rows]
