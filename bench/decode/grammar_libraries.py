"""Grammar libraries for constrained decoding, per token: the time to compute the mask of allowed tokens.

Walks a 232-token JSON answer of SmolLM2's tokenizer (49,152 tokens) through each installed library,
under a JSON schema and under "any JSON object", computing the mask before every token: three passes,
the first (cold caches) and the last reported. corolla uses llguidance (a dependency); xgrammar and
outlines-core are measured when installed (`pip install xgrammar outlines-core`), else reported missing.

    python -m bench.decode.grammar_libraries
"""

from __future__ import annotations

import json
import statistics
import time

import torch

from bench.lib.env import parser
from bench.lib.stamp import report

VOCAB = 49152
ANSWER = {"city": "Paris", "days": [  # keys in the schema's order, as the libraries generate them
    {"date": f"2026-12-0{i}", "high": 12.5 + i, "low": 3, "summary": "cloudy with a chance of rain"}
    for i in range(1, 6)], "units": "metric", "ok": True}  # fmt: skip
DAY = {"type": "object", "required": ["date", "high", "low", "summary"], "properties": {
    "date": {"type": "string"}, "high": {"type": "number"}, "low": {"type": "number"},
    "summary": {"type": "string"}}}  # fmt: skip
SCHEMA = {"type": "object", "required": ["city", "days", "units", "ok"], "properties": {
    "city": {"type": "string"}, "days": {"type": "array", "items": DAY},
    "units": {"enum": ["metric", "imperial"]}, "ok": {"type": "boolean"}}}  # fmt: skip


def walk(reset, mask, consume, tokens: list[int]) -> dict:
    passes = []
    for _ in range(3):
        reset()
        times = []
        for token in tokens:
            started = time.perf_counter()
            mask()
            times.append(time.perf_counter() - started)
            if not consume(token):
                raise RuntimeError(f"the library refused token {token} of a valid answer")
        passes.append(statistics.mean(times))
    return {"cold_us_per_token": round(1e6 * passes[0], 2), "warm_us_per_token": round(1e6 * passes[-1], 2)}


def llguidance_(tokenizer, tokens: list[int]) -> dict:
    import llguidance
    import llguidance.hf

    started = time.perf_counter()
    lltokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=VOCAB)
    result = {"tokenizer_s": round(time.perf_counter() - started, 3)}
    bits = torch.zeros((VOCAB + 31) // 32, dtype=torch.int32)
    for name, schema in (("schema", SCHEMA), ("any_object", {"type": "object"})):
        matcher = llguidance.LLMatcher(lltokenizer, llguidance.LLMatcher.grammar_from_json_schema(schema))
        mask = lambda m=matcher: m.unsafe_compute_mask_ptr(bits.data_ptr(), bits.numel() * 4)  # noqa: E731
        result[name] = walk(matcher.reset, mask, matcher.consume_token, tokens)
    return result


def xgrammar_(tokenizer, tokens: list[int]) -> dict:
    import xgrammar

    started = time.perf_counter()
    compiler = xgrammar.GrammarCompiler(xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=VOCAB))
    result = {"tokenizer_s": round(time.perf_counter() - started, 3)}
    bits = xgrammar.allocate_token_bitmask(1, VOCAB)
    grammars = {"schema": compiler.compile_json_schema(json.dumps(SCHEMA)),
                "any_object": compiler.compile_builtin_json_grammar()}  # fmt: skip
    for name, grammar in grammars.items():
        matcher = xgrammar.GrammarMatcher(grammar)
        result[name] = walk(matcher.reset, lambda m=matcher: m.fill_next_token_bitmask(bits, 0),
                            matcher.accept_token, tokens)  # fmt: skip
    return result


def outlines_core_(tokenizer, tokens: list[int]) -> dict:
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    eos = tokenizer.eos_token_id
    pieces: dict[str, list[int]] = {}
    for token in range(len(tokenizer)):
        if token != eos:
            pieces.setdefault(tokenizer.convert_ids_to_tokens(token), []).append(token)
    guide = Guide(Index(build_regex_from_schema(json.dumps(SCHEMA)), Vocabulary(eos, pieces)))
    return {"schema": walk(lambda: None, guide.get_tokens, lambda t: guide.advance(t) is not None, tokens)}


def main() -> None:
    parser(__doc__).parse_args()
    from transformers import AutoTokenizer

    from corolla.models.source import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model("smollm2").path)
    tokens = tokenizer(json.dumps(ANSWER), add_special_tokens=False).input_ids
    results = {"answer_tokens": len(tokens), "vocab": VOCAB}
    for name, measure in (
        ("llguidance", llguidance_),
        ("xgrammar", xgrammar_),
        ("outlines_core", outlines_core_),
    ):
        try:
            results[name] = measure(tokenizer, tokens)
        except ImportError as e:
            results[name] = f"not installed ({e.name})"
        except Exception as e:  # a library that cannot walk the answer is reported, not skipped
            results[name] = f"failed: {type(e).__name__}: {e}"
    report(__file__, results)


if __name__ == "__main__":
    main()
