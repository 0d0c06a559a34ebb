"""Training through the swarm: a chain of servers as one differentiable function.

Forward sends the hidden states down a chain of servers (`rpc_forward`), keeping each hop's inputs.
Backward walks the chain in reverse with `rpc_backward`: each server returns the gradient wrt its inputs
(and its blocks' deep prompts) given the gradient of its outputs, recomputing its forward with its
weights frozen.

A server that fails is banned and its blocks re-routed, in forward and in backward alike, within one
retry budget per pass. In backward, the replacement chain gets the failed hop's kept inputs: its forward
is recomputed hop by hop to obtain the inputs of each replacement hop, then their backward runs. The
user never sees the failure, and the gradients are the same (the replacement has the same weights).
With spot checks, a share of the hops' passes is run again elsewhere (client/checks/spot_checks.py); a faulty
server's pass is redone on a new route.
"""

from __future__ import annotations

import torch

from corolla.client.chain.hop_passes import backward_hop, forward_along, forward_hop
from corolla.client.chain.retries import RetryBudget
from corolla.client.checks.disputes import Run
from corolla.client.checks.spot_checks import SpotChecker
from corolla.client.routing.swarm_access import SwarmAccess
from corolla.client.runtime import LoopThread
from corolla.errors import RETRYABLE, ServerUnavailable
from corolla.swarm.policy.routing import Hop

Trace = list[tuple[Hop, torch.Tensor]]  # each hop of a forward pass, with the inputs it got


class FaultyServer(ServerUnavailable):
    """A spot check caught a hop's server computing wrong gradients (it is banned for good)."""


