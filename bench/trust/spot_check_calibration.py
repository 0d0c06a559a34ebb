"""How far honest replicas' outputs drift from each other, and how far faulty servers' do: the spot-check
tolerance is set between the two (client/checks/compare.py).

SmolLM2-135M-Instruct's spans 0:10, 10:20 and 20:30, loaded here in every precision a server can run
(float32, bfloat16 and float16 computation; int8 and int4 weights), each run over the same inputs: the
float32 model's hidden states entering the span for the 8 benchmark prompts (bench/lib/prompts.py, chat
template applied, every position). For every pair of precisions, the per-position deviation
`|a - b| / |b|` (L2 over the hidden size; what the client compares) is summarised (median, p99, max);
then each `--simulate-faulty` mode (server/faults.py) on float32 against honest float32; the pairs once
more for the span of all 30 blocks alone (a server of every block drifts the most). The same for backward
passes (gradients wrt the inputs for fixed random output gradients, compared per prompt as one vector, as
spot checks of training compare them against GRADIENT_TOLERANCE). JSON to stdout.

    python -m bench.trust.spot_check_calibration
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import torch

from bench.lib.env import parser
from bench.lib.prompts import benchmark_prompts
from bench.lib.stamp import report
from corolla.client.checks.compare import deviation
from corolla.models.head import ModelHead
from corolla.models.source import resolve_model
from corolla.models.span import Span
from corolla.server.faults import Fault

SPANS = ((0, 10), (10, 20), (20, 30), (0, 30))  # three servers' spans, and one server of every block
PRECISIONS = {
    "float32": (torch.float32, None),
    "bfloat16": (torch.bfloat16, None),
    "float16": (torch.float16, None),
    "int8": (torch.float32, "int8"),
    "int4": (torch.float32, "int4"),
}
FAULTS = ("noise:0.1", "noise:0.03", "skip-layer", "wrong-weights", "garbage-after:0")


def span_inputs(folder: Path) -> dict[tuple[int, int], list[torch.Tensor]]:
    """Per span, the float32 model's hidden states entering it, one [1, T, H] tensor per prompt."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    head = ModelHead.load(folder)
    spans = [Span.load(folder, *blocks) for blocks in SPANS[:3]]
    inputs = {blocks: [] for blocks in SPANS}
    with torch.no_grad():
        for _, ids in benchmark_prompts(tokenizer):
            hidden = head.embed(torch.tensor([ids]))
            inputs[(0, 30)].append(hidden)
            for span in spans:
                inputs[(span.start, span.end)].append(hidden)
                hidden = span(hidden)
    return inputs


def run(span: Span, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    with torch.no_grad():
        return [span(x.to(span.dtype)).float() for x in inputs]


def gradients(span: Span, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per prompt, the gradient wrt the span's inputs for fixed random output gradients (a backward pass
    as a server runs it), as one vector [1, 1, T * H]: spot checks compare a backward's result whole."""
    results = []
    for index, x in enumerate(inputs):
        x = x.clone().requires_grad_(True)
        outputs = span(x.to(span.dtype)).float()
        generator = torch.Generator().manual_seed(index)
        outputs.backward(torch.randn(outputs.shape, generator=generator))
        results.append(x.grad.reshape(1, 1, -1))
    return results


def summary(values: torch.Tensor) -> dict:
    return {
        "median": round(values.median().item(), 5),
        "p99": round(values.quantile(0.99).item(), 5),
        "max": round(values.max().item(), 5),
    }


def deviations(a: list[torch.Tensor], b: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([deviation(x, y).flatten() for x, y in zip(a, b, strict=True)])


def measure_gradients(
    folder: Path, blocks: tuple[int, int], inputs: list, honest: dict, faulty: dict
) -> None:
    """Backward passes of the span in every precision, and with every fault, against float32."""
    grads = {}
    for name, (dtype, quantize) in PRECISIONS.items():
        try:
            grads[name] = gradients(Span.load(folder, *blocks, dtype, quantize), inputs)
        except (RuntimeError, NotImplementedError) as e:  # a precision without backward support
            print(f"no gradients in {name}: {e}", file=sys.stderr)
    for a, b in itertools.combinations(grads, 2):
        honest.setdefault(f"{a} vs {b}", []).append(deviations(grads[a], grads[b]))
    for mode in FAULTS:
        span = Span.load(folder, *blocks)
        Fault.parse(mode).apply(span.blocks)
        faulty.setdefault(mode, []).append(deviations(gradients(span, inputs), grads["float32"]))


def main() -> None:
    parser(__doc__).parse_args()
    torch.manual_seed(0)
    folder = Path(resolve_model("smollm2").path)
    inputs = span_inputs(folder)
    result = {"model": "SmolLM2-135M-Instruct", "positions": sum(x.shape[1] for x in inputs[SPANS[0]])}
    honest, faulty, grad_honest, grad_faulty = {}, {}, {}, {}
    for blocks in SPANS:
        outputs = {
            name: run(Span.load(folder, *blocks, dtype, quantize), inputs[blocks])
            for name, (dtype, quantize) in PRECISIONS.items()
        }
        for a, b in itertools.combinations(PRECISIONS, 2):
            honest.setdefault(f"{a} vs {b}", []).append(deviations(outputs[a], outputs[b]))
        for mode in FAULTS:
            span = Span.load(folder, *blocks)
            Fault.parse(mode).apply(span.blocks)
            faulty.setdefault(mode, []).append(deviations(run(span, inputs[blocks]), outputs["float32"]))
        measure_gradients(folder, blocks, inputs[blocks], grad_honest, grad_faulty)
        print(f"spans {blocks} done", file=sys.stderr, flush=True)
    result["honest_pairs"] = {pair: summary(torch.cat(values)) for pair, values in honest.items()}
    result["honest_pairs_blocks_0_30"] = {pair: summary(values[-1]) for pair, values in honest.items()}
    result["faults_vs_float32"] = {mode: summary(torch.cat(values)) for mode, values in faulty.items()}
    result["faults_min"] = {mode: round(torch.cat(v).min().item(), 5) for mode, v in faulty.items()}
    result["honest_max"] = max(s["max"] for s in result["honest_pairs"].values())
    result["gradients_honest_pairs"] = {pair: summary(torch.cat(v)) for pair, v in grad_honest.items()}
    result["gradients_faults_vs_float32"] = {mode: summary(torch.cat(v)) for mode, v in grad_faulty.items()}
    result["gradients_honest_pairs_blocks_0_30"] = {pair: summary(v[-1]) for pair, v in grad_honest.items()}
    result["gradients_honest_max"] = max(s["max"] for s in result["gradients_honest_pairs"].values())
    report(__file__, result)


if __name__ == "__main__":
    main()
