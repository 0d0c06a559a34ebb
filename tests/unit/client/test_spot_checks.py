"""Spot checks: the comparison, the schedule, the judge, and real liars (server/faults.py) caught among
corolla's own servers in this process (tests/loopback.py): banned, reported, their tokens withdrawn and
redone (or a stream ended), training passes redone."""

from __future__ import annotations

import asyncio
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from corolla.client.checks.compare import (
    GRADIENT_TOLERANCE,
    TOLERANCE,
    deviation,
    first_change,
    first_wrong,
    gradients_agree,
    outputs_agree,
)
from corolla.client.checks.disputes import Dispute, Judge
from corolla.client.checks.spot_checks import SpotChecker
from corolla.client.training.remote_chain import RemoteChain
from corolla.decoding.chooser import Chooser, RowEnds
from corolla.decoding.sampling import SamplingParams
from corolla.errors import ServerUnavailable
from corolla.swarm.policy.routing import Hop
from loopback import LoopbackSwarm
from swarm_helpers import reference_generate

PROMPT = torch.tensor([[1, 5, 9, 22, 7, 31, 4]])
NEW_TOKENS = 40


def test_deviation_is_relative_per_position():
    reference = torch.randn(2, 5, 16)
    assert torch.allclose(deviation(reference, reference), torch.zeros(2, 5))
    scaled = reference * 1.01  # 1% off everywhere
    assert torch.allclose(deviation(scaled, reference), torch.full((2, 5), 0.01), atol=1e-5)
    assert first_wrong(scaled, reference) is None
    wrong = reference.clone()
    wrong[1, 3] += reference[1, 3].norm() * 2 * TOLERANCE / 16**0.5  # one row, one position past it
    assert first_wrong(wrong, reference) == 3


def test_a_verified_prefix_ends_where_the_history_changed():
    old = torch.randn(2, 6, 8)
    assert first_change(old, old) == 6 and first_change(old, torch.cat([old, old], dim=1)) == 6
    rolled_back = torch.cat([old[:, :4], torch.randn(2, 3, 8)], dim=1)
    assert first_change(old, rolled_back) == 4
    assert first_change(old, old[[1, 0]]) == 0  # rows reordered: nothing verified is left
    assert first_change(None, old) == 0


def test_each_hop_is_checked_once_per_window():
    checker = SpotChecker(swarm=None, share=0.1, seed=1)
    assert checker.window == 10
    offsets = checker.offsets(3)
    assert len(offsets) == 3 and all(0 <= offset < 10 for offset in offsets)


def chooser(do_sample: bool) -> Chooser:
    params = SamplingParams(max_new_tokens=8, do_sample=do_sample, temperature=1.0, seed=7, ignore_eos=True)
    return Chooser(params, RowEnds(params, [0], None, 1), 0, torch.tensor([[5, 6]]))


def test_a_rewound_chooser_chooses_the_same_tokens_again():
    logits = [torch.randn(1, 50, generator=torch.Generator().manual_seed(i)) for i in range(6)]
    for do_sample in (False, True):
        first = chooser(do_sample)
        tokens = [int(first.choose(x).tokens) for x in logits]
        assert first.rewind(2) == 4  # 4 choices forgotten
        assert first.num_chosen == 2 and first.context.tolist() == [[5, 6, *tokens[:2]]]
        again = [int(first.choose(x).tokens) for x in logits[2:]]
        assert again == tokens[2:]  # the sampler's state went back with it


def judged(liar: str, chains: dict[frozenset, list[str]]) -> tuple[str, ...]:
    """The verdict on checked server S, checked by the chain A (blocks 0:3) + C (3:6), when the chain
    that avoids each set of servers is `chains[avoided]` (absent: none) and `liar` corrupts every chain
    it is in."""
    right, wrong = torch.ones(1, 4, 8), -torch.ones(1, 4, 8)

    def outcome(servers):
        return wrong if liar in servers else right

    async def elsewhere(hop, run, avoid):
        servers = chains.get(frozenset(avoid))
        return (None, []) if servers is None else (outcome(servers), servers)

    faulty = {}
    undecided = []
    bans = SimpleNamespace(
        ban_for_good=lambda peer_id, reason: faulty.setdefault(peer_id, reason), dispute=undecided.append
    )
    judge = Judge(SimpleNamespace(bans=bans), Counter())
    judge.elsewhere = elsewhere
    dispute = Dispute(Hop("S", 0, 6), outcome(["S"]), outcome(["A", "C"]), ["A", "C"], None, outputs_agree)
    verdict = asyncio.run(judge.judge(dispute))
    if undecided:  # both sides avoided, neither accused
        assert faulty == judge.found == {} and undecided[0].peers == verdict
        return "undecided"
    assert set(faulty) == set(verdict) == set(judge.found)
    return verdict


