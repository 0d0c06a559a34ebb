"""Which part of a quantized path costs greedy agreement with fp32: the weights' grid or bfloat16 compute.

SmolLM2-135M-Instruct in process (transformers' model from corolla's converted folder, no swarm, one torch
thread), the blocks' linear layers changed per variant, the embeddings, norms and LM head left in float32.
Greedy agreement with the fp32 model over bench/models/quantize.py's 8 chat prompts x 64 tokens (EOS ignored;
tokens equal position by position: one early flip changes the rest of a row, so it swings widely between
close variants), the same along fp32's own continuations (teacher-forced top-1 agreement and mean KL
divergence from fp32 per token: no compounding), and the decode time per token of the whole local model.

Variants: the shipped paths (`int8`, `int4`: models/quantize.py, bfloat16 kernels); weights rounded to
bfloat16 with float32 compute (`bf16_weights`); float32 weights with every linear's input and output
rounded to bfloat16 (`bf16_linear_io`, what the bfloat16 kernels do to activations); torchao's per-row
int8 run in float32 (`int8_rows_fp32`: its Int8Tensor dequantizes to the activations' dtype); torchao's
asymmetric int8 in groups of 32 (IntxWeightOnlyConfig) in float32 (`int8_g32_fp32`), and the same with
bfloat16 linear inputs and outputs (`int8_g32_bf16_io`); and, simulated (float32 weights holding the
dequantized values: its time means nothing), asymmetric int8 in groups of 32 whose minimum is a float, not
an integer zero point (`int8_g32_fmin_sim`): its grid holds the Q4_1 grid SmolLM2's GGUF was stored in (17
steps of int8 per step of int4), as int4's groups of 32 with float zero points (tinygemm's) do. JSON to
stdout.

    python -m bench.models.quantize_isolation [--variants int8 int8_rows_fp32 ...] [--tokens 64]
"""

from __future__ import annotations

import copy
import sys
import time

import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer

from bench.lib.env import parser
from bench.lib.stamp import report
from bench.models.quantize import CHAT_PROMPTS, NEW_TOKENS
from corolla.cli.generate import encode_prompt
from corolla.models.quantize import _torchao, quantize_blocks
from corolla.models.source import resolve_model


def linears(model: nn.Module) -> list[nn.Linear]:
    return [m for m in model.model.layers.modules() if isinstance(m, nn.Linear)]


def round_io_to_bf16(model: nn.Module) -> None:
    for linear in linears(model):
        linear.register_forward_pre_hook(lambda _, args: (args[0].bfloat16().float(), *args[1:]))
        linear.register_forward_hook(lambda _, __, out: out.bfloat16().float())


def int8_groups_config():
    from torchao.quantization import MappingType, PerGroup

    return _torchao().IntxWeightOnlyConfig(
        weight_dtype=torch.int8, granularity=PerGroup(32), mapping_type=MappingType.ASYMMETRIC
    )


def on_float_min_grid(weight: torch.Tensor, group: int = 32) -> torch.Tensor:
    """255 steps from each group's minimum to its maximum, the minimum kept as a float."""
    groups = weight.reshape(weight.shape[0], -1, group)
    low = groups.amin(2, keepdim=True)
    step = (groups.amax(2, keepdim=True) - low).clamp(min=1e-12) / 255
    return (torch.round((groups - low) / step) * step + low).reshape(weight.shape)


def int8_rows_config():
    return _torchao().Int8WeightOnlyConfig(set_inductor_config=False)


def with_torchao(config, bf16_io: bool = False):
    def apply(model: nn.Module) -> None:
        for linear in linears(model):
            _torchao().quantize_(linear, config())
        if bf16_io:
            round_io_to_bf16(model)

    return apply


def with_weights(change):
    def apply(model: nn.Module) -> None:
        for linear in linears(model):
            linear.weight.data = change(linear.weight.data)

    return apply


BUILDERS = {
    "int8": lambda model: quantize_blocks(model.model.layers, "int8"),
    "int4": lambda model: quantize_blocks(model.model.layers, "int4"),
    "bf16_weights": with_weights(lambda weight: weight.bfloat16().float()),
    "bf16_linear_io": round_io_to_bf16,
    "int8_rows_fp32": with_torchao(int8_rows_config),
    "int8_g32_fp32": with_torchao(int8_groups_config),
    "int8_g32_bf16_io": with_torchao(int8_groups_config, bf16_io=True),
    "int8_g32_fmin_sim": with_weights(on_float_min_grid),
}


