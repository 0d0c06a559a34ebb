"""Forging peers against a real swarm's DHT: records no one can forge, servers that must answer.

Two raw hivemind DHT nodes join a 2-server swarm: one stores whatever it likes (no validators), the other
signs records with its own key. They try to overwrite a real server's record (announcing it OFFLINE with
other blocks), to announce in its name (unsigned, and signed with the forger's key), and to inject a fake
server with an attractive record of its own. The honest client keeps routing through the real servers
only, generates exactly the reference model's tokens, and counts what it refused.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import pytest
import torch
from hivemind import DHT
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils import get_dht_time

from corolla.launch.local import LocalSwarm
from corolla.swarm.dht import MODELS_KEY, read_records
from corolla.swarm.p2p.identity import load_identity, owned_subkey, peer_id_of_identity
from corolla.swarm.records.overview import format_table
from corolla.wire.records import ServerState, ServerStatus, block_key
from swarm_helpers import connect, reference_generate, run_corolla
from tiny_models import load_reference

PREFIX = "tiny-llama"


@pytest.fixture(scope="module")
def pair(tiny_models):
    with LocalSwarm(str(tiny_models["llama"]), [(0, 3), (3, 6)]) as swarm:
        yield swarm


def raw_node(swarm: LocalSwarm, **kwargs) -> DHT:
    return DHT(
        initial_peers=swarm.initial_peers,
        start=True,
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        nat_port_map=False,
        **kwargs,
    )


def signing_node(swarm: LocalSwarm, key_path) -> tuple[DHT, object, str]:
    """A peer with its own key that signs what it stores: (its DHT node, its key, its peer id)."""
    key = load_identity(key_path)
    node = raw_node(swarm, identity_path=str(key_path), record_validators=[RSASignatureValidator(key)])
    return node, key, peer_id_of_identity(key)


def forge(dht: DHT, subkey: str, record: ServerStatus, blocks: range) -> None:
    expiration = get_dht_time() + 600  # outlives the server's own records
    for index in blocks:
        dht.store(block_key(PREFIX, index), record.to_dict(), expiration, subkey=subkey)


def test_forged_records_never_reach_routing(pair, tiny_models, tmp_path):
    victim = pair.servers[0]
    reference = load_reference(tiny_models["llama"])
    prompt = torch.tensor([[1, 5, 9, 22, 7]])
    expected = reference_generate(reference, prompt, max_new_tokens=8)
    with connect(tiny_models["llama"], pair) as model:

        async def read_block_0() -> dict:  # on the client's loop: hivemind's futures need one
            return await model.client.dht.run_coroutine(
                partial(read_records, keys=[block_key(PREFIX, 0)]), return_future=True
            )

        found = model.runtime.run(read_block_0())
        [(victim_subkey, raw)] = [
            (k, v) for k, v in found[block_key(PREFIX, 0)].items() if k.startswith(victim.peer_id)
        ]
        honest = ServerStatus.from_dict(raw)
        lure = dataclasses.replace(honest, start=0, end=6, throughput=1e6, cache_tokens_available=10**9)

        blunt = raw_node(pair)  # stores anything: no validators at all
        signer, forger_key, forger_id = signing_node(pair, tmp_path / "forger.key")
        try:
            offline = dataclasses.replace(honest, state=ServerState.OFFLINE, start=0, end=6)
            forge(blunt, victim_subkey, offline, range(6))  # overwrite (and take down) the victim's record
            forge(blunt, victim.peer_id, lure, range(6))  # unsigned, in the victim's name
            forge(signer, owned_subkey(victim.peer_id, forger_key), lure, range(6))  # signed, victim's name
            forge(signer, owned_subkey(forger_id, forger_key), lure, range(6))  # a fake server of its own

            spans = model.runtime.run(model.client.swarm.view.refresh())
            by_peer = {span.peer_id: span for span in spans}
            assert by_peer[victim.peer_id].info.state == ServerState.ONLINE
            assert (by_peer[victim.peer_id].start, by_peer[victim.peer_id].end) == (0, 3)
            assert forger_id in by_peer  # its own signed record is read ...
            assert forger_id not in model.client.swarm.view.answered  # ... but it never answered rpc_info
            for _ in range(5):
                hops = model.runtime.run(model.client.swarm.router.route())
                assert [hop.peer_id for hop in hops] == [victim.peer_id, pair.servers[1].peer_id]
            tokens = model.generate(prompt, max_new_tokens=8, ignore_eos=True)
            assert torch.equal(tokens, expected)

            # what status and the dashboard (/v1/swarm: the client's overview) show: the servers that
            # answer, not the forger's record
            overview = model.runtime.run(model.client.overview())
            assert sorted(s.peer_id for s in overview.servers) == sorted(s.peer_id for s in pair.servers)
            assert [s.peer_id for s in overview.silent] == [forger_id]
            assert overview.coverage == (1,) * 6
            shown = overview.to_dict()  # the dashboard's JSON
            assert forger_id not in {row["peer_id"] for row in shown["servers"]}
            assert shown["not_answering"] == [{"peer_id": forger_id, "start": 0, "end": 6}]
            assert "do not answer (not counted): ..." + forger_id[-8:] in format_table(overview)
            refused = dict(overview.rejected_records)
            assert refused.get("unsigned", 0) >= 1, refused
            assert refused.get("bad signature", 0) + refused.get("signed in another peer's name", 0) >= 1, (
                refused
            )
        finally:
            blunt.shutdown()
            signer.shutdown()


def test_status_shows_what_answers_not_what_records_claim(pair, tmp_path):
    """`corolla status`: a forger's signed record of a server that does not exist, and its signed claim
    that the model has 1000 blocks, neither count; the real servers' 6 blocks are covered."""
    signer, forger_key, forger_id = signing_node(pair, tmp_path / "forger.key")
    subkey = owned_subkey(forger_id, forger_key)
    try:
        lure = ServerStatus(
            start=0, end=6, version="0", dtype="float32", inference_max_length=4096,
            cache_tokens_available=10**9, dht_prefix=PREFIX, throughput=1e9,
        )  # fmt: skip
        forge(signer, subkey, lure, range(6))
        expiration = get_dht_time() + 600
        assert signer.store(MODELS_KEY, {"dht_prefix": PREFIX, "num_blocks": 1000}, expiration, subkey=subkey)
        (result,) = run_corolla(["status", "--no-nat-port-map", "--initial-peers", *pair.initial_peers])
        assert result.returncode == 0, result.stderr
        out = result.stdout
        assert f"model {PREFIX}: 6 blocks, 2 servers" in out, out
        assert "(servers per block, 0-5): 111111" in out and "every block is covered" in out, out
        assert "1000" not in out and "uncovered" not in out, out
        (silent,) = [line for line in out.splitlines() if "do not answer (not counted)" in line]
        assert f"...{forger_id[-8:]} (0:6)" in silent, out  # shown apart (an earlier test's forger too)
        server_lines = [line for line in out.splitlines() if line.startswith("...")]
        assert len(server_lines) == 2 and all(forger_id[-8:] not in line for line in server_lines), out
        assert all(" online " in line for line in server_lines), out
    finally:
        signer.shutdown()
