"""Speculative decoding through the swarm: a draft verified in one step, the model's own tokens kept.

Each round sends the last chosen token (the root) and a draft (decoding/drafting.py: a chain or a tree)
through the chain of servers as ONE step; every server runs the whole tree in one engine pass with the
tree's attention mask, batched with other sessions' steps. Back on the client, the head gives logits at
every token of the tree, and verification (decoding/verify.py) walks it, choosing each token exactly as
plain decoding does: greedy output is identical, and sampled output with a seed is the same as without
speculation. The session then keeps the walked path's keys and values on every server
(`InferenceSession.accept`) and drops the rest of the tree.
"""

from __future__ import annotations

import time

import torch

from corolla.client.chain.session import InferenceSession
from corolla.client.generation.head_batcher import HeadBatcher
from corolla.decoding.chooser import Chooser, GenerationStep
from corolla.decoding.speculator import Speculation
from corolla.decoding.verify import verify
from corolla.models.tree import TokenTree


async def speculative_round(
    head: HeadBatcher, session: InferenceSession, chooser: Chooser, speculation: Speculation
) -> list[GenerationStep]:
    """One step through the swarm after the last chosen token (not yet fed): its tokens, one or more."""
    started = time.perf_counter()
    room = min(session.max_length - session.position, session.max_tree_tokens) - 1
    left = chooser.params.max_new_tokens - chooser.num_chosen - 1
    draft = await speculation.draft(chooser.context[0].tolist(), left, room)
    nodes = [int(chooser.context[0, -1]), *draft.tokens]
    tree = draft.tree() if draft.tokens else None
    outputs = await session.astep(head.head.embed(torch.tensor([nodes])), tree=tree)
    logits = await head.logits(outputs[0])  # [tokens, vocab]
    root = chooser.context.shape[1] - 1
    verified = verify(chooser, logits, nodes, None if tree is None else TokenTree(tree))
    speculation.observe(root, outputs[0][verified.path], chooser.context[0])
    if tree is not None:
        session.accept(verified.path)
    speculation.record(draft, verified.accepted, len(verified.steps), time.perf_counter() - started)
    return verified.steps
