"""Speculative decoding's pure parts: the verification walk, the depth policy, the drafters."""

import torch

from corolla.client.generation.pipelined import frame_tokens
from corolla.decoding.chooser import Chooser, RowEnds
from corolla.decoding.draft_budget import DraftBudget
from corolla.decoding.draft_model import DraftModel
from corolla.decoding.drafting import Draft, PromptLookup
from corolla.decoding.round_choice import RoundChoice
from corolla.decoding.sampling import SamplingParams
from corolla.decoding.verify import verify
from corolla.models.tree import TokenTree
from tiny_models import load_reference

VOCAB = 16


def walk(*args):
    """verify's result as (steps, path, accepted)."""
    verified = verify(*args)
    return verified.steps, verified.path, verified.accepted


def one_hot(*tokens: int) -> torch.Tensor:
    """Logits [len(tokens), VOCAB] whose argmax in row i is tokens[i]."""
    logits = torch.zeros(len(tokens), VOCAB)
    logits[torch.arange(len(tokens)), torch.tensor(tokens)] = 5.0
    return logits


def chooser(max_new_tokens=10, eos=(), **params) -> Chooser:
    params = SamplingParams(max_new_tokens=max_new_tokens, **params)
    return Chooser(params, RowEnds(params, eos, None, 1), 0, torch.tensor([[1, 2, 3]]))


def test_the_walk_follows_the_models_own_choices_and_ends_with_one_of_its_own():
    # root 9, then drafted 4 (child of root), 5 (child of root), 6 (child of 4)
    nodes, tree = [9, 4, 5, 6], TokenTree([-1, 0, 0, 1])
    # the model picks 5 after the root (node 2), then 11 after node 2: 11 is not drafted
    steps, path, accepted = walk(chooser(), one_hot(5, 0, 11, 0), nodes, tree)
    assert [int(s.tokens[0]) for s in steps] == [5, 11]
    assert path == [0, 2] and accepted == 1
    # the model agrees with the whole chain root -> 4 -> 6, then picks 7
    steps, path, accepted = walk(chooser(), one_hot(4, 6, 0, 7), nodes, tree)
    assert [int(s.tokens[0]) for s in steps] == [4, 6, 7] and path == [0, 1, 3] and accepted == 2


def test_the_walk_stops_at_max_new_tokens_and_eos_even_where_the_draft_goes_on():
    nodes, tree = [9, 4, 6, 7], TokenTree.chain(4)
    capped = chooser(max_new_tokens=2)
    steps, path, _ = walk(capped, one_hot(4, 6, 7, 8), nodes, tree)
    assert [int(s.tokens[0]) for s in steps] == [4, 6] and path == [0, 1]  # the cache keeps up to 4
    steps, path, _ = walk(chooser(eos=(6,)), one_hot(4, 6, 7, 8), nodes, tree)
    assert [int(s.tokens[0]) for s in steps] == [4, 6] and bool(steps[-1].finished[0])


def test_sampled_tokens_are_the_draws_plain_decoding_makes():
    """Each emitted token costs one draw of the request's generator, as in plain decoding, whatever the
    tree: the same seed gives the same tokens."""
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(0))
    plain = chooser(do_sample=True, seed=7)
    expected = [int(plain.choose(logits[i : i + 1]).tokens[0]) for i in range(2)]
    nodes = [9, expected[0], (expected[0] + 1) % VOCAB, 3]  # the first draw is drafted, the second not
    tree = TokenTree([-1, 0, 0, 1])
    rows = torch.stack([logits[0], logits[1], logits[2], logits[3]])
    steps, path, _ = walk(chooser(do_sample=True, seed=7), rows, nodes, tree)
    assert [int(s.tokens[0]) for s in steps][:2] == expected and path[:2] == [0, 1]


def test_the_budget_drafts_deep_when_round_trips_dominate_and_not_at_all_when_drafts_fail():
    far = DraftBudget(max_depth=8)
    for step in range(40):
        depth = far.depth(8)
        far.record(depth, depth if step % 10 else depth - 1, 0.18 + 0.01 * depth)  # good drafts, 180 ms trips
    assert far.last_best >= 5
    near = DraftBudget(max_depth=8)
    for _ in range(40):
        depth = near.depth(8)
        near.record(depth, 0, 0.02 + 0.01 * depth)  # every draft rejected; each level costs half a step
    assert near.last_best == 0 and near.depth(8) in (0, 1)
    assert DraftBudget(max_depth=6, adaptive=False).depth(4) == 4  # fixed depth, within the limit


def test_prompt_lookup_drafts_what_followed_the_last_tokens():
    lookup = PromptLookup(width=1)
    assert lookup.propose([5, 6, 7, 8, 9, 10, 3, 5, 6, 7], 3, 10) == Draft([8, 9, 10], [-1, 0, 1])
    assert lookup.propose([5, 6, 7, 8], 3, 10) == Draft()  # 8 never appeared before
    assert lookup.propose([5, 6, 7, 8, 5, 6], 4, 2).tokens == [7, 8]  # at most max_tokens
    assert lookup.propose([1, 2, 9, 3, 2], 2, 10).tokens == [9, 3]  # from one token when need be