class ChainPasses:
    """Forward and backward passes through the whole model's blocks on the swarm."""

    def __init__(self, swarm: SwarmAccess, checker: SpotChecker | None = None):
        self.swarm = swarm
        self.checker = checker

    async def forward(self, hidden: torch.Tensor, prompts: torch.Tensor | None) -> tuple[torch.Tensor, Trace]:
        """Outputs of every block for hidden [B, T, H]; also each hop with the inputs it got."""
        hops = await self.swarm.router.route()
        return await self._through(RetryBudget(self.swarm.config), hops, hidden, prompts)

    async def backward(
        self, trace: Trace, grad_outputs: torch.Tensor, prompts: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Gradients wrt the chain's inputs and (when given) the deep prompts [blocks, B or 1, P, H]."""
        budget = RetryBudget(self.swarm.config)
        pending = list(trace)
        grad = grad_outputs
        grad_prompts = torch.zeros_like(prompts) if prompts is not None else None
        while pending:
            hop, inputs = pending.pop()
            try:
                grad_inputs, hop_grad_prompts = await self._checked_backward(hop, inputs, grad, prompts)
            except RETRYABLE as e:
                # the replacement chain's inputs, recomputed from the failed hop's; then its backward runs
                replacement = await self._replace(hop, e, budget)
                pending.extend(
                    (await self._through(budget, replacement, inputs, prompts, last_outputs=False))[1]
                )
                continue
            grad = grad_inputs
            if grad_prompts is not None and hop_grad_prompts is not None:
                grad_prompts[hop.start : hop.end] += hop_grad_prompts
        return grad, grad_prompts

    async def _through(
        self,
        budget: RetryBudget,
        hops: list[Hop],
        hidden: torch.Tensor,
        prompts: torch.Tensor | None,
        last_outputs: bool = True,
    ) -> tuple[torch.Tensor | None, Trace]:
        """Run `hops` in order (replacing any that fail); returns the outputs (None without last_outputs:
        the last hop is then not run) and each hop with its inputs."""
        trace = []
        index = 0
        while index < len(hops):
            hop = hops[index]
            if not last_outputs and index == len(hops) - 1:
                trace.append((hop, hidden))
                return None, trace
            try:
                outputs = await forward_hop(self.swarm, hop, hidden, prompts)
            except RETRYABLE as e:
                hops[index : index + 1] = await self._replace(hop, e, budget)
                continue
            if not await self._stands(hop, outputs, self._forward_on(hidden, prompts)):
                hops[index : index + 1] = await self.swarm.router.route(
                    hop.start, hop.end
                )  # without the faulty
                continue
            trace.append((hop, hidden))
            hidden = outputs
            index = index + 1
        return hidden, trace

    async def _checked_backward(
        self, hop: Hop, inputs: torch.Tensor, grad: torch.Tensor, prompts: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        grad_inputs, grad_prompts = await backward_hop(self.swarm, hop, inputs, grad, prompts)
        run = self._backward_on(inputs, grad, prompts)
        if not await self._stands(hop, _joined(grad_inputs, grad_prompts), run, gradients=True):
            raise FaultyServer(f"server ...{hop.peer_id[-6:]} computed wrong gradients")
        return grad_inputs, grad_prompts

    async def _replace(self, hop: Hop, error: Exception, budget: RetryBudget) -> list[Hop]:
        """Ban `hop`'s server and route its blocks again, or give up."""
        budget.spend(error)
        self.swarm.bans.failed(hop.peer_id, error)
        return await self.swarm.router.route(hop.start, hop.end)

    async def _stands(self, hop: Hop, result: torch.Tensor, run: Run, gradients: bool = False) -> bool:
        """Whether a hop's pass stands: True unless this pass was drawn for a spot check and failed it."""
        checker = self.checker
        return checker is None or not checker.draw() or await checker.check_pass(hop, result, run, gradients)

    def _forward_on(self, hidden: torch.Tensor, prompts: torch.Tensor | None) -> Run:
        """The forward pass of `hidden` through a chain of other servers (a spot check's)."""

        async def run(chain: list[Hop]) -> torch.Tensor:
            return await forward_along(self.swarm, chain, hidden, prompts)

        return run

    def _backward_on(self, inputs: torch.Tensor, grad: torch.Tensor, prompts: torch.Tensor | None) -> Run:
        """The backward pass of the same blocks through a chain of other servers (a spot check's): the
        chain's forward gives each of its hops' inputs, then its backward runs; the gradients joined."""

        async def run(chain: list[Hop]) -> torch.Tensor:
            trace = []
            hidden = inputs
            for hop in chain[:-1]:
                trace.append((hop, hidden))
                hidden = await forward_hop(self.swarm, hop, hidden, prompts)
            trace.append((chain[-1], hidden))
            grads = []
            grad_inputs = grad
            for hop, hop_inputs in reversed(trace):
                grad_inputs, hop_grad_prompts = await backward_hop(
                    self.swarm, hop, hop_inputs, grad_inputs, prompts
                )
                grads.insert(0, hop_grad_prompts)
            prompt_grads = None if grads[0] is None else torch.cat(grads)
            return _joined(grad_inputs, prompt_grads)

        return run


def _joined(grad_inputs: torch.Tensor, grad_prompts: torch.Tensor | None) -> torch.Tensor:
    """A backward's gradients as one vector, as spot checks compare them."""
    parts = [grad_inputs] if grad_prompts is None else [grad_inputs, grad_prompts]
    return torch.cat([part.flatten().float() for part in parts])


class RemoteChain(torch.autograd.Function):
    """hidden [B, T, H] and deep prompts ([blocks, B or 1, P, H], or an empty tensor) -> the last block's
    outputs [B, T, H], differentiable wrt both."""

    @staticmethod
    def forward(ctx, hidden, prompts, passes: ChainPasses, runtime: LoopThread):
        deep = prompts if prompts.numel() else None
        outputs, trace = runtime.run(passes.forward(hidden.detach(), None if deep is None else deep.detach()))
        ctx.passes = passes
        ctx.runtime = runtime
        ctx.trace = trace
        ctx.has_prompts = deep is not None
        ctx.save_for_backward(prompts)
        return outputs

    @staticmethod
    def backward(ctx, grad_outputs):
        (prompts,) = ctx.saved_tensors
        deep = prompts.detach() if ctx.has_prompts else None
        grad_hidden, grad_prompts = ctx.runtime.run(
            ctx.passes.backward(ctx.trace, grad_outputs.contiguous(), deep)
        )
        if grad_prompts is None:
            grad_prompts = torch.zeros_like(prompts)
        return grad_hidden, grad_prompts, None, None
