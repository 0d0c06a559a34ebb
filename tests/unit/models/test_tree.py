"""Token trees: validation of untrusted parents, depths, masks, paths; a span runs a tree exactly as it would
run each of its paths alone, with corolla's contiguous cache, in every family's attention variant."""

import pytest
import torch

from corolla.errors import InvalidRequest
from corolla.models.contiguous import ContiguousCache
from corolla.models.span import Span
from corolla.models.tree import TokenTree
from engine_helpers import assert_close

# 0 -> 1 -> 3 -> 5, 0 -> 2 -> 4, and a second root 6
PARENTS = [-1, 0, 0, 1, 2, 3, -1]


@pytest.mark.parametrize(
    ("parents", "message"),
    [
        ([-1, 1], "tree[1]=1: a token cannot be its own parent (a cycle)"),
        ([-1, 2, 1], "tree[1]=2: a parent must come before its child (-1 or 0..0)"),
        ([-1, -2], "tree[1]=-2 is out of range: -1 (a root) or 0..0"),
        ([-1, 0.5], "tree[1] must be an integer parent index, got 0.5"),
        ([-1, True], "tree[1] must be an integer parent index, got True"),
    ],
)
def test_malformed_parents_are_refused_naming_the_token(parents, message):
    with pytest.raises(InvalidRequest) as info:
        TokenTree(parents)
    assert message in str(info.value)


def test_depths_ancestors_paths_and_mask():
    tree = TokenTree(PARENTS)
    assert tree.depths.tolist() == [0, 1, 1, 2, 2, 3, 0]
    assert tree.ancestors[5].nonzero().flatten().tolist() == [0, 1, 3, 5]
    assert tree.children(0) == [1, 2] and tree.children(5) == []
    assert tree.is_path([0, 1, 3]) and tree.is_path([6]) and tree.is_path([])
    assert not tree.is_path([1, 3]) and not tree.is_path([0, 2, 3]) and not tree.is_path([0, 9])
    assert TokenTree.chain(4).is_chain and not tree.is_chain
    mask = tree.mask(start=3)
    assert mask.shape == (7, 10) and bool(mask[:, :3].all())  # everyone sees the 3 positions before
    assert mask[4, 3:].nonzero().flatten().tolist() == [0, 2, 4]
    windowed = tree.mask(start=3, window=2)  # token 5 sits at position 6: it sees positions 5 and 6
    assert windowed[5].nonzero().flatten().tolist() == [3 + 3, 3 + 5]
    chunked = tree.mask(start=3, chunk=4)  # chunks [0, 4) and [4, 8): token 0 sits at 3, token 5 at 6
    assert chunked[0].nonzero().flatten().tolist() == [0, 1, 2, 3 + 0]
    assert chunked[5].nonzero().flatten().tolist() == [3 + 1, 3 + 3, 3 + 5]


def _paths(tree: TokenTree) -> list[list[int]]:
    leaves = [i for i in range(len(tree)) if not tree.children(i)]
    paths = []
    for leaf in leaves:
        path = [leaf]
        while tree.parents[path[0]] >= 0:
            path.insert(0, tree.parents[path[0]])
        paths.append(path)
    return paths


@pytest.mark.parametrize(
    "family",
    [
        "llama",
        "mistral",
        "gemma2",
        "gemma3_text",
        "gpt_oss",
        "qwen3",
        "deepseek_v3",
        "gemma4",
        "longcat_flash",
    ],
)
def test_a_tree_step_equals_each_of_its_paths_run_alone(tiny_models, family):
    """Rotary positions by depth, ancestors-only masks, sliding windows, soft-capping and sinks: every
    token's output equals the one it gets in a plain sequence; keeping a path leaves a cache that goes on
    exactly like the sequence's."""
    span = Span.load(tiny_models[family], 0, 6)
    hidden_size = span.config.hidden_size
    generator = torch.Generator().manual_seed(0)
    prefix = torch.randn(1, 5, hidden_size, generator=generator)
    nodes = torch.randn(1, len(PARENTS), hidden_size, generator=generator)
    tree = TokenTree(PARENTS)

    def cache():
        return ContiguousCache.for_span(span, 1, 32)

    with torch.no_grad():
        treed = cache()
        span(prefix, treed, 0)
        treed.position, treed.tree = 5, tree
        tree_outputs = span(nodes, treed, 5, positions=tree.positions(5))
        treed.tree = None
        for path in _paths(tree):
            alone = cache()
            expected = span(torch.cat([prefix, nodes[:, path]], dim=1), alone, 0)[:, 5:]
            assert_close(tree_outputs[:, path], expected)
        # keep the path 0 -> 2 -> 4, then go on: the same as a sequence of prefix + that path
        treed.keep(5, [0, 2, 4])
        later = torch.randn(1, 2, hidden_size, generator=generator)
        outputs = span(later, treed, treed.position)
        alone = cache()
        expected = span(torch.cat([prefix, nodes[:, [0, 2, 4]], later], dim=1), alone, 0)[:, -2:]
        assert_close(outputs, expected)
