"""A lossy wire, opt-in: the client and each hop agree on an encoding, prompts cross every hop (client ->
server, server -> server by push, server -> client) in it, and decode steps stay exact."""

from __future__ import annotations

import pytest
import torch

from corolla.models.span import Span
from corolla.wire import tensors
from swarm_helpers import TINY_CHAINS, connect

ERROR = {"float16": 1e-3, "blockwise8": 0.03}  # of the scale: a float16 rounding; an 8-bit code step


@pytest.mark.parametrize("encoding", ["float16", "blockwise8"])
def test_prompts_cross_every_hop_in_the_agreed_encoding_and_decode_steps_stay_lossless(
    family_swarm, encoding
):
    path, swarm, reference = family_swarm
    ids = torch.randint(
        3, 300, (1, 161), generator=torch.Generator().manual_seed(5)
    )  # 160 x 64 floats: 40 KB
    with connect(path, swarm, TINY_CHAINS[3], wire_encoding=encoding) as model:
        with model.inference_session(max_length=170) as session:
            hidden = model.head.embed(ids)
            prompt = session.step(hidden[:, :160])
            assert [span.output_encoding for span in session.spans] == [encoding] * 3
            assert all(span.reply.compression == tensors.ENCODINGS[encoding] for span in session.spans)
            first_hop = session.route[0]
            boundary = session.boundary_outputs[0]
            step = session.step(hidden[:, 160:])
            assert all(span.reply.compression == tensors.NONE for span in session.spans)
        normed = model.head.norm(torch.cat([prompt, step], dim=1))

    def wire(x: torch.Tensor) -> torch.Tensor:
        return tensors.deserialize(tensors.encode(x, encoding), "x")

    # the first hop's outputs: its inputs and its outputs each crossed the wire once, in the encoding
    span = Span.load(path, first_hop.start, first_hop.end)
    with torch.no_grad():
        expected = wire(span(wire(hidden[:, :160])))
        full = reference(ids, output_hidden_states=True).hidden_states[-1]  # lossless, after the final norm
    scale = float(expected.abs().max())
    assert float((boundary - expected).abs().max()) < ERROR[encoding] * scale
    assert float((normed - full).abs().max()) > 0  # lossy end to end (how much: bench/speculative_wan.py)
