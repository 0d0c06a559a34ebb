"""Autograd through the swarm: a chain of servers as one differentiable function.

Forward sends the hidden states down a chain of servers (`rpc_forward`), keeping each hop's inputs.
Backward walks the chain in reverse with `rpc_backward`: each server returns the gradient wrt its inputs
(and its blocks' deep prompts) given the gradient of its outputs, recomputing its forward with its
weights frozen. Big batches are split into requests of at most `max_request_tokens` tokens.

A server that fails is banned and its blocks re-routed, in forward and in backward alike. In backward,
the replacement chain gets the failed hop's kept inputs: its forward is recomputed hop by hop to obtain
the inputs of each replacement hop, then their backward runs. The user never sees the failure, and the
gradients are the same (the replacement has the same weights).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from corolla.client.remote_passes import remote_backward, remote_forward
from corolla.client.runtime import LoopThread
from corolla.client.spot_checks import Run
from corolla.client.swarm import RETRYABLE, SwarmClient
from corolla.errors import ServerUnavailable, counted
from corolla.swarm.routing import Hop


class FaultyServer(ServerUnavailable):
    """A spot check caught a hop's server computing wrong gradients (it is banned for good)."""


@dataclass
class _Retries:
    swarm: SwarmClient
    failures: int = 0

    def __post_init__(self) -> None:
        self.deadline = time.monotonic() + self.swarm.config.failover_timeout

    async def replace(self, hop: Hop, error: Exception) -> list[Hop]:
        """Ban `hop`'s server and route its blocks again, or give up."""
        self.failures += 1
        if self.failures > self.swarm.config.max_retries or time.monotonic() > self.deadline:
            raise ServerUnavailable(
                f"giving up after {counted(self.failures, 'failed server')}; last: {error}"
            ) from error
        self.swarm.ban(hop.peer_id)
        return await self.swarm.route(hop.start, hop.end)


def _prompts_for(prompts: torch.Tensor | None, hop: Hop) -> torch.Tensor | None:
    return None if prompts is None else prompts[hop.start : hop.end]


async def chain_forward(
    swarm: SwarmClient, hidden: torch.Tensor, prompts: torch.Tensor | None
) -> tuple[torch.Tensor, list[tuple[Hop, torch.Tensor]]]:
    """Outputs of every block for hidden [B, T, H]; also each hop with the inputs it got."""
    return await _through(swarm, _Retries(swarm), await swarm.route(), hidden, prompts)


async def _through(
    swarm: SwarmClient,
    retries: _Retries,
    hops: list[Hop],
    hidden: torch.Tensor,
    prompts: torch.Tensor | None,
    last_outputs: bool = True,
) -> tuple[torch.Tensor | None, list[tuple[Hop, torch.Tensor]]]:
    """Run `hops` in order (replacing any that fail); returns the outputs (None without last_outputs:
    the last hop is then not run) and each hop with its inputs."""
    trace, index = [], 0
    while index < len(hops):
        hop = hops[index]
        if not last_outputs and index == len(hops) - 1:
            trace.append((hop, hidden))
            return None, trace
        try:
            outputs = await _forward_rows(swarm, hop, hidden, prompts)
        except RETRYABLE as e:
            hops[index : index + 1] = await retries.replace(hop, e)
            continue
        if not await _checked(swarm, hop, outputs, _forward_on(swarm, hidden, prompts)):
            hops[index : index + 1] = await swarm.route(hop.start, hop.end)  # without the faulty server
            continue
        trace.append((hop, hidden))
        hidden, index = outputs, index + 1
    return hidden, trace


