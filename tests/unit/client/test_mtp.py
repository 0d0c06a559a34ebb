"""Drafting with a checkpoint's own multi-token prediction layers (decoding/mtp.py), against transformers'
MTP layers (`MtpModel`), and through chains of corolla's servers in this process (tests/loopback.py): the
drafts are the ones transformers' layers make from the same hidden states, and the tokens plain
decoding's, synchronous and pipelined."""

from __future__ import annotations

import pytest
import torch
from transformers.cache_utils import MtpCache

from corolla.config import SpeculationConfig
from corolla.decoding.mtp import MtpDrafter, MtpSession
from corolla.decoding.speculator import Speculator
from corolla.errors import InvalidRequest
from corolla.models.head import ModelHead
from corolla.models.model_config import ModelConfig
from loopback import LoopbackSwarm
from swarm_helpers import reference_generate
from tiny_models import load_mtp_reference

FAMILY = "deepseek_v3"  # latent attention and MoE, one MTP layer: DeepSeek-V3's layout
SPANS = [(0, 2), (2, 4), (4, 6)]


@pytest.fixture(scope="module")
def mtp_model(tiny_models):
    path = tiny_models[FAMILY]  # saved with one MTP layer
    reference, layers = load_mtp_reference(path)
    head = ModelHead.load(path)
    return path, reference, layers, MtpDrafter.load(path, ModelConfig.from_folder(path), head)


def last_block_and_choice(reference, ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The last block's outputs [T, H] (before the final norm: what the last server returns) and the greedy
    choice after ids [1, T]."""
    captured = {}
    hook = reference.model.layers[-1].register_forward_hook(lambda m, a, out: captured.update(out=out))
    try:
        with torch.no_grad():
            logits = reference(ids).logits
    finally:
        hook.remove()
    out = captured["out"]
    return (out[0] if isinstance(out, tuple) else out)[0], int(logits[0, -1].argmax())


def transformers_draft(reference, layers, context: list[int]) -> int:
    """The token transformers' MTP layer drafts after `context` (its last token the model's own choice),
    computed as transformers' MTP candidate generator does after a prefill."""
    ids = torch.tensor([context])
    with torch.no_grad():
        hidden = reference(ids[:, :-1], output_hidden_states=True).hidden_states[-1]  # after the final norm
        length = ids.shape[1] - 1
        positions = torch.arange(1, length + 1)[None]
        tokens, _, _ = layers(ids[:, 1:], hidden, None, positions, MtpCache(config=layers.config))
    return int(tokens[0, 0])


def test_mtp_drafts_are_transformers_own_and_survive_pieces_and_rollbacks(mtp_model):
    path, reference, layers, drafter = mtp_model
    generator = torch.Generator().manual_seed(0)
    for _ in range(4):
        ids = torch.randint(3, 300, (1, 12), generator=generator)
        outputs, chosen = last_block_and_choice(reference, ids)
        context = [*ids[0].tolist(), chosen]
        expected = transformers_draft(reference, layers, context)
        whole = drafter.start(64)
        whole.observe(0, outputs, context[1:])
        deep = whole.propose(context, 3, 8)
        assert deep.tokens[0] == expected and deep.parents == [-1, 0, 1]
        # observed in two pieces, the first drafted from (its positions stay in the layer's cache)
        pieces = drafter.start(64)
        pieces.observe(0, outputs[:5], context[1:6])
        pieces.propose(context[:6], 2, 8)
        pieces.observe(5, outputs[5:], context[6:])
        assert pieces.propose(context, 3, 8).tokens == deep.tokens
        # a rollback: what was observed after position 3 is replaced
        pieces.observe(3, outputs[3:], context[4:])
        assert pieces.propose(context, 3, 8).tokens == deep.tokens
        # text past what was verified: drafted on the layer's own outputs, and a stale text drafts nothing
        assert whole.propose([*context, deep.tokens[0]], 2, 8).tokens == deep.tokens[1:3]
        assert whole.propose([*context[:-1], (chosen + 1) % 300], 2, 8).tokens == []


def test_mtp_is_refused_for_checkpoints_without_the_layers(tiny_models):
    path = tiny_models["llama"]
    config = ModelConfig.from_folder(path)
    with pytest.raises(InvalidRequest, match="no multi-token prediction layers"):
        Speculator.create(SpeculationConfig(draft="mtp"), config, path, ModelHead.load(path))


@pytest.mark.parametrize("pipeline", [1, 3])
def test_mtp_speculation_through_three_servers_gives_plain_greedy_tokens(mtp_model, pipeline):
    """Each synchronous round drafts, first, what transformers' MTP layer drafts after the verified text
    (the decode loop hands the drafter the outputs of every verified position); pipelined rounds draft on
    from unverified text. The tokens are plain decoding's."""
    path, reference, layers, _ = mtp_model
    prompt = torch.randint(3, 300, (1, 20), generator=torch.Generator().manual_seed(5))
    expected = reference_generate(reference, prompt, max_new_tokens=20)
    proposed: list[tuple[list[int], list[int]]] = []
    propose = MtpSession.propose

    def recorded(self, context, depth, max_tokens):
        draft = propose(self, context, depth, max_tokens)
        proposed.append((list(context), draft.tokens))
        return draft

    speculation = SpeculationConfig(draft="mtp", max_depth=3, adaptive=False, pipeline=pipeline)
    with LoopbackSwarm(path, SPANS) as swarm, pytest.MonkeyPatch.context() as patch:
        patch.setattr(MtpSession, "propose", recorded)
        model = swarm.model(speculation=speculation)
        assert torch.equal(model.generate(prompt, max_new_tokens=20), expected)
        stats = model.speculator.stats
    assert stats.emitted == 19 and stats.drafted > 0
    if pipeline == 1:  # every draft follows verified text: transformers' own first guess
        assert len(proposed) > 2 and all(tokens for _, tokens in proposed)
        for context, tokens in proposed:
            assert tokens[0] == transformers_draft(reference, layers, context)
    else:
        assert stats.most_in_flight > 1
