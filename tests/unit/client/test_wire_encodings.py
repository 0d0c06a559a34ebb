"""A lossy wire, opt-in, among corolla's own servers in this process (tests/loopback.py): the client and
each hop agree on an encoding, a prompt crosses every hop (client -> server, server -> server by push,
server -> client) in it, as the network's wire log shows, decode steps stay lossless, and the first hop's
outputs are within one encoding step of transformers' blocks over the encoded inputs."""

from __future__ import annotations

import pytest
import torch

from corolla.client.chain.session import InferenceSession
from corolla.models.head import ModelHead
from corolla.wire import tensors
from corolla.wire.messages import RPC_INFERENCE, RPC_PUSH
from loopback import LoopbackNetwork
from tiny_models import LLAMA_LIKE, load_reference

ERROR = {"float16": 1e-3, "blockwise8": 0.03}  # of the scale: a float16 rounding; an 8-bit code step
SPANS = [(0, 2), (2, 4), (4, 6)]
PROMPT = 160  # 160 x 64 floats: 40 KB, over LOSSY_MIN_BYTES


@pytest.fixture(scope="module", params=LLAMA_LIKE)
def family(request, tiny_models):
    """A tiny model of one family: its folder, transformers' model of it, its head."""
    path = tiny_models[request.param]
    return path, load_reference(path), ModelHead.load(path, torch.float32)


@pytest.fixture
async def chain(family):
    network = LoopbackNetwork(family[0])
    servers = [await network.add_server(span) for span in SPANS]
    yield network, [server.peer_id for server in servers]
    await network.close()


def encodings_on_the_wire(network) -> dict[tuple[str, str, str], set[int]]:
    """The compression of the hidden states of every stream message logged, by (rpc, direction, server);
    then the log is cleared. Pushes announcing a step on its way carry no tensors."""
    found: dict[tuple[str, str, str], set[int]] = {}
    for rpc, direction, server, message in network.wire:
        if rpc == RPC_PUSH and not message.tensors:
            continue
        found.setdefault((rpc, direction, server), set()).add(message.tensors[0].compression)
    network.wire.clear()
    return found


def every_crossing(peer_ids: list[str]) -> set[tuple[str, str, str]]:
    """Each hop's inputs from the client and its outputs to the client, and each push to a later hop."""
    sent = {(RPC_INFERENCE, direction, peer) for peer in peer_ids for direction in ("request", "reply")}
    return sent | {(RPC_PUSH, "request", peer) for peer in peer_ids[1:]}


@pytest.mark.parametrize("encoding", ["float16", "blockwise8"])
async def test_prompts_cross_every_hop_in_the_agreed_encoding_and_decode_steps_stay_lossless(
    family, chain, encoding
):
    _, reference, head = family
    network, peer_ids = chain
    client = network.client(wire_encoding=encoding)
    ids = torch.randint(3, 300, (1, PROMPT + 1), generator=torch.Generator().manual_seed(5))
    hidden = head.embed(ids)
    async with InferenceSession(client.swarm, None, 170) as session:
        network.recording = True
        prompt = await session.astep(hidden[:, :PROMPT])
        assert [hop.peer_id for hop in session.route] == peer_ids
        links = session.chain.links
        assert [link.stream.opening.output_encoding for link in links] == [encoding] * 3
        agreed = {tensors.ENCODINGS[encoding]}
        assert encodings_on_the_wire(network) == dict.fromkeys(every_crossing(peer_ids), agreed)
        boundary = links[1].history.inputs  # the first hop's outputs, as the second hop got them
        step = await session.astep(hidden[:, PROMPT:])
        lossless = {tensors.NONE}
        assert encodings_on_the_wire(network) == dict.fromkeys(every_crossing(peer_ids), lossless)
    normed = head.norm(torch.cat([prompt, step], dim=1))

    def wire(x: torch.Tensor) -> torch.Tensor:
        return tensors.deserialize(tensors.encode(x, encoding), "x")

    # the first hop's outputs: its inputs and its outputs each crossed the wire once, in the encoding
    with torch.no_grad():
        first_hop = reference(inputs_embeds=wire(hidden[:, :PROMPT]), output_hidden_states=True)
        expected = wire(first_hop.hidden_states[SPANS[0][1]])
        full = reference(ids, output_hidden_states=True).hidden_states[-1]  # lossless, after the final norm
    scale = float(expected.abs().max())
    assert float((boundary - expected).abs().max()) < ERROR[encoding] * scale
    assert float((normed - full).abs().max()) > 0  # lossy end to end (how much: bench/wan/speculative_wan.py)
