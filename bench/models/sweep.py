"""Every causal LM transformers defines, on a tiny config: served exactly, refused in one line, or a bug.

For each model type that transformers maps to a causal LM (or `--types`), builds a tiny config from the
type's own defaults (4 layers, hidden 64, 4 heads, the common fields it has set small; a config with
`layer_types` keeps one of each kind), runs transformers' own model on 7 tokens, saves it, and runs the
same tokens through corolla: a head and two spans (blocks 0:2 and 2:end, loaded as a server loads them),
comparing the logits. Each type ends as one of: `exact` (logits within 1e-3 of their scale), `refused`
(corolla's own error, one line), `mismatch` or `crash` (a bug: other logits, or an error from inside
corolla), `config` (the tiny config is not valid for transformers itself: the sweep's limit, not
corolla's) or `timeout`. Found two silently wrong families and five crashes the day it was written (see
docs/architecture.md, "What the decoder's own forward decides"). JSON on stdout: counts, the bugs, and
every type's result.

    python -m bench.models.sweep [--types llama lara_mini ...] [--timeout 120]
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import signal
import tempfile
import traceback
from pathlib import Path

import torch
import transformers
from transformers import CONFIG_MAPPING, AutoConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from bench.lib.env import parser
from bench.lib.stamp import report
from corolla.errors import CorollaError
from corolla.models.head import ModelHead
from corolla.models.lm_class import lm_class
from corolla.models.span import Span

TINY = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    initializer_range=0.3,
    moe_intermediate_size=32,
    num_experts=4,
    n_routed_experts=4,
    num_local_experts=4,
    num_experts_per_tok=2,
    kv_lora_rank=16,
    q_lora_rank=32,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
)
LAYERS = 4


class _Timeout(Exception):
    pass


def tiny_config(model_type: str):
    """The type's defaults with the common fields it has set small, and 4 layers of its kinds."""
    base = AutoConfig.for_model(model_type)
    text = base.get_text_config()
    fields = {name: value for name, value in TINY.items() if hasattr(text, name)}
    kinds = list(dict.fromkeys(getattr(text, "layer_types", None) or ()))
    if kinds:
        fields["layer_types"] = (kinds * LAYERS)[:LAYERS]
    fields["num_hidden_layers"] = LAYERS
    if text is base:
        return AutoConfig.for_model(model_type, **fields)
    return AutoConfig.for_model(model_type, text_config=fields)


def reference_logits(model_type: str, folder: Path, ids: torch.Tensor) -> torch.Tensor:
    """transformers' own logits of a tiny model of the type, saved to `folder`."""
    torch.manual_seed(0)
    config = tiny_config(model_type)
    model = lm_class(config.get_text_config(), config)._from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(ids).logits
    model.save_pretrained(folder)
    return logits


def corolla_logits(folder: Path, ids: torch.Tensor) -> torch.Tensor:
    head = ModelHead.load(folder)
    blocks = head.config.num_hidden_layers  # blocks (LongCat-Flash's: layers of two attention sublayers)
    first, second = Span.load(folder, 0, 2), Span.load(folder, 2, blocks)
    with torch.no_grad():
        return head.logits(second(first(head.embed(ids))))


def where(error: BaseException) -> str:
    """The innermost frame of corolla's own code the error passed, or its innermost frame."""
    frames = traceback.extract_tb(error.__traceback__)
    ours = [f for f in frames if "/corolla/" in f.filename and "site-packages" not in f.filename]
    frame = (ours or frames)[-1]
    return f"{Path(frame.filename).name}:{frame.lineno}"


def sweep_one(model_type: str) -> dict:
    ids = torch.randint(3, 300, (1, 7), generator=torch.Generator().manual_seed(1))
    with tempfile.TemporaryDirectory() as folder:
        try:
            expected = reference_logits(model_type, Path(folder), ids)
        except _Timeout:
            raise
        except Exception as e:  # the sweep's tiny config, not corolla
            return {"result": "config", "error": f"{type(e).__name__}: {str(e)[:160]}"}
        try:
            logits = corolla_logits(Path(folder), ids)
        except CorollaError as e:
            return {"result": "refused", "reason": str(e), "one_line": "\n" not in str(e)}
        except _Timeout:
            raise
        except Exception as e:
            return {"result": "crash", "at": where(e), "error": f"{type(e).__name__}: {str(e)[:160]}"}
    error = float((logits - expected).abs().max())
    scale = float(expected.abs().max())
    exact = error <= 1e-3 * max(scale, 1.0)
    return {"result": "exact" if exact else "mismatch", "max_error": error, "logit_scale": round(scale, 2)}


def _on_alarm(*_):
    raise _Timeout


def main() -> None:
    flags = parser(__doc__)
    every = sorted(set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) & set(CONFIG_MAPPING))
    flags.add_argument("--types", nargs="+", default=every, help="model types (default: every causal LM)")
    flags.add_argument("--timeout", type=int, default=120, help="seconds per type")
    args = flags.parse_args()
    signal.signal(signal.SIGALRM, _on_alarm)
    results = {}
    for model_type in args.types:
        signal.alarm(args.timeout)
        try:
            results[model_type] = sweep_one(model_type)
        except _Timeout:
            results[model_type] = {"result": "timeout"}
        finally:
            signal.alarm(0)
    counts: dict[str, int] = {}
    for outcome in results.values():
        counts[outcome["result"]] = counts.get(outcome["result"], 0) + 1
    bugs = [
        t for t, r in results.items() if r["result"] in ("crash", "mismatch") or not r.get("one_line", True)
    ]
    report(
        __file__,
        {"transformers": transformers.__version__, "counts": counts, "bugs": bugs, "results": results},
        variant="" if args.types == every else "some",
    )


if __name__ == "__main__":
    main()