def test_a_disagreement_is_decided_by_other_chains_or_left_undecided():
    outside = {frozenset({"S", "A", "C"}): ["B"]}  # a server outside both chains
    assert judged("S", outside) == ("S",)
    assert judged("A", outside) == ("A", "C")  # the checkers' chain lied: a client cannot tell which
    # too few replicas for that: one chain per checker, avoiding it (and S)
    per_checker = {frozenset({"S", "A"}): ["B", "C"], frozenset({"S", "C"}): ["A"]}
    assert judged("S", per_checker) == ("S",)  # both agree with the checkers: every checker is cleared
    assert judged("A", per_checker) == ("A",)  # B + C agrees with S: A, which it avoided, lied
    assert judged("C", per_checker) == ("C",)
    assert judged("S", {frozenset({"S", "A"}): ["B", "C"]}) == "undecided"  # C never cleared
    assert judged("S", {}) == "undecided"


def test_gradients_are_compared_as_one_vector():
    reference = torch.randn(2, 5, 16)
    tiny = reference.clone()
    tiny[0, 2] = 1e-6  # a position whose gradient is nothing: relative to itself, any change is huge
    changed = tiny.clone()
    changed[0, 2] = 1e-3
    assert not outputs_agree(changed, tiny) and gradients_agree(changed, tiny)
    assert not gradients_agree(reference * (1 + 2 * GRADIENT_TOLERANCE), reference)


@pytest.fixture(scope="module")
def expected(llama, reference):
    return reference_generate(reference, PROMPT, max_new_tokens=NEW_TOKENS)


@pytest.fixture
def replicas(llama):
    """Honest replicas of every block: (0, 6), (0, 3) and (3, 6)."""
    with LoopbackSwarm(llama, [(0, 6), (0, 3), (3, 6)]) as swarm:
        yield swarm


def preferring(model, liar, honest) -> None:
    """As if timed: the honest servers are slow, the liar fast (so the client routes through it)."""
    for server in honest:
        model.client.swarm.estimates.observe_step(server.peer_id, 1.0, 3)
    model.client.swarm.estimates.observe_step(liar.peer_id, 0.01, 6)