def test_prompt_lookup_merges_the_latest_places_into_a_tree():
    # "4 5" was followed by "6 7" and later by "6 9": the latest first, their shared "6" once
    context = [4, 5, 6, 7, 1, 4, 5, 6, 9, 2, 4, 5]
    assert PromptLookup(width=2).propose(context, 2, 10) == Draft([6, 9, 7], [-1, 0, 0])
    assert PromptLookup(width=1).propose(context, 2, 10) == Draft([6, 9], [-1, 0])


def test_a_draft_model_identical_to_the_target_drafts_its_greedy_text_as_a_chain_and_in_a_tree(tiny_models):
    """The draft model (a local copy of the tiny llama) drafts exactly transformers' greedy continuation,
    also after keeping the path the text took through its previous tree."""
    path = tiny_models["llama"]
    prompt = torch.randint(3, 300, (1, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        text = (
            load_reference(path)
            .generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=12)[0]
            .tolist()
        )
    for width in (1, 3):
        drafts = DraftModel.load(path, width=width).start(64)
        position = 8  # the prompt and the first chosen token
        while position + 4 <= len(text):
            draft = drafts.propose(text[:position], 3, 16)
            tree = TokenTree(draft.parents)
            assert len(draft) <= 3 * width and draft.depth == 3
            node, followed = -1, 0  # the greedy text is a path of the draft
            for token in text[position : position + 3]:
                node = next(c for c in tree.children(node) if draft.tokens[c] == token)
                followed += 1
            assert followed == 3
            position += 2  # as if the model had accepted one drafted token and chosen the next


def test_a_draft_model_with_recurrent_layers_is_refused_when_loaded(tiny_models):
    import pytest

    from corolla.errors import UnsupportedModel

    with pytest.raises(UnsupportedModel, match="qwen3_5_text layers keep recurrent states") as refused:
        DraftModel.load(tiny_models["qwen3_5"])
    assert "\n" not in str(refused.value)


def test_the_frames_in_flight_carry_about_one_synchronous_draft_between_them():
    assert [frame_tokens(8, in_flight) for in_flight in (1, 2, 3, 4)] == [8, 4, 3, 2]
    assert frame_tokens(3, 3) == frame_tokens(1, 4) == 1  # never less than a token


def test_rounds_keep_the_frames_in_flight_that_emit_the_most_tokens_per_second_and_retry_their_neighbours():
    choice = RoundChoice(pipeline=3)
    rates = {3: 40, 2: 30, 1: 20}  # tokens per second at each depth in flight (1: synchronous rounds)
    tried = []
    for _ in range(4):
        tried.append(depth := choice.depth())
        choice.record(depth, rates[depth] // 2, 0.5)
    assert tried == [3, 3, 1, 1]  # the deepest and synchronous rounds twice first
    picks = []
    for _ in range(108):  # choices 5 to 112
        picks.append(depth := choice.depth())
        choice.record(depth, rates[depth] // 2, 0.5)
    # a neighbour of the fastest once at choice 16, then twice as rarely while the fastest stays: 48, 112
    assert [(i + 5, pick) for i, pick in enumerate(picks) if pick != 3] == [(16, 2), (48, 2), (112, 2)]
    for _ in range(8):  # drafts got worse: two frames in flight emit the most now
        choice.record(3, 5, 0.5)
    assert choice.depth() == 2
    for _ in range(8):  # and then the round trips got short: synchronous rounds are the fastest
        choice.record(2, 5, 0.5)
    assert choice.depth() == 1
    assert RoundChoice(pipeline=1).depth() == 1  # never pipelined
    forced = RoundChoice(pipeline=3, adaptive=False)
    forced.record(3, 1, 10.0)
    assert all(forced.depth() == 3 for _ in range(20))


def test_a_pipelined_round_is_measured_in_segments_and_ends_at_a_rejection_when_synchronous_is_faster():
    from corolla.client.generation.pipelined import _Segment
    from corolla.decoding.round_choice import SEGMENT_TOKENS

    choice = RoundChoice(pipeline=3)
    for _ in range(2):
        choice.record(1, 100, 1.0)  # synchronous rounds: 100 tokens/s
    choice.record(3, 50, 1.0)
    segment = _Segment(choice, 3)
    assert segment.goes_on(SEGMENT_TOKENS - 1)  # too few tokens to tell: nothing recorded
    assert len(choice._seen[3]) == 1
    assert not segment.goes_on(SEGMENT_TOKENS)  # recorded; a pipelined segment is far slower: it ends
    assert len(choice._seen[3]) == 2 and choice._seen[3][-1][0] == SEGMENT_TOKENS
    segment.end(SEGMENT_TOKENS + 3)  # the round's end records what came after, at the depth sent at
    assert choice._seen[3][-1][0] == 3 and len(choice._seen[1]) == 2
