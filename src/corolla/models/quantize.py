"""Weight-only int8 / int4 quantization of a server's transformer blocks, through torchao.

`quantize_blocks(span, mode)` replaces the weight of every `nn.Linear` inside `span` (attention
projections, MLPs, and MoE experts or routers that are `nn.Linear`) with a torchao tensor subclass, in
place. The span keeps its dtype: activations, norms, biases and the attention cache stay in it.

- "int8": `Int8WeightOnlyConfig()` chooses symmetric per-output-row scales. On CPU the layer becomes an
  `Int8Linear`, multiplied by torch's `_weight_int8pack_mm` on bfloat16 activations (torchao's own int8
  path rebuilds a float copy of each weight on every call: ~8x slower than float32 on 1B-size layers).
  On CUDA torchao's tensor subclass runs as is.
- "int4": asymmetric groups of `GROUP_SIZE` input features, packed by tinygemm from a bfloat16 copy of
  the weight (bfloat16 scales and zero points). Its kernels take bfloat16 activations: `Int4Linear`
  casts its input to bfloat16 and its output back, so a float32 or float16 span stays one. On CPU the
  kernel is also 10-40x slower on float32 or float16 inputs than on bfloat16 ones (AVX2, torch 2.13).
  On CPU: `PrototypeInt4WeightOnlyConfig` (torchao 0.18 moved the CPU "opaque" packing out of
  `Int4WeightOnlyConfig` into its prototype namespace), kernel `_weight_int4pack_mm_for_cpu`; it needs
  out_features % 16 == 0. On CUDA: `Int4WeightOnlyConfig(int4_packing_format="tile_packed_to_4d")`,
  kernel `_weight_int4pack_mm`, compute capability 8.0 or newer; it pads in_features to a multiple of
  1024, so a 576-wide layer stores 1.8x the packed bytes. (The default "plain" packing needs the mslk
  package, which corolla does not install.) The CUDA path has not been run on a GPU yet.
  A linear whose in_features `GROUP_SIZE` does not divide, or that fails the CPU kernel's out_features
  rule, stays at full precision. Groups of
  32, not 64: 5 bits per weight instead of 4.5, and SmolLM2's perplexity (bench/models/quantize.py) 1.002x
  fp32's instead of 1.32x (its weights come from a GGUF quantized in blocks of 32).

Faithfulness (issue 26, item 7): on SmolLM2 int8 agrees with fp32 less than int4 does, and the cause is
int8's grid, not its bfloat16 activations (bench/models/quantize_isolation.py, one run: along fp32's own
continuations, KL from fp32 0.0037 for int8, 0.0017 for int4, 0.0002 for float32 weights with bfloat16
linear inputs and outputs; top-1 496, 504 and 509 of 512; greedy agreement, which one early flip
decides, 128, 285 and 334 of 512). SmolLM2's weights come from a Q4_1 GGUF (asymmetric groups of 32 with
a float minimum): int4's groups of 32 with float zero points land on that grid, int8's per-row steps do
not (0.88% of the weight's norm lost per linear). Only an int8 grid holding the int4 one agrees
(asymmetric groups of 32 with a float minimum, simulated: 512 of 512), and neither torch nor torchao has
a CPU kernel for it (torchao's IntxWeightOnlyConfig dequantizes on every call, 2.4x the time per token,
and its integer zero points miss the grid). So `Span.load`, asked for int8, calls
`warn_if_int8_loses_grid`, which recognizes weights stored on a 4-bit grid (`stored_in_four_bits`) and
says that int4 keeps it. On weights not stored in 4 bits int8 is the faithful one (the tiny random model
in tests: 0.7% vs 11% of the logits).

MoE experts that transformers 5 stores as fused 3-D parameters (`gate_up_proj`, `down_proj` on a
`...Experts` module: Mixtral, Qwen3-MoE, DeepSeek) are not `nn.Linear`: they become torchao int8 tensors
(`quantize_fused_experts`), dequantized per expert and call (memory, not speed), or, asked for int4 on a
GPU computing in bfloat16, torchao's tile-packed int4 tensors (3-D, indexed expert by expert; not run on
a GPU yet). torchao's CPU int4 tensor takes 2-D weights only.

Autograd with respect to the input (frozen weights, as in a client's fine-tuning backward pass):
int8 works as is, torchao's int8 linear being made of differentiable torch ops. The int4 kernels have
no derivative ("derivative for aten::_weight_int4pack_mm_for_cpu is not implemented"), so each int4
linear becomes an `Int4Linear`, whose backward computes `grad @ W`, W dequantized by the kernel itself
(applied to an identity matrix), one layer at a time, only while the backward runs.
Both modes run under `torch.inference_mode()` (fused experts: `torch.no_grad()`) and survive `copy.deepcopy`.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from corolla.config import QUANTIZE_MODES
from corolla.errors import InvalidRequest

logger = logging.getLogger(__name__)

GROUP_SIZE = 32  # int4 group of input features sharing a scale and a zero point (kernels: 32, 64, 128)
INT8_CPU_DTYPE = torch.bfloat16  # of the activations and scales fed to torch's CPU int8 kernel
INT4_DTYPE = torch.bfloat16  # of the weights packed in int4 and the activations fed to their kernels
GRID_TOLERANCE = 0.01  # of a level, for weights read back from a 4-bit grid (fp16 scales, float32 sums)
CPU_INT4_OUT_MULTIPLE = 16  # _convert_weight_to_int4pack_for_cpu: "expect N to be dividable by 16"
# torch's CPU `_weight_int8pack_mm` crashes the process (a segmentation fault, torch 2.13) unless the input
# features are a multiple of 16 (measured: 8, 24 and 40 crash; 16, 32 and 48 do not): other shapes keep
# torchao's int8 tensor (Zamba2's low-rank adapters)
CPU_INT8_IN_MULTIPLE = 16


def check_mode(mode: str) -> None:
    if mode not in QUANTIZE_MODES:
        raise InvalidRequest(f"quantization mode {mode!r} is not supported; choose one of {QUANTIZE_MODES}")


def quantize_blocks(module: nn.Module, mode: str) -> bool:
    """Weight-only quantizes every nn.Linear and every fused 3-D expert weight inside `module`, in place
    (see the module docstring); returns whether it quantized fused experts."""
    check_mode(mode)
    if mode == "int4" and any(_old_gpu(p.device) for p in module.parameters()):
        raise InvalidRequest("int4 needs a GPU of compute capability 8.0 or newer: use int8")
    # a subclass that computes otherwise (DeepSeek-V4's grouped output projection) stays in the span's dtype
    linears = [
        m for m in module.modules() if isinstance(m, nn.Linear) and type(m).forward is nn.Linear.forward
    ]
    for linear in linears:
        config = _config(mode, linear)
        if config is None:
            continue
        if mode == "int4":
            linear.weight = nn.Parameter(linear.weight.detach().to(INT4_DTYPE), requires_grad=False)
        _torchao().quantize_(linear, config)
        if mode == "int4":
            linear.__class__ = Int4Linear
        elif linear.weight.device.type == "cpu" and linear.in_features % CPU_INT8_IN_MULTIPLE == 0:
            Int8Linear.adopt(linear)
    return quantize_fused_experts(module, mode)


def stored_in_four_bits(module: nn.Module, group: int = GROUP_SIZE, rows: int = 64) -> bool:
    """Whether the first linear layer of `module` (its first `rows` rows) holds weights stored on a 4-bit
    grid: every group of `group` input features at one of 16 evenly spaced levels from its minimum to its
    maximum, as a Q4_0 / Q4_1 GGUF stores them. int4's groups keep that grid; int8's rows do not."""
    linear = next((m for m in module.modules() if isinstance(m, nn.Linear)), None)
    if linear is None or linear.in_features % group:
        return False
    groups = linear.weight.detach()[:rows].float().reshape(-1, group)
    low = groups.amin(1, keepdim=True)
    step = (groups.amax(1, keepdim=True) - low) / 15
    levels = (groups - low) / step.clamp_min(torch.finfo(torch.float32).tiny)
    return bool((step > 0).any()) and float((levels - levels.round()).abs().max()) < GRID_TOLERANCE


def warn_if_int8_loses_grid(block: nn.Module, blocks: str) -> None:
    """Before int8 replaces a span's weights: say so when they were stored in 4 bits (int4 keeps them)."""
    if stored_in_four_bits(block):
        logger.warning(
            "Blocks %s were stored in 4 bits (groups of 32 on 16 levels, as a Q4 GGUF stores them): int8 "
            "moves them onto a grid of its own and agrees with them less than --quantize int4 (which keeps "
            "their grid) does; use int4, or no --quantize",
            blocks,
        )


