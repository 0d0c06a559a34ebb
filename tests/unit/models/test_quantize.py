"""Weight-only int8 / int4 quantization of transformer blocks (corolla.models.quantize)."""

import copy

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, LlamaConfig

from corolla.errors import InvalidRequest
from corolla.models.quantize import (
    QUANTIZE_MODES,
    Int4Linear,
    Int8Linear,
    precision_name,
    quantize_blocks,
    stored_in_four_bits,
    weight_bytes,
)
from corolla.models.span import Span

# measured on this tiny random model (seeds 0-5): int8 0.6-0.8% / 1.0-1.5%, int4 10-12% / 17-24%
LOGITS_BOUND = {"int8": 0.02, "int4": 0.2}
GRAD_BOUND = {"int8": 0.04, "int4": 0.4}
BYTES_RATIO = {"int8": 0.3, "int4": 0.2}  # vs float32; measured 0.27 and 0.14
# the tiny Mixtral below, seed 2: int8 2.0%, int4 (int8 experts, int4 attention) 9.1%; routing amplifies
MOE_LOGITS_BOUND = {"int8": 0.04, "int4": 0.2}


SHAPES = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(LlamaConfig(**SHAPES)).eval()


@pytest.fixture(scope="module")
def embeds(model):
    torch.manual_seed(1)
    return model.model.embed_tokens(torch.randint(0, 320, (2, 16))).detach()


def quantized(model, mode):
    copied = copy.deepcopy(model)
    quantize_blocks(copied.model.layers, mode)
    return copied


def logits_and_grad(model, embeds):
    x = embeds.clone().requires_grad_()
    logits = model(inputs_embeds=x).logits
    (grad,) = torch.autograd.grad(logits.square().sum(), [x])
    return logits.detach(), grad


def rel_err(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("mode", QUANTIZE_MODES)
def test_bytes_outputs_and_input_gradient(model, embeds, mode):
    q = quantized(model, mode)
    assert weight_bytes(q.model.layers) <= BYTES_RATIO[mode] * weight_bytes(model.model.layers)
    ref_logits, ref_grad = logits_and_grad(model, embeds)
    logits, grad = logits_and_grad(q, embeds)
    assert rel_err(logits, ref_logits) < LOGITS_BOUND[mode]
    assert rel_err(grad, ref_grad) < GRAD_BOUND[mode]


def test_int4_backward_is_the_gradient_of_the_quantized_model(model, embeds):
    q = quantized(model, "int4")
    dequantized = copy.deepcopy(model)
    n_int4 = 0
    for name, module in q.named_modules():
        if isinstance(module, Int4Linear):
            eye = torch.eye(module.in_features, dtype=torch.bfloat16)
            weight = nn.functional.linear(eye, module.weight).t().float()
            dequantized.get_submodule(name).weight.data = weight
            n_int4 += 1
    assert n_int4 == 14  # 7 linear layers in each of 2 blocks
    logits, grad = logits_and_grad(q, embeds)
    ref_logits, ref_grad = logits_and_grad(dequantized, embeds)
    assert rel_err(logits, ref_logits) < 0.01  # int4 linears see bfloat16 activations
    assert rel_err(grad, ref_grad) < 0.01


@pytest.mark.parametrize("mode", QUANTIZE_MODES)
def test_inference_mode_and_deepcopy(model, embeds, mode):
    q = quantized(model, mode)
    with torch.inference_mode():
        first = q(inputs_embeds=embeds).logits
        second = copy.deepcopy(q)(inputs_embeds=embeds).logits
    assert torch.equal(first, second)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_int4_keeps_the_dtype(dtype):
    linear = nn.Linear(128, 32).to(dtype)
    x = torch.randn(3, 128, dtype=dtype)
    ref = linear(x)
    quantize_blocks(linear, "int4")
    assert isinstance(linear, Int4Linear)
    out = linear(x)
    assert out.dtype == dtype
    assert rel_err(out.float(), ref.float()) < 0.2


def test_shapes_the_int4_kernel_cannot_take_stay_full_precision():
    block = nn.ModuleDict(
        {
            "grouped": nn.Linear(96, 32),  # groups of 32
            "odd_in": nn.Linear(48, 32),  # 32 does not divide 48 (the kernels take groups of 32, 64, 128)
            "odd_out": nn.Linear(64, 24),  # the CPU kernel needs out_features % 16 == 0
        }
    )
    quantize_blocks(block, "int4")
    assert block["grouped"].weight.block_size == [1, 32]
    assert type(block["odd_in"]) is nn.Linear and type(block["odd_in"].weight) is nn.Parameter
    assert type(block["odd_out"]) is nn.Linear and type(block["odd_out"].weight) is nn.Parameter


@pytest.mark.parametrize("in_features", [8, 24, 32])
def test_int8_on_the_cpu_takes_any_input_width(in_features):
    """torch's CPU int8 kernel crashes the process on input widths that are not a multiple of 16 (a
    low-rank adapter's 8): those stay torchao's int8 tensor, the same arithmetic by another path."""
    linear = nn.Linear(in_features, 64, bias=False)
    x = torch.randn(3, in_features)
    ref = linear(x)
    quantize_blocks(linear, "int8")
    assert isinstance(linear, Int8Linear) == (in_features % 16 == 0)
    assert rel_err(linear(x).float(), ref) < 0.05


def test_bad_mode_names_the_mode_and_the_supported_ones():
    with pytest.raises(InvalidRequest, match=r"'int3'.*int8.*int4"):
        quantize_blocks(nn.Linear(64, 64), "int3")
    with pytest.raises(InvalidRequest, match="int3"):
        precision_name(torch.float32, "int3")


def test_precision_name():
    assert precision_name(torch.bfloat16, None) == "bfloat16"
    assert precision_name(torch.float32, None) == "float32"
    assert precision_name(torch.float16, "int4") == "int4"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="requires CUDA")