@pytest.mark.parametrize("fault", ["noise:0.1", "skip-layer", "wrong-weights", "garbage-after:12"])
def test_a_lying_server_is_caught_and_its_tokens_redone(replicas, expected, fault):
    honest = list(replicas.servers)
    liar = replicas.add_server((0, 6), fault=fault)
    model = replicas.model(spot_checks=0.1)
    preferring(model, liar, honest)
    tokens = model.generate(PROMPT, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    assert torch.equal(tokens, expected)
    assert set(model.client.swarm.bans.faulty) == {liar.peer_id}
    counts = model.client.checker.counts
    assert counts["failed"] == 1 and counts["passed"] >= 1, counts
    reported = replicas.network.reports[model.client.swarm.peers.transport.caller]
    assert reported[liar.peer_id].startswith("wrong outputs for blocks 0:6")


def test_each_consumer_reads_withdrawn_tokens_its_way(replicas, expected):
    """One loop decides: `generate` (and a whole API answer) drops and redoes them, a stream ends."""
    honest = list(replicas.servers)
    liar = replicas.add_server((0, 6), fault="garbage-after:12")
    model = replicas.model(spot_checks=1.0)
    preferring(model, liar, honest)
    kept, withdrawn = [], 0
    for step in model.runtime.iterate(
        model.agenerate_steps(PROMPT, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    ):
        if step.withdrawn:
            del kept[len(kept) - step.withdrawn :]
            withdrawn += step.withdrawn
        else:
            kept.append(int(step.tokens[0]))
    assert kept == expected[0, PROMPT.shape[1] :].tolist() and withdrawn >= 1
    second_liar = replicas.add_server((0, 6), fault="garbage-after:12")
    streaming = replicas.model(spot_checks=1.0)
    preferring(streaming, second_liar, honest)
    with pytest.raises(ServerUnavailable, match="streamed were wrong"):
        list(streaming.generate_stream(PROMPT, max_new_tokens=NEW_TOKENS, ignore_eos=True))


def test_honest_replicas_in_other_precisions_are_never_accused(replicas, expected):
    """float16 next to float32 here: a tiny random model drifts too far in bfloat16 or int8 (up to 0.7 and
    0.4) for any tolerance; SmolLM2 in every precision is bench/trust/spot_checks.py's false-alarm run."""
    replicas.add_server((0, 6), dtype="float16")
    model = replicas.model(spot_checks=1.0)
    model.generate(PROMPT, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    counts = model.client.checker.counts
    assert model.client.swarm.bans.faulty == {} and counts["failed"] == 0, counts
    assert counts["passed"] >= NEW_TOKENS, counts


def chain_pass(model, hidden, grad_outputs, share_forward, share_backward):
    """Outputs and input gradients of the whole chain (RemoteChain) with these spot-check shares."""
    checker, hidden = model.client.checker, hidden.clone().requires_grad_(True)
    checker.share = share_forward
    outputs = RemoteChain.apply(hidden, torch.empty(0), model.client.passes, model.runtime)
    checker.share = share_backward
    outputs.backward(grad_outputs)
    return outputs.detach(), hidden.grad


def test_a_server_lying_in_training_is_caught_and_its_pass_redone(replicas):
    """wrong-weights corrupts a forward's outputs and a backward's gradients. A client checking only the
    forward, then another checking only the backward: each bans the liar and redoes the pass on honest
    servers, so the outputs (forward) and the input gradients (both: a backward recomputes from the
    hop's inputs) are the honest ones."""
    generator = torch.Generator().manual_seed(11)
    hidden, grad_outputs = (
        torch.randn(2, 6, 64, generator=generator),
        torch.randn(2, 6, 64, generator=generator),
    )
    honest = list(replicas.servers)
    honest_outputs, honest_grad = chain_pass(replicas.model(spot_checks=1.0), hidden, grad_outputs, 0.0, 0.0)
    liar = replicas.add_server((0, 6), fault="wrong-weights")
    for shares in ((1.0, 0.0), (0.0, 1.0)):
        model = replicas.model(spot_checks=1.0)
        preferring(model, liar, honest)
        outputs, grad = chain_pass(model, hidden, grad_outputs, *shares)
        assert set(model.client.swarm.bans.faulty) == {liar.peer_id}, shares
        if shares[0]:
            torch.testing.assert_close(outputs, honest_outputs, atol=1e-5, rtol=1e-5)
        else:  # the forward went through the liar unchecked: its outputs are wrong
            assert not torch.allclose(outputs, honest_outputs, atol=1e-3)
        torch.testing.assert_close(grad, honest_grad, atol=1e-5, rtol=1e-5)
        assert model.client.checker.counts["failed"] == 1


def test_training_passes_on_honest_servers_pass_their_checks(replicas):
    """Deep prompts' gradients too: a model tuned with deep prompts, every pass checked."""
    input_ids = torch.randint(3, 300, (2, 7), generator=torch.Generator().manual_seed(5))
    model = replicas.model(tuning_mode="deep_ptune", pre_seq_len=3)
    with torch.no_grad():
        model.ptune.deep_prompts.normal_(std=0.05, generator=torch.Generator().manual_seed(0))
    model(input_ids, labels=input_ids).loss.backward()
    expected = [p.grad.clone() for p in model.parameters()]
    checked = replicas.model(tuning_mode="deep_ptune", pre_seq_len=3, spot_checks=1.0)
    checked.ptune.load_state_dict(model.ptune.state_dict())
    checked(input_ids, labels=input_ids).loss.backward()
    for got, want in zip([p.grad for p in checked.parameters()], expected, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    counts = checked.client.checker.counts
    assert counts["failed"] == 0 and counts["passed"] >= 2, counts