def quantize_fused_experts(module: nn.Module, mode: str = "int8") -> bool:
    """MoE experts stored as fused 3-D parameters [experts, out, in] (Mixtral's, Qwen3-MoE's, DeepSeek's
    `gate_up_proj` and `down_proj`) become torchao tensors: int4 on a GPU where the span computes in
    bfloat16 (torchao's tile-packed int4 packs and indexes 3-D weights expert by expert), int8 with per-row
    scales otherwise (torchao's CPU int4 tensor takes 2-D weights only: "Expecting 2D tensor on CPU",
    torchao 0.18; its CUDA kernels take bfloat16 activations). Their experts module then runs transformers'
    "eager" experts implementation, which indexes one expert and calls `F.linear` on it (torchao's
    tensors serve that; the grouped-matmul implementation needs ops they lack). Experts stored transposed
    ([experts, in, out], gpt-oss) stay at full precision. Returns whether any were quantized: torchao's
    tensors cannot be indexed under `torch.inference_mode` (it cannot correct the alias's version
    counter), so such a span computes under `torch.no_grad` (Span.computing)."""
    owners = {}
    for owner, sub in module.named_modules():
        if getattr(sub, "is_transposed", False) or isinstance(sub, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
            continue  # gpt-oss's transposed experts; the 3-D weights of convolutions (Mamba, Gated DeltaNet)
        for name, param in sub.named_parameters(recurse=False):
            if param.dim() == 3 and type(param.data) is torch.Tensor and param.is_floating_point():
                owners[f"{owner}.{name}" if owner else name] = (sub, param)
    if not owners:
        return False
    ao = _torchao()
    configs = {name: _experts_config(mode, param) for name, (_, param) in owners.items()}
    ao.quantize_(module, ao.FqnToConfig(configs), filter_fn=None)
    for experts, _ in owners.values():
        if hasattr(getattr(experts, "config", None), "_experts_implementation"):
            experts.config._experts_implementation = "eager"  # the span's own copy of the config
    return True


def _experts_config(mode: str, weight: torch.Tensor):
    """int4 groups for fused experts on a GPU computing in bfloat16, int8 rows otherwise."""
    ao = _torchao()
    cuda_bf16 = weight.device.type == "cuda" and weight.dtype == INT4_DTYPE
    if mode == "int4" and cuda_bf16 and weight.shape[-1] % GROUP_SIZE == 0:
        return ao.Int4WeightOnlyConfig(
            group_size=GROUP_SIZE, int4_packing_format="tile_packed_to_4d", set_inductor_config=False
        )
    return ao.Int8WeightOnlyConfig(set_inductor_config=False)


def _old_gpu(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 0)


def _torchao():
    """torchao.quantization, imported on first use (about 2 s). Its import logs warnings that matter
    nothing here: it could not load CUDA-only kernels (mxfp8, cutlass sm90a) on a CPU torch, and
    torch's pytree deprecates how it registers enums; they are kept out of the server's log."""
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [log.level for log in loggers]
    for log in loggers:
        log.setLevel(logging.ERROR)
    try:
        import torchao.prototype.quantization.int4
        import torchao.quantization
    finally:
        for log, level in zip(loggers, levels, strict=True):
            log.setLevel(level)
    return torchao.quantization


def _config(mode: str, linear: nn.Linear):
    """The torchao config for one linear layer, or None to leave it at full precision."""
    ao = _torchao()
    if mode == "int8":
        return ao.Int8WeightOnlyConfig(set_inductor_config=False)  # no global torch._inductor changes
    if linear.in_features % GROUP_SIZE:
        return None
    group = GROUP_SIZE
    if linear.weight.device.type == "cuda":
        return ao.Int4WeightOnlyConfig(
            group_size=group, int4_packing_format="tile_packed_to_4d", set_inductor_config=False
        )
    if linear.out_features % CPU_INT4_OUT_MULTIPLE != 0:
        return None
    from torchao.prototype.quantization.int4 import PrototypeInt4WeightOnlyConfig

    return PrototypeInt4WeightOnlyConfig(group_size=group, set_inductor_config=False)


class _Int8LinearFunction(torch.autograd.Function):
    """x @ (qweight * scales).T by torch's CPU kernel on bfloat16 activations; differentiable wrt x."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(qweight, scales)
        rows = x.reshape(-1, x.shape[-1]).to(INT8_CPU_DTYPE)
        out = torch.ops.aten._weight_int8pack_mm(rows, qweight, scales)
        return out.view(*x.shape[:-1], -1).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        qweight, scales = ctx.saved_tensors
        weight = qweight.to(grad.dtype) * scales[:, None].to(grad.dtype)  # [out, in], only while it runs
        return grad @ weight, None, None


class Int8Linear(nn.Linear):
    """An int8 linear layer on CPU: torchao chooses the per-row scales; torch's `_weight_int8pack_mm`
    multiplies without rebuilding a float copy of the weight (torchao's own int8 path does, on every call:
    8x slower than float32 on Llama-3.2-1B's layers here). Its kernel is fast on bfloat16 activations
    only (2.7 vs 3.8 ms float32 dense for one token through 8192x2048; 24 ms with float32 activations),
    so activations are cast to bfloat16 around it."""

    @classmethod
    def adopt(cls, linear: nn.Linear) -> None:
        quantized = linear.weight.data  # torchao's Int8Tensor: qdata [out, in] int8, scale [out, 1]
        linear.weight = nn.Parameter(quantized.qdata.contiguous(), requires_grad=False)
        linear.register_buffer("scales", quantized.scale.reshape(-1).to(INT8_CPU_DTYPE).contiguous())
        linear.__class__ = cls

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = _Int8LinearFunction.apply(x, self.weight, self.scales)
        return out if self.bias is None else out + self.bias.to(out.dtype)


class _Int4LinearFunction(torch.autograd.Function):
    """F.linear with a frozen int4 weight, differentiable with respect to its input."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.weight = weight  # frozen: nothing of the input is saved
        return nn.functional.linear(x.to(weight.dtype), weight).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        weight = ctx.weight
        eye = torch.eye(weight.shape[1], dtype=weight.dtype, device=grad.device)
        weight_t = nn.functional.linear(eye, weight).to(grad.dtype)  # [in, out], as the kernel sees it
        return grad @ weight_t.t(), None


class Int4Linear(nn.Linear):
    """An nn.Linear whose weight torchao packed in int4; its forward supports backward to the input."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = _Int4LinearFunction.apply(x, self.weight)
        return out if self.bias is None else out + self.bias


def weight_bytes(module: nn.Module) -> int:
    """Bytes of the module's parameters and buffers as stored (inner tensors of torchao subclasses)."""
    tensors = list(module.parameters()) + list(module.buffers())
    return sum(_tensor_bytes(t) for t in tensors)


def _tensor_bytes(tensor: torch.Tensor) -> int:
    flatten = getattr(tensor, "__tensor_flatten__", None)
    if flatten is None:
        return tensor.numel() * tensor.element_size()
    names, _ = flatten()
    return sum(_tensor_bytes(getattr(tensor, name)) for name in names)


def precision_name(dtype: torch.dtype, mode: str | None) -> str:
    """The precision a span serves in: the mode when quantized, else its dtype ("bfloat16", ...)."""
    if mode is not None:
        check_mode(mode)
        return mode
    return str(dtype).removeprefix("torch.")