@pytest.mark.parametrize("mode", QUANTIZE_MODES)
def test_on_cuda(mode):
    linear = nn.Linear(256, 64).cuda().half()
    x = torch.randn(4, 256, device="cuda", dtype=torch.float16, requires_grad=True)
    ref = linear(x)
    (ref_grad,) = torch.autograd.grad(ref.square().sum(), [x])
    quantize_blocks(linear, mode)
    out = linear(x)
    assert out.dtype == torch.float16
    assert rel_err(out.float(), ref.float()) < 0.2
    (grad,) = torch.autograd.grad(out.square().sum(), [x])
    assert rel_err(grad.float(), ref_grad.float()) < 0.4


@pytest.fixture(scope="module")
def moe():
    """A tiny Mixtral (fused 3-D experts) with transformers' default initialization."""
    from transformers import MixtralConfig

    torch.manual_seed(2)
    config = MixtralConfig(**SHAPES, num_local_experts=8, num_experts_per_tok=2)
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("mode", QUANTIZE_MODES)
def test_fused_experts_are_int8_in_both_modes_and_stay_close(moe, mode):
    q = copy.deepcopy(moe)
    assert quantize_blocks(q.model.layers, mode)  # it reports that it quantized fused experts
    experts = q.model.layers[0].mlp.experts
    assert type(experts.gate_up_proj).__name__ == type(experts.down_proj).__name__ == "Int8Tensor"
    full = weight_bytes(moe.model.layers[0].mlp.experts)
    assert weight_bytes(experts) <= 0.3 * full  # int8 values and one scale per row, against float32
    embeds = moe.model.embed_tokens(torch.randint(0, 320, (2, 12))).detach()
    with torch.no_grad():  # torchao cannot index these tensors under inference_mode (Span.computing)
        logits, ref = q(inputs_embeds=embeds).logits, moe(inputs_embeds=embeds).logits
    assert rel_err(logits, ref) < MOE_LOGITS_BOUND[mode]
    x = embeds.clone().requires_grad_()
    q(inputs_embeds=x).logits.square().sum().backward()  # a client's backward through frozen experts
    assert x.grad.abs().sum() > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="requires CUDA")
def test_fused_experts_are_int4_on_a_gpu_computing_in_bfloat16(moe):
    """On a GPU torchao's tile-packed int4 packs the 3-D experts expert by expert (on the CPU its int4
    tensor takes 2-D weights only, and experts become int8 in both modes)."""
    ref = copy.deepcopy(moe).cuda().to(torch.bfloat16)
    q = copy.deepcopy(ref)
    assert quantize_blocks(q.model.layers, "int4")
    experts = q.model.layers[0].mlp.experts
    assert "Int4" in type(experts.gate_up_proj).__name__ and "Int4" in type(experts.down_proj).__name__
    embeds = ref.model.embed_tokens(torch.randint(0, 320, (2, 12), device="cuda")).detach()
    with torch.no_grad():
        logits, expected = q(inputs_embeds=embeds).logits, ref(inputs_embeds=embeds).logits
    assert rel_err(logits.float(), expected.float()) < MOE_LOGITS_BOUND["int4"]


