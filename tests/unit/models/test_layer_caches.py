"""DeepSeek-V4's caches as corolla keeps them (models/layer_caches.py) and the token ids its hash-routed
experts read, which travel on the wire (models/handoff.py)."""

import pytest
import torch

from corolla.errors import InvalidRequest
from corolla.models.compressed_sizes import held_bytes
from corolla.models.contiguous import ContiguousCache
from corolla.models.layer_caches import hold, restore, window_mask
from corolla.models.model_config import ModelConfig
from corolla.models.span import Span
from corolla.server import validation
from corolla.wire import tensors as wire_tensors


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_token_ids_cross_the_wire_exactly_in_every_dtype(tiny_models, dtype):
    from transformers import AutoConfig

    wire = ModelConfig.from_hf(AutoConfig.for_model("deepseek_v4")).wire  # the real vocabulary: 129,280
    ids = torch.tensor([[0, 1, 255, 256, 65535, 65536, 129279]])
    hidden = torch.randn(1, 7, wire.streams, wire.hidden_size)
    packed = wire.pack(hidden, None, ids).to(dtype)
    assert packed.shape[-1] == wire.width and torch.equal(wire.ids(packed), ids)
    wire.check_ids(packed)
    unpacked, _ = wire.unpack(packed)
    assert unpacked.shape == hidden.shape


def test_a_peer_sending_ids_that_are_not_tokens_gets_an_error_naming_the_field(tiny_models):
    wire = ModelConfig.from_folder(tiny_models["deepseek_v4"]).wire
    good = wire.sample(2, 3)
    start = wire.streams * wire.hidden_size
    fraction, negative, beyond = good.clone(), good.clone(), good.clone()
    fraction[0, 1, start + 2] = 3.5
    negative[1, 0, start] = -1
    beyond[0, 0, start : start + 3] = torch.tensor([0.0, 1.0, 64.0])  # 320: the tiny vocabulary's size
    assert torch.equal(
        wire.ids(good),
        wire.ids(validation.read_hidden([wire_tensors.serialize(good)], wire.width, 4, wire=wire)),
    )
    for bad, message in [(fraction, "digits"), (negative, "digits"), (beyond, "below the vocabulary's 320")]:
        with pytest.raises(InvalidRequest, match=f"hidden_states: .*{message}"):
            validation.read_hidden([wire_tensors.serialize(bad)], wire.width, 4, wire=wire)


def test_window_mask_sees_the_kept_window_and_the_new_tokens_causally():
    visible = window_mask(10, 3, 4, torch.device("cpu"))[0, 0] == 0  # keys 7..12: 3 kept, 3 new
    assert visible.tolist() == [
        [True, True, True, True, False, False],  # query 10 sees 7..10
        [False, True, True, True, True, False],  # query 11 sees 8..11
        [False, False, True, True, True, True],  # query 12 sees 9..12
    ]
    assert window_mask(0, 2, 4, torch.device("cpu")).shape == (1, 1, 2, 2)


def test_a_sessions_cache_costs_what_the_span_charges(tiny_models):
    span = Span.load(tiny_models["deepseek_v4"], 0, 3)  # one HCA, one CSA and one sliding layer
    hf = span.config.hf
    fixed = sum(held_bytes(hf, layer, 4)[0] for layer in range(3))
    per_token = sum(held_bytes(hf, layer, 4)[1] for layer in range(3))
    assert span.state_blocks == (0, 1, 2) and span.kv_blocks == ()
    assert span.state_bytes_per_row == fixed and span.cache_bytes_per_token == int(per_token + 0.999)
    cache = ContiguousCache.for_span(span, 1, 64)
    tokens = 39  # a full window (8) and buffers full (39 = 3 mod 4, 1 mod 2): the most a row keeps
    with torch.no_grad():
        span(span.config.wire.sample(1, tokens), cache)
    kept = sum(hold(layer).nbytes for layer in cache.held_layers.values())
    # compressed entries are whole: the part of a window not yet compressed is in the buffers; each layer
    # also keeps its window's size as a tensor (8 bytes)
    assert fixed + per_token * (tokens - 3) <= kept <= fixed + per_token * tokens + 3 * 8


