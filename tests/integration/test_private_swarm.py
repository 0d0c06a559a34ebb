"""A private swarm (--allowed-peers): members work as usual; an outsider can neither use a server nor
get its records used, and is told why.

Members (the bootstrap DHT peer, one server, one client) run with their own --identity and the same list;
an outsider server announces the same blocks, and an outsider client tries to route, open an inference
session, run a forward pass and ping.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch
from hivemind.p2p import PeerID
from hivemind.p2p.p2p_daemon_bindings.control import P2PHandlerError
from hivemind.proto import runtime_pb2

from corolla.client.model import DistributedModelForCausalLM
from corolla.errors import MissingBlocks, NotAllowed
from corolla.launch.local import LocalSwarm
from corolla.swarm.p2p.identity import load_identity, peer_id_of_identity, read_allowed_peers
from corolla.swarm.policy.routing import Hop
from corolla.swarm.records.overview import read_overview
from corolla.wire.messages import RPC_INFERENCE, RPC_INFO
from corolla.wire.records import block_uids
from swarm_helpers import reference_generate
from tiny_models import load_reference

PREFIX = "tiny-llama"


@pytest.fixture(scope="module")
def private(tiny_models, tmp_path_factory):
    folder = tmp_path_factory.mktemp("private")
    keys = {name: folder / f"{name}.key" for name in ("dht", "server", "client", "outsider", "stranger")}
    ids = {name: peer_id_of_identity(load_identity(path)) for name, path in keys.items()}
    allowed = folder / "allowed.txt"
    allowed.write_text("".join(f"{ids[name]}  # {name}\n" for name in ("dht", "server", "client")))
    member = ["--allowed-peers", str(allowed)]
    dht_args = [*member, "--identity", str(keys["dht"])]
    with LocalSwarm(str(tiny_models["llama"]), [], dht_args=dht_args) as swarm:
        swarm.add_server((0, 6), [*member, "--identity", str(keys["server"])])
        swarm.add_server((0, 6), ["--identity", str(keys["outsider"])])  # not on the list
        yield swarm, keys, ids, allowed


def config(swarm: LocalSwarm, key, allowed=None, **overrides):
    base = swarm.client_config(routing_timeout=5.0, **overrides)
    swarm_config = dataclasses.replace(base.swarm, identity_path=str(key), allowed_peers=allowed)
    return dataclasses.replace(base, swarm=swarm_config)


def test_members_use_the_swarm_and_ignore_outsiders_records(private, tiny_models):
    swarm, keys, ids, allowed = private
    members = read_allowed_peers(allowed)
    assert ids["server"] in members and len(members) == 3
    reference = load_reference(tiny_models["llama"])
    prompt = torch.tensor([[1, 5, 9, 22, 7]])
    with DistributedModelForCausalLM.from_pretrained(
        str(tiny_models["llama"]), config=config(swarm, keys["client"], members)
    ) as model:
        spans = model.runtime.run(model.client.swarm.view.refresh())
        assert [span.peer_id for span in spans] == [ids["server"]]  # the outsider's records never count
        tokens = model.generate(prompt, max_new_tokens=6, ignore_eos=True)
        assert torch.equal(tokens, reference_generate(reference, prompt, max_new_tokens=6))
        overview = model.runtime.run(read_overview(model.client.dht, PREFIX, 6))
        assert [server.peer_id for server in overview.servers] == [ids["server"]]


def test_an_outsider_cannot_use_a_member_server(private, tiny_models):
    swarm, keys, ids, _ = private
    member_server = ids["server"]
    with DistributedModelForCausalLM.from_pretrained(
        str(tiny_models["llama"]),
        config=config(swarm, keys["stranger"], allowed_servers=(member_server,)),
    ) as model:
        with pytest.raises(
            MissingBlocks, match="refused this peer: peer .* is not allowed in this private swarm"
        ):
            model.generate(torch.tensor([[1, 5, 9]]), max_new_tokens=2)
        p2p = model.client.p2p
        hidden = torch.randn(1, 3, 64)
        with pytest.raises(NotAllowed, match="not allowed in this private swarm"):
            model.runtime.run(model.client.swarm.peers.forward(Hop(member_server, 0, 6), hidden))

        async def open_session() -> None:
            async def requests():
                yield runtime_pb2.ExpertRequest(uid=block_uids(PREFIX, 0, 6))

            replies = await p2p.iterate_protobuf_handler(
                PeerID.from_base58(member_server), RPC_INFERENCE, requests(), runtime_pb2.ExpertResponse
            )
            await asyncio.wait_for(anext(replies), 20)

        with pytest.raises(P2PHandlerError, match="NotAllowed"):
            model.runtime.run(open_session())
        with pytest.raises(P2PHandlerError, match="NotAllowed"):
            model.runtime.run(
                p2p.call_protobuf_handler(
                    PeerID.from_base58(member_server),
                    RPC_INFO,
                    runtime_pb2.ExpertUID(uid=""),
                    runtime_pb2.ExpertInfo,
                )
            )