@pytest.mark.parametrize(
    ("family", "mode"),
    [
        ("qwen3_moe", "int8"),
        ("qwen3_next", "int4"),  # int8 on it: on an AVX-512 CPU its router flips for 1 token of 6 too
        ("jamba", "int4"),
        ("deepseek_v32", "int8"),
        ("gemma4", "int4"),
        ("hy_v4", "int4"),  # int8 noise flips a tiny router too (4 experts): 1 of 4 tokens at block 1
        ("glm5_next", "int4"),  # int8 on it: the same (54% from full precision: routers and streams)
    ],
)
def test_a_quantized_moe_span_serves_through_the_engine(tiny_models, family, mode):
    """MoE families of every cache kind: attention, linear attention, Mamba, sparse attention, Gemma 4's
    layers of different shapes, HY-V4's hyper-connection streams."""
    from corolla.config import EngineConfig
    from corolla.engine.engine import Engine
    from corolla.engine.sequence import StepWork
    from corolla.models.span import Span

    span = Span.load(tiny_models[family], 0, 6, quantize=mode)
    assert span.needs_no_grad
    engine = Engine(span, EngineConfig(max_cache_tokens=512, page_size=4, max_batch_wait_ms=0))
    session = engine.open_session("s", (0, 6), 1, 32)
    generator = torch.Generator().manual_seed(3)
    width = span.config.wire.width  # HY-V4: 4 streams of 64 (models/handoff.py)
    steps = [torch.randn(1, n, width, generator=generator) for n in (4, 1, 1)]
    outputs = []
    for position, hidden in zip((0, 4, 5), steps, strict=True):  # a prefill, then decode steps
        engine.add_step(StepWork(session, hidden, position))
        (done,) = [c for _ in range(5) for c in engine.step()][:1]
        assert done.error is None
        outputs.append(done.outputs)
    whole = torch.cat(steps, dim=1)
    with span.computing():
        quantized = span(whole)  # the same quantized blocks in one pass: what the engine must give
    scale = quantized.abs().max()  # int4's kernels take bfloat16 activations: its rounding is bfloat16's
    tolerance = (1e-2 if mode == "int4" else 1e-3) * scale
    torch.testing.assert_close(torch.cat(outputs, dim=1), quantized, rtol=0, atol=tolerance)
    if mode == "int8":  # int4 on 4 random tiny experts flips the router's choices: no bound that means much
        with torch.no_grad():
            expected = Span.load(tiny_models[family], 0, 6)(whole)
        # the first 4 positions: sparse attention's indexer (top 4) keeps every key there, as real models
        # (top 2048) do for short contexts; past that, quantization noise may change which keys it picks
        assert rel_err(quantized[:, :4], expected[:, :4]) < 0.15  # random tiny weights: 3.7% (qwen3_moe)


def on_four_bit_grid(weight: torch.Tensor) -> torch.Tensor:
    """Each group of 32 input features moved to the nearest of 16 levels between its minimum and maximum."""
    groups = weight.reshape(-1, 32)
    low, high = groups.amin(1, keepdim=True), groups.amax(1, keepdim=True)
    step = (high - low) / 15
    return (((groups - low) / step).round() * step + low).reshape(weight.shape)


def test_weights_stored_in_four_bits_are_recognized(model):
    block = copy.deepcopy(model.model.layers[0])
    assert not stored_in_four_bits(block)  # random float weights
    for linear in [m for m in block.modules() if isinstance(m, nn.Linear)]:
        linear.weight.data = on_four_bit_grid(linear.weight.data)
    assert stored_in_four_bits(block)
    block.self_attn.q_proj.weight.data[0, 0] += 1e-3  # one weight off its grid
    assert not stored_in_four_bits(block)


def test_int8_on_a_q4_gguf_says_int4_keeps_its_grid(smollm2_path, caplog):
    with caplog.at_level("WARNING", logger="corolla.models.quantize"):
        Span.load(smollm2_path, 0, 1, quantize="int8")
    assert "Blocks 0:1 were stored in 4 bits" in caplog.text and "--quantize int4" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="corolla.models.quantize"):
        Span.load(smollm2_path, 0, 1, quantize="int4")
    assert "stored in 4 bits" not in caplog.text