def test_a_held_cache_is_a_value_later_passes_do_not_change(tiny_models):
    span = Span.load(tiny_models["deepseek_v4"], 0, 2)
    cache = ContiguousCache.for_span(span, 1, 64)
    generator = torch.Generator().manual_seed(0)
    x, later = span.config.wire.sample(1, 9, generator=generator), span.config.wire.sample(1, 3)
    with torch.no_grad():
        span(x, cache)
        cache.position = 9
        held = {index: hold(layer) for index, layer in cache.held_layers.items()}
        first = span(later, cache, position=9)
        cache.held_layers = {index: restore(value) for index, value in held.items()}  # back to 9 tokens
        again = span(later, cache, position=9)
    torch.testing.assert_close(again, first, rtol=0, atol=0)


def test_sessions_decoding_together_share_the_blocks_pass_but_attention(tiny_models):
    """Rows of several sessions run a DeepSeek-V4 block as one pass (projections, streams, experts), only
    their attention's cache and compressors one row at a time: one call of the experts per pass."""
    from engine_helpers import make_engine, run_sessions

    engine = make_engine(tiny_models["deepseek_v4"], max_cache_tokens=4096)
    wire, generator = engine.span.config.wire, torch.Generator().manual_seed(5)
    plans = {
        f"s{i}": [wire.sample(1, 5 + i, generator=generator)] + [wire.sample(1, 1) for _ in range(3)]
        for i in range(3)
    }
    calls = []
    hook = engine.span.blocks[0].mlp.register_forward_hook(
        lambda m, args, out: calls.append(args[0].shape[1])
    )
    try:
        run_sessions(engine, plans)
    finally:
        hook.remove()
    assert 3 in calls  # a pass of three decode rows: one call
    assert len(calls) < sum(len(steps) for steps in plans.values())


def test_sessions_with_and_without_an_adapter_in_one_pass_get_their_own_outputs(tiny_models, tmp_path):
    """A LoRA adapter on attention, the compressors (run row by row) and the shared experts: two sessions
    decoding in the same passes, one with it, get what each gets alone (a contiguous cache)."""
    from peft import LoraConfig, get_peft_model

    from corolla.models import lora
    from engine_helpers import make_engine, reference_outputs, run_sessions
    from tiny_models import load_reference

    path = tiny_models["deepseek_v4"]
    torch.manual_seed(0)
    config = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_b_proj", "kv_proj", "gate_proj"], init_lora_weights=False
    )
    get_peft_model(load_reference(path), config).save_pretrained(tmp_path / "lora")
    engine = make_engine(path, max_cache_tokens=4096)
    lora.attach(engine.span.blocks, 0, lora.load_adapter(tmp_path / "lora", range(0, 6), "a"))
    wire, generator = engine.span.config.wire, torch.Generator().manual_seed(6)
    plans = {
        name: [wire.sample(1, 6, generator=generator)] + [wire.sample(1, 1) for _ in range(3)]
        for name in "ab"
    }
    opened = engine.open_session
    engine.open_session = lambda name, *args: opened(name, *args, adapter="a" if name == "a" else None)
    results = run_sessions(engine, plans)
    for name, adapter in (("a", "a"), ("b", None)):
        with lora.use_adapters(adapter):
            expected = reference_outputs(engine.span, plans[name])
        for actual, reference in zip(results[name], expected, strict=True):
            torch.testing.assert_close(actual, reference, rtol=0, atol=1e-4 * float(reference.abs().max()))
    with lora.use_adapters(None):
        plain = reference_outputs(engine.span, plans["a"])
    assert not torch.allclose(plain[-1], results["a"][-1])  # the adapter changes what it touches