async def chain_backward(
    swarm: SwarmClient,
    trace: list[tuple[Hop, torch.Tensor]],
    grad_outputs: torch.Tensor,
    prompts: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gradients wrt the chain's inputs and (when given) the deep prompts [blocks, B or 1, P, H]."""
    retries, pending, grad = _Retries(swarm), list(trace), grad_outputs
    grad_prompts = torch.zeros_like(prompts) if prompts is not None else None
    while pending:
        hop, inputs = pending.pop()
        try:
            grad_inputs, hop_grad_prompts = await _backward_rows(swarm, hop, inputs, grad, prompts)
            checked = _backward_on(swarm, inputs, grad, prompts)
            if not await _checked(
                swarm, hop, _joined(grad_inputs, hop_grad_prompts), checked, gradients=True
            ):
                raise FaultyServer(f"server ...{hop.peer_id[-6:]} computed wrong gradients")
        except RETRYABLE as e:
            # the replacement chain's inputs, recomputed from the failed hop's; then its backward runs
            replacement = await retries.replace(hop, e)
            pending.extend(
                (await _through(swarm, retries, replacement, inputs, prompts, last_outputs=False))[1]
            )
            continue
        grad = grad_inputs
        if grad_prompts is not None and hop_grad_prompts is not None:
            grad_prompts[hop.start : hop.end] += hop_grad_prompts
    return grad, grad_prompts


async def _checked(
    swarm: SwarmClient, hop: Hop, result: torch.Tensor, run: Run, gradients: bool = False
) -> bool:
    """Whether a hop's pass stands: True unless this pass was drawn for a spot check and failed it."""
    checker = swarm.spot_checker
    return checker is None or not checker.draw() or await checker.check_pass(hop, result, run, gradients)


def _forward_on(swarm: SwarmClient, hidden: torch.Tensor, prompts: torch.Tensor | None) -> Run:
    """The forward pass of `hidden` through a chain of other servers (a spot check's)."""

    async def run(chain: list[Hop]) -> torch.Tensor:
        outputs = hidden
        for hop in chain:
            outputs = await _forward_rows(swarm, hop, outputs, prompts)
        return outputs

    return run


def _backward_on(
    swarm: SwarmClient, inputs: torch.Tensor, grad: torch.Tensor, prompts: torch.Tensor | None
) -> Run:
    """The backward pass of the same blocks through a chain of other servers (a spot check's): the
    chain's forward gives each of its hops' inputs, then its backward runs; the gradients joined."""

    async def run(chain: list[Hop]) -> torch.Tensor:
        trace, hidden = [], inputs
        for hop in chain[:-1]:
            trace.append((hop, hidden))
            hidden = await _forward_rows(swarm, hop, hidden, prompts)
        trace.append((chain[-1], hidden))
        grads, grad_inputs = [], grad
        for hop, hop_inputs in reversed(trace):
            grad_inputs, hop_grad_prompts = await _backward_rows(swarm, hop, hop_inputs, grad_inputs, prompts)
            grads.insert(0, hop_grad_prompts)
        prompt_grads = None if grads[0] is None else torch.cat(grads)
        return _joined(grad_inputs, prompt_grads)

    return run


def _joined(grad_inputs: torch.Tensor, grad_prompts: torch.Tensor | None) -> torch.Tensor:
    """A backward's gradients as one vector, as spot checks compare them."""
    parts = [grad_inputs] if grad_prompts is None else [grad_inputs, grad_prompts]
    return torch.cat([part.flatten().float() for part in parts])


def _row_groups(hidden: torch.Tensor, max_tokens: int) -> list[slice]:
    rows = max(1, max_tokens // hidden.shape[1])
    return [slice(i, i + rows) for i in range(0, hidden.shape[0], rows)]


def _rows(prompts: torch.Tensor | None, rows: slice) -> torch.Tensor | None:
    return prompts if prompts is None or prompts.shape[1] == 1 else prompts[:, rows]


async def _forward_rows(
    swarm: SwarmClient, hop: Hop, hidden: torch.Tensor, prompts: torch.Tensor | None
) -> torch.Tensor:
    config, hop_prompts = swarm.config, _prompts_for(prompts, hop)
    outputs = [
        await remote_forward(
            swarm.p2p,
            hop,
            swarm.dht_prefix,
            hidden[rows],
            config.request_timeout,
            _rows(hop_prompts, rows),
            config.active_adapter,
        )
        for rows in _row_groups(hidden, config.max_request_tokens)
    ]
    return torch.cat(outputs)


async def _backward_rows(
    swarm: SwarmClient, hop: Hop, inputs: torch.Tensor, grad: torch.Tensor, prompts: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    config, hop_prompts = swarm.config, _prompts_for(prompts, hop)
    grads, grad_prompts = [], None
    for rows in _row_groups(inputs, config.max_request_tokens):
        grad_inputs, part = await remote_backward(
            swarm.p2p,
            hop,
            swarm.dht_prefix,
            inputs[rows],
            grad[rows],
            config.request_timeout,
            _rows(hop_prompts, rows),
            config.active_adapter,
        )
        grads.append(grad_inputs)
        if part is not None:
            if hop_prompts.shape[1] == 1:
                grad_prompts = part if grad_prompts is None else grad_prompts + part
            else:
                grad_prompts = part if grad_prompts is None else torch.cat([grad_prompts, part], dim=1)
    return torch.cat(grads), grad_prompts


class RemoteChain(torch.autograd.Function):
    """hidden [B, T, H] and deep prompts ([blocks, B or 1, P, H], or an empty tensor) -> the last block's
    outputs [B, T, H], differentiable wrt both."""

    @staticmethod
    def forward(ctx, hidden, prompts, swarm: SwarmClient, runtime: LoopThread):  # noqa: ANN001
        deep = prompts if prompts.numel() else None
        outputs, trace = runtime.run(
            chain_forward(swarm, hidden.detach(), None if deep is None else deep.detach())
        )
        ctx.swarm, ctx.runtime, ctx.trace, ctx.has_prompts = swarm, runtime, trace, deep is not None
        ctx.save_for_backward(prompts)
        return outputs

    @staticmethod
    def backward(ctx, grad_outputs):  # noqa: ANN001
        (prompts,) = ctx.saved_tensors
        deep = prompts.detach() if ctx.has_prompts else None
        grad_hidden, grad_prompts = ctx.runtime.run(
            chain_backward(ctx.swarm, ctx.trace, grad_outputs.contiguous(), deep)
        )
        if grad_prompts is None:
            grad_prompts = torch.zeros_like(prompts)
        return grad_hidden, grad_prompts, None, None
