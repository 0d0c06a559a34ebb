"""Spans of every supported family reproduce transformers' hidden states and cached decoding."""

import pytest
import torch
from transformers import DynamicCache

from corolla.models.contiguous import ContiguousCache
from corolla.models.head import ModelHead
from corolla.models.span import Span, align_prompts
from tiny_models import FAMILIES, load_reference

SPLITS = [[(0, 6)], [(0, 3), (3, 6)], [(0, 1), (1, 4), (4, 6)]]


@pytest.fixture(scope="module")
def references(tiny_models):
    return {family: load_reference(path) for family, path in tiny_models.items()}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("split", SPLITS, ids=["1span", "2spans", "3spans"])
def test_forward_matches_hidden_states_at_every_boundary(tiny_models, references, family, split):
    path, reference = tiny_models[family], references[family]
    input_ids = torch.randint(3, 300, (2, 19), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(input_ids, output_hidden_states=True)
    head = ModelHead.load(path)
    hidden = head.embed(input_ids)
    for start, end in split:
        hidden = Span.load(path, start, end)(hidden)
        if end < 6:  # the hidden states (Gemma 3n: its 4 streams) beside any per-layer inputs
            boundary, _ = head.wire.unpack(hidden)
            torch.testing.assert_close(boundary, expected.hidden_states[end], atol=1e-5, rtol=0)
    if head.wire.streams == 1:  # transformers records Gemma 3n's last streams before it merges them
        last, _ = head.wire.unpack(hidden)  # (ZAYA: without the router state the last layer hands on)
        torch.testing.assert_close(head.norm(last), expected.hidden_states[6], atol=1e-5, rtol=0)
    torch.testing.assert_close(head.logits(hidden), expected.logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_cached_steps_match_transformers_cache(tiny_models, references, family):
    """Prefill, decode steps and a multi-token step at an offset, with a sliding window for Mistral."""
    path, reference = tiny_models[family], references[family]
    input_ids = torch.randint(3, 300, (2, 20), generator=torch.Generator().manual_seed(2))
    head = ModelHead.load(path)
    spans = [Span.load(path, 0, 2), Span.load(path, 2, 6)]
    caches = [ContiguousCache.for_span(s, 2, 32) for s in spans]
    reference_cache = DynamicCache(config=reference.config)
    for start, end in [(0, 7), (7, 8), (8, 9), (9, 15), (15, 16), (16, 20)]:
        with torch.no_grad():
            expected = reference(input_ids[:, start:end], cache=reference_cache, use_cache=True).logits
        hidden = head.embed(input_ids[:, start:end])
        for span, cache in zip(spans, caches, strict=True):
            hidden = span(hidden, cache, position=start)
            cache.position = end
        torch.testing.assert_close(head.logits(hidden), expected, atol=1e-4, rtol=1e-4)  # logits reach ~10


def test_sub_range_of_a_span_and_rollback(tiny_models):
    path = tiny_models["llama"]
    span, half = Span.load(path, 0, 6), Span.load(path, 2, 4)
    generator = torch.Generator().manual_seed(3)
    hidden = torch.randn(1, 5, 64, generator=generator)
    torch.testing.assert_close(span(hidden, blocks=(2, 4)), half(hidden), atol=0, rtol=0)
    cache = ContiguousCache.for_span(span, 1, 16)
    first = span(hidden, cache, position=0)
    cache.position = 5
    span(torch.randn(1, 3, 64, generator=generator), cache, position=5)  # a step we then roll back
    cache.position = 3
    redo = span(hidden[:, 3:], cache, position=3)  # 2 tokens, not 5, in one matmul: rounding differs
    torch.testing.assert_close(redo, first[:, 3:], atol=1e-3, rtol=1e-3)


def test_reorder_for_beam_search(tiny_models):
    path = tiny_models["qwen2"]
    span = Span.load(path, 0, 6)
    generator = torch.Generator().manual_seed(4)
    prefix, step = torch.randn(3, 4, 64, generator=generator), torch.randn(3, 1, 64, generator=generator)
    cache = ContiguousCache.for_span(span, 3, 8)
    span(prefix, cache)
    cache.position = 4
    hypo_ids = torch.tensor([2, 2, 0])
    cache.reorder(hypo_ids)
    reordered = span(step, cache, position=4)
    expected = span(torch.cat([prefix[hypo_ids], step], dim=1))[:, -1:]
    # one step on the cache against one pass of 5: AVX-512 kernels round them 2.7e-4 apart; a wrong row is ~1
    torch.testing.assert_close(reordered, expected, atol=1e-3, rtol=1e-3)


def test_deep_prompts_are_added_at_their_positions(tiny_models):
    path = tiny_models["llama"]
    span = Span.load(path, 0, 6)
    hidden, prompts = torch.randn(1, 6, 64), torch.randn(6, 1, 2, 64)
    manual = hidden
    for i in range(6):
        manual = manual.clone()
        manual[:, :2] += prompts[i]
        manual = span(manual, blocks=(i, i + 1))
    torch.testing.assert_close(span(hidden, prompts=align_prompts(prompts, 0, 6)), manual, atol=1e-6, rtol=0)
    # a step of 2 tokens at position 1 gets prompt position 1 only
    step = align_prompts(prompts, 1, 2)
    assert torch.equal(step[:, :, 0], prompts[:, :, 1]) and not step[:, :, 1].any()
    assert align_prompts(prompts, 2, 3) is None


@pytest.mark.parametrize("family", ["Qwen2_5_VLConfig", "Qwen3VLConfig"])
def test_text_of_a_model_whose_causal_lm_is_only_its_multimodal_wrapper(tmp_path, family):
    """Qwen2.5-VL and Qwen3-VL: their text models have no causal LM of their own in transformers; spans of
    the wrapper's language model (multimodal rotary over text positions) give the wrapper's logits."""
    import transformers

    from corolla.models.lm_class import lm_class
    from tiny_models import COMMON

    rope = {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
    if family == "Qwen3VLConfig":
        vision.update(num_position_embeddings=16, deepstack_visual_indexes=[])
    text = {**COMMON, "head_dim": 16, "rope_parameters": rope}
    config = getattr(transformers, family)(text_config=text, vision_config=vision)
    torch.manual_seed(0)
    model = lm_class(config.get_text_config(), config)._from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(tmp_path)
    ids = torch.randint(3, 300, (2, 11), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    head = ModelHead.load(tmp_path)
    hidden = head.embed(ids)
    for start, end in [(0, 2), (2, 6)]:
        hidden = Span.load(tmp_path, start, end)(hidden)
    torch.testing.assert_close(head.logits(hidden), expected, atol=1e-4, rtol=0)


def test_llama_4_text_from_its_multimodal_checkpoint(tmp_path):
    """Llama 4 checkpoints hold the language model under `language_model.` (its own LM head included) beside
    the vision tower and projector: the head and spans read the language model's tensors only and give its
    causal LM's logits (transformers' wrapper forward needs images)."""
    import transformers

    from tiny_models import COMMON, LAYOUTS

    vision = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32
    )
    vision.update(patch_size=16, vision_output_dim=32, projector_input_dim=32, projector_output_dim=32)
    config = transformers.Llama4Config(text_config={**COMMON, **LAYOUTS["llama4"][1]}, vision_config=vision)
    torch.manual_seed(0)
    model = transformers.Llama4ForConditionalGeneration._from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(tmp_path)
    ids = torch.randint(3, 300, (2, 11), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        expected = model.language_model(input_ids=ids).logits
    head = ModelHead.load(tmp_path)
    hidden = head.embed(ids)
    for start, end in [(0, 3), (3, 6)]:
        hidden = Span.load(tmp_path, start, end)(hidden)
    torch.testing.assert_close(head.logits(hidden), expected, atol=1e-4, rtol=0)
