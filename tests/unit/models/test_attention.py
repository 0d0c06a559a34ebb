"""corolla's attention function: chunked attention (Llama 4) against a mask written out by hand."""

import pytest
import torch

from corolla.models.attention import Scores, causal_attention, masked_attention


def _by_mask(q, k, v, q_start: int, chunk: int, window: int | None = None) -> torch.Tensor:
    q_pos = torch.arange(q_start, q_start + q.shape[2])[:, None]
    k_pos = torch.arange(k.shape[2])[None, :]
    mask = (k_pos <= q_pos) & (k_pos // chunk == q_pos // chunk)
    if window is not None:
        mask &= k_pos > q_pos - window
    return masked_attention(q, k, v, mask, Scores())


@pytest.mark.parametrize(
    ("q_start", "length", "window"),
    [(0, 11, None), (9, 1, None), (8, 1, None), (5, 2, None), (6, 6, None), (9, 3, 2), (4, 7, 3)],
    ids=["prefill", "decode", "chunk-start", "within", "across", "window", "window-across"],
)
def test_chunked_attention_sees_only_its_own_chunk(q_start, length, window):
    generator = torch.Generator().manual_seed(q_start + length)
    q = torch.randn(1, 4, length, 8, generator=generator)
    k = torch.randn(1, 2, q_start + length, 8, generator=generator)
    v = torch.randn(1, 2, q_start + length, 8, generator=generator)
    got = causal_attention(q, k, v, q_start, Scores(window=window, chunk=4))
    torch.testing.assert_close(got, _by_mask(q, k, v, q_start, 4, window), atol=1e-6, rtol=0)
    earlier = q_start // 4 * 4  # no query sees the keys before the first query's chunk
    k[:, :, :earlier] = 0
    v[:, :, :earlier] = 0
    torch.testing.assert_close(causal_attention(q, k, v, q_start, Scores(window=window, chunk=4)), got)