def build(base: nn.Module, variant: str) -> nn.Module:
    model = copy.deepcopy(base)
    BUILDERS[variant](model)
    return model.eval()


def greedy(model: nn.Module, prompts: list[torch.Tensor], new: int) -> tuple[list[list[int]], float]:
    """Each prompt's new tokens, and the mean seconds per generated token."""
    outputs, started = [], time.perf_counter()
    with torch.inference_mode():
        for ids in prompts:
            out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
            outputs.append(out[0, ids.shape[1] :].tolist())
    return outputs, (time.perf_counter() - started) / (new * len(prompts))


def fp32_continuations(base: nn.Module, prompts: list[torch.Tensor], reference: list[list[int]]):
    """Each prompt followed by the fp32 model's greedy tokens, where they start, and fp32's logits there."""
    pairs = zip(prompts, reference, strict=True)
    sequences = [torch.cat([ids, torch.tensor([new])], 1) for ids, new in pairs]
    starts = [ids.shape[1] for ids in prompts]
    with torch.inference_mode():
        logits = [base(ids).logits[0, at - 1 : -1].float() for ids, at in zip(sequences, starts, strict=True)]
    return sequences, starts, logits


def teacher_forced(model: nn.Module, sequences: list, starts: list[int], reference: list) -> dict:
    """Next-token choices and distributions along the fp32 model's own continuations (no divergence can
    compound, unlike greedy agreement): top-1 equal to fp32's, and the mean KL(fp32 || variant)."""
    matched = total = 0
    divergence = 0.0
    with torch.inference_mode():
        for ids, start, expected in zip(sequences, starts, reference, strict=True):
            logits = model(ids).logits[0, start - 1 : -1].float()
            matched += int((logits.argmax(-1) == expected.argmax(-1)).sum())
            total += logits.shape[0]
            log_p, log_q = expected.log_softmax(-1), logits.log_softmax(-1)
            divergence += float(nn.functional.kl_div(log_q, log_p, log_target=True, reduction="sum"))
    kl = round(max(divergence / total, 0.0), 5)  # a variant equal to fp32 may sum to -0.0
    return {"teacher_forced_top1_matching_fp32": f"{matched}/{total}", "kl_from_fp32": kl}


def agreement(tokens: list[list[int]], reference: list[list[int]]) -> dict:
    same = [
        [a == b for a, b in zip(ours, theirs, strict=True)]
        for ours, theirs in zip(tokens, reference, strict=True)
    ]
    prefixes = [row.index(False) if False in row else len(row) for row in same]
    matched = sum(map(sum, same))
    return {"tokens_matching_fp32": f"{matched}/{sum(map(len, same))}", "common_prefix_per_prompt": prefixes}


def main() -> None:
    flags = parser(__doc__)
    flags.add_argument("--variants", nargs="+", choices=list(BUILDERS), default=list(BUILDERS))
    flags.add_argument("--tokens", type=int, default=NEW_TOKENS, help="new tokens per prompt")
    args = flags.parse_args()
    torch.set_num_threads(1)
    path = resolve_model("smollm2").path
    tokenizer = AutoTokenizer.from_pretrained(path)
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = [torch.tensor(encode_prompt(tokenizer, p, None, False))[None] for p in CHAT_PROMPTS]
    reference, seconds = greedy(base, prompts, args.tokens)
    sequences, starts, expected = fp32_continuations(base, prompts, reference)
    results: dict = {"fp32": {"ms_per_token": round(seconds * 1e3, 2)}}
    for variant in args.variants:
        model = build(base, variant)
        tokens, seconds = greedy(model, prompts, args.tokens)
        results[variant] = agreement(tokens, reference) | {"ms_per_token": round(seconds * 1e3, 2)}
        results[variant] |= teacher_forced(model, sequences, starts, expected)
        print(variant, results[variant], flush=True, file=sys.stderr)
    report(__file__, results)


if __name__ == "__main__":
    main()
