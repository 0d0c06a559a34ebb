"""The GPU check in one command, on a GPU machine that reaches no registry: installs the wheels that
`python -m bench.gpu.prepare` put in `.gpu/wheels` over the machine's own CUDA torch (into `.gpu/site`,
nothing system-wide), then runs, each in its own process with a time limit, and prints one JSON:

- `pytest -m gpu`: the CUDA tests (quantized layers, a real swarm on the GPU against transformers there);
- a random-weight bfloat16 checkpoint of Llama-3.1-8B's shapes (SmolLM2's tokenizer and vocabulary:
  `.gpu/tokenizer`), built on the GPU, then bench/decode/latency.py on it: 2 servers on the one GPU, one
  session and 16 at once against local transformers on the same GPU; the same with `--quantize int4`;
- bench/models/models.py `--device cuda` over this year's families (tiny checkpoints).

A step that fails or runs out of time is reported with the end of its output and the others still run.
Without CUDA it says so and stops. `--steps` picks steps; the JSON is kept, stamped, in
bench/results/check.json (`--out FILE`: a copy there too, to bring back for docs/benchmarks.md).

    python3 -m bench.gpu.check [--steps pytest latency latency_int4 families] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench.lib.stamp import report

ROOT = Path(__file__).resolve().parents[2]
GPU = ROOT / ".gpu"
CHECKPOINT = Path("/tmp/corolla-gpu-check/llama-3.1-8b-shapes")
FAMILIES = ["llama", "deepseek_v3", "qwen3_5", "gemma4", "llama4"]
# Llama-3.1-8B's shapes; the vocabulary is the tokenizer's (SmolLM2's 49,152 instead of 128,256)
LLAMA_8B = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    rope_parameters=dict(
        rope_type="llama3",
        rope_theta=500000.0,
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    ),
)
LATENCY = ["-m", "bench.decode.latency", "--device", "cuda", "--dtype", "bfloat16", "--servers", "2"]
LATENCY += ["--sessions", "16", "--runs", "1", "--new-tokens", "32", "--server-arg=--max-cache-tokens=65536"]


def environment() -> dict[str, str]:
    """This process's environment with corolla's sources, the installed wheels and the repository (bench,
    tests) first on the path."""
    paths = [str(ROOT / "src"), str(GPU / "site"), str(ROOT), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p), "HF_HUB_OFFLINE": "1"}


def install() -> dict:
    wheels = sorted(str(w) for w in (GPU / "wheels").glob("*.whl"))
    if not wheels:
        return {"error": f"no wheels in {GPU / 'wheels'}: run `make gpu-wheels` where the registries answer"}
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--no-compile"]
    command += ["--no-cache-dir", "--upgrade", "--target", str(GPU / "site"), *wheels]
    return run("install", command, 300, parse=lambda out: {"wheels": len(wheels)})


def run(name: str, command: list[str], limit: float, parse=None) -> dict:
    """One step in its own process: its parsed result (the last JSON object it printed, by default), how
    long it took, or the end of its output where it failed."""
    start = time.monotonic()
    print(f"[gpu-check] {name}: {' '.join(command[:6])} ...", file=sys.stderr, flush=True)
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=limit, env=environment(), cwd=ROOT
        )
    except subprocess.TimeoutExpired as e:
        tail = (e.stderr or b"")[-2000:]
        return {"error": f"over its {limit:.0f} s", "tail": tail.decode(errors="replace") if tail else ""}
    result = {"seconds": round(time.monotonic() - start, 1)}
    if done.returncode != 0:
        return {**result, "error": f"exit {done.returncode}", "tail": (done.stdout + done.stderr)[-3000:]}
    try:
        return {**result, **(parse or last_json)(done.stdout)}
    except ValueError as e:
        return {**result, "error": f"unreadable output: {e}", "tail": done.stdout[-2000:]}


def last_json(text: str) -> dict:
    """The last top-level JSON object in `text` (benches print theirs after their logs)."""
    starts = [m.start() for m in re.finditer(r"(?m)^\{", text)]
    for start in reversed(starts):
        try:
            return json.loads(text[start:])
        except json.JSONDecodeError:
            continue
    raise ValueError("no JSON object")


def pytest_summary(text: str) -> dict:
    counts = {kind: int(n) for n, kind in re.findall(r"(\d+) (passed|failed|skipped|error|errors)", text)}
    return {"tests": counts, "ok": counts.get("passed", 0) > 0 and not counts.get("failed")}


def cuda() -> dict:
    probe = (
        "import json, torch; print(json.dumps({'cuda': torch.cuda.is_available(), 'torch': torch.__version__,"
    )
    probe += " 'device_name': torch.cuda.get_device_name() if torch.cuda.is_available() else ''}))"
    return run("cuda", [sys.executable, "-c", probe], 120)


def make_checkpoint() -> dict:
    """The Llama-3.1-8B-shaped bfloat16 checkpoint (random weights, built on the GPU), with the tokenizer."""
    script = f"""
import json, torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
tokenizer = AutoTokenizer.from_pretrained({str(GPU / "tokenizer")!r})
config = LlamaConfig(**{LLAMA_8B!r}, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                     eos_token_id=tokenizer.eos_token_id)
torch.manual_seed(0)
with torch.device("cuda"):
    model = LlamaForCausalLM._from_config(config, dtype=torch.bfloat16)
model.save_pretrained({str(CHECKPOINT)!r})
tokenizer.save_pretrained({str(CHECKPOINT)!r})
print(json.dumps({{"parameters": sum(p.numel() for p in model.parameters())}}))
"""
    return run("checkpoint", [sys.executable, "-c", script], 240)


PYTEST = ["-m", "pytest", "-m", "gpu", "tests", "-q", "-p", "no:cacheprovider"]
FAMILIES_BENCH = ["-m", "bench.models.models", "--device", "cuda", "--repeats", "1", "--families", *FAMILIES]
# each step's time limit, seconds: all of them fit one 10-minute command on an H100 (estimated, not run yet)
STEPS = {
    "pytest": lambda: run("pytest", [sys.executable, *PYTEST], 240, parse=pytest_summary),
    "latency": lambda: run("latency", [sys.executable, *LATENCY, "--model", str(CHECKPOINT)], 240),
    "latency_int4": lambda: run(
        "latency_int4",
        [sys.executable, *LATENCY, "--model", str(CHECKPOINT), "--server-arg=--quantize=int4"],
        240,
    ),
    "families": lambda: run("families", [sys.executable, *FAMILIES_BENCH], 240),
}


def main() -> None:
    flags = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    flags.add_argument("--steps", nargs="+", choices=list(STEPS), default=list(STEPS))
    flags.add_argument("--out", type=Path, help="also write the JSON here")
    args = flags.parse_args()
    result = {"install": install()}
    result["cuda"] = cuda()
    if not result["cuda"].get("cuda"):
        print(json.dumps(result, indent=2), flush=True)
        sys.exit("gpu-check: no CUDA device here")
    if {"latency", "latency_int4"} & set(args.steps) and not (CHECKPOINT / "config.json").exists():
        result["checkpoint"] = make_checkpoint()
    for step in args.steps:
        result[step] = STEPS[step]()
    kept = report(__file__, result)  # printed, and kept stamped in bench/results/check.json
    if args.out:
        shutil.copy(kept, args.out)


if __name__ == "__main__":
    main()
