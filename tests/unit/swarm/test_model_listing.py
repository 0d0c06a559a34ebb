"""Which servers list their model under the models key (swarm/records/model_listing.py): a fixed few however
large the swarm, the same few whoever decides, every server while it knows too few."""

from __future__ import annotations

from corolla.swarm.records.model_listing import MODEL_LISTERS, lists_model


def test_a_fixed_few_list_the_model_whoever_decides():
    swarm = [f"peer{i}" for i in range(1000)]
    listers = [peer for peer in swarm if lists_model(peer, "llama-70b", swarm)]
    assert len(listers) == MODEL_LISTERS
    # a server that has not seen itself in its read (its own record not stored yet) decides the same
    assert all(lists_model(peer, "llama-70b", set(swarm) - {peer}) for peer in listers)
    # another model's listers are others: no server carries every model's listing
    others = {peer for peer in swarm if lists_model(peer, "mistral", swarm)}
    assert len(others) == MODEL_LISTERS and others != set(listers)


def test_every_server_lists_while_it_knows_few():
    assert lists_model("alone", "m", [])  # before its first read of the swarm
    few = [f"peer{i}" for i in range(MODEL_LISTERS)]
    assert all(lists_model(peer, "m", few) for peer in few)
