"""What DeepSeek-V4's attention keeps per session, from its config (models/layer_caches.py keeps it):
read by a span's charges, by placement's budgets and by the benchmark that checks both against
transformers' own cache."""

from __future__ import annotations

from typing import Any

COMPRESSED_TYPES = ("compressed_sparse_attention", "heavily_compressed_attention")


def held_family(hf: Any) -> bool:
    """Whether a family's attention keeps transformers' own cache layer objects (DeepSeek-V4)."""
    return any(kind in COMPRESSED_TYPES for kind in getattr(hf, "layer_types", None) or ())


def held_bytes(hf: Any, layer: int, itemsize: int) -> tuple[int, float]:
    """(bytes one sequence keeps whatever its length, bytes a token adds) in a DeepSeek-V4 layer: the
    window's keys (a sliding layer also keeps them as values), the compressor's buffer of up to m - 1
    tokens (its projection and gate), CSA's overlap (the last window's first series, projection and gate)
    and a compressed entry every m tokens; a CSA layer's indexer keeps the same at index_head_dim."""
    kind = hf.layer_types[layer]
    window = (hf.sliding_window - 1) * hf.head_dim
    if kind not in COMPRESSED_TYPES:
        return 2 * window * itemsize, 0.0
    rate = hf.compress_rates[kind]
    dims = [hf.head_dim] + ([hf.index_head_dim] if kind == "compressed_sparse_attention" else [])
    overlapping = kind == "compressed_sparse_attention"  # CSA's windows overlap: 2 series a token
    buffers = sum((rate - 1) * 2 * (2 if overlapping else 1) * d for d in dims)
    overlap = sum(2 * rate * d for d in dims) if overlapping else 0
    return (window + buffers + overlap) * itemsize, sum(dims) * itemsize / rate


def compressed_bytes_per_token(hf: Any, itemsize: int, layers: range | None = None) -> float:
    """The bytes a token adds to a session's compressed entries over `layers` (default: the model's)."""
    return sum(held_bytes(hf, layer, itemsize)[1] for layer in layers or range(hf.num_hidden_layers))
