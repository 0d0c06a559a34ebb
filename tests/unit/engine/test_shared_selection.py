"""Sparse-attention layers that reuse an earlier layer's selection of keys (GLM-5 and Mistral Large 4
layers whose `indexer_types` entry is "shared": no indexer of their own), and Mistral Large 4's layers
that also read an earlier layer's latent (`kv_source_layers`). What a layer hands the next is carried
row by row in the engine's packed passes, so no span may separate such a layer from its source
(models/kv_sharing.py)."""

import pytest
import torch

from corolla.errors import InvalidRequest
from corolla.models.head import ModelHead
from corolla.models.span import Span
from engine_helpers import check_batched_sessions_match_each_alone, check_tree_step_and_kept_path, make_engine
from loopback import LoopbackSwarm, generate_together
from swarm_helpers import reference_generate
from tiny_models import load_reference, save_tiny_model

# layers 1, 3 and 4 reuse the selection of layers 0, 2 and 2: blocks 0-1 and 2-4 are never split
INDEXERS = ["full", "shared", "full", "shared", "shared", "full"]


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "tiny-glm-shared-indexers"
    return save_tiny_model("glm_moe_dsa", path, indexer_types=INDEXERS)


def test_spans_at_the_allowed_cuts_give_transformers_logits_and_others_are_refused(shared):
    reference = load_reference(shared)
    ids = torch.randint(3, 300, (2, 19), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(ids).logits
    head = ModelHead.load(shared)
    for split in [[(0, 6)], [(0, 2), (2, 6)], [(0, 2), (2, 5), (5, 6)]]:
        hidden = head.embed(ids)
        for start, end in split:
            hidden = Span.load(shared, start, end)(hidden)
        torch.testing.assert_close(head.logits(hidden), expected, atol=1e-4, rtol=0)
    assert Span.load(shared, 2, 6).selection_sources == {1: 0, 2: 0}
    refusal = r"blocks 0:4 cut glm_moe_dsa's layers 2-4: layers 3-4 use layer 2's sparse-attention selection"
    with pytest.raises(InvalidRequest, match=refusal):
        Span.load(shared, 0, 4)
    with pytest.raises(InvalidRequest, match=r"cut glm_moe_dsa's layers 0-1: layer 1 uses layer 0's"):
        Span.load(shared, 1, 6)


def test_batched_rows_trees_and_kept_paths_match_each_session_alone(shared):
    engine = make_engine(shared, max_batch_tokens=64)
    check_batched_sessions_match_each_alone(engine, [(1, 13), (2, 5), (3, 9)], steps=4, seed=2)
    check_tree_step_and_kept_path(engine, seed=3)


def test_greedy_tokens_through_two_servers_are_transformers(shared):
    reference = load_reference(shared)
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 300, (1, 4 + i), generator=generator) for i in range(4)]
    expected = [reference_generate(reference, ids, max_new_tokens=10) for ids in prompts]
    with LoopbackSwarm(shared, [(0, 2), (2, 6)]) as swarm:
        model = swarm.model()
        together, held = model.runtime.run(generate_together(model, swarm.servers, prompts, 10))
    assert held == [len(prompts)] * 2
    for index, (want, got) in enumerate(zip(expected, together, strict=True)):
        assert torch.equal(got, want), f"prompt {index} differs from transformers"


def test_mistral_large_4_layers_reading_an_earlier_latent_and_selection(tmp_path):
    """Layers 1, 3 and 5 read the latent and the selection of the layer before them (the last pair NoPE):
    transformers' logits at every allowed cut, and the engine's batched rows and trees, each row with its
    own handed-over latent."""
    text = dict(kv_source_layers=[0, 0, 2, 2, 4, 4], indexer_types=["full", "shared"] * 3)
    text["no_rope_layers"] = [1, 1, 1, 1, 0, 0]
    path = save_tiny_model("mistral_large4", tmp_path / "tiny-ml4-shared", text_config=text)
    reference = load_reference(path)
    ids = torch.randint(3, 300, (2, 15), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = reference(ids).logits
    head = ModelHead.load(path)
    hidden = head.embed(ids)
    for start, end in [(0, 2), (2, 4), (4, 6)]:
        hidden = Span.load(path, start, end)(hidden)
    torch.testing.assert_close(head.logits(hidden), expected, atol=1e-4, rtol=0)
    span = Span.load(path, 2, 6)
    assert span.kv_sources == span.selection_sources == {1: 0, 3: 2} and span.kv_blocks == (0, 2)
    with pytest.raises(InvalidRequest, match=r"layers 0-1: layer 1 uses layer 0's keys and values"):
        Span.load(path, 1, 6)
    engine = make_engine(path, max_batch_tokens=64)
    check_batched_sessions_match_each_alone(engine, [(1, 13), (2, 5), (3, 9)], steps=3, seed=5)
    check_tree_step_and_kept_path(engine, seed=6)
