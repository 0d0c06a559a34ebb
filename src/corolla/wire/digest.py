"""What identifies a step's inputs: the digest a server records for each step it runs and names in the
step's reply, and that the client checks against what it sent.

With push (server/inference/push.py), a step can reach a server twice: pushed by the previous server and sent
by the client. The digest tells a second copy of a step (it runs nothing more) from other inputs under the
same step id (server/inference/ledger.py), and a reply names the digest and position of what it ran, so that a
client never takes outputs computed from inputs it did not send, such as a copy the previous server forged and
pushed ahead of the client's own (client/rpc/span_stream.py).

It covers everything in a step that changes its outputs: each tensor's bytes, dtype, shape and encoding
(hidden states, and deep prompts and beam order when sent), the token tree the step forms and the path
of the previous tree it keeps; the position travels beside it. SHA-256, which CPUs with SHA extensions run
at about twice blake2b's speed: a decode step of SmolLM2 (hidden size 576, float32) costs about 4 µs for
one row and 25 µs for 16 (blake2b: 7 and 58 µs; bench/decode/digest.py), once per hop on the client and once
on each server, next to a step time of tens of milliseconds.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from hivemind.proto import runtime_pb2


def step_digest(
    tensors: Sequence[runtime_pb2.Tensor],
    tree: Sequence[int] | None = None,
    accepted: Sequence[int] | None = None,
) -> bytes:
    """32 bytes identifying a step's inputs: `tensors` as sent, its token tree and the kept path."""
    hasher = hashlib.sha256()
    if tree is not None or accepted is not None:
        kept = None if accepted is None else list(accepted)
        hasher.update(f"tree={None if tree is None else list(tree)}|accepted={kept}|".encode())
    for tensor in tensors:
        size = list(tensor.size)
        hasher.update(f"{tensor.dtype}|{size}|{tensor.compression}|{len(tensor.buffer)}|".encode())
        hasher.update(tensor.buffer)
    return hasher.digest()
