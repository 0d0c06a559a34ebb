"""One transformer block of the Llama family (Llama, Mistral, Qwen2).

Parameter names match the Hugging Face checkpoints (`self_attn.q_proj.weight`, `mlp.gate_proj.weight`,
...) so a block's state dict loads straight from safetensors. The block only computes; where keys and
values are kept is the attention context's business (models/attention.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from corolla.models.attention import AttentionContext
from corolla.models.config import ModelConfig
from corolla.models.rotary import apply_rotary

_ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # normalise in float32 whatever the activation dtype, as the reference implementation does
        dtype = hidden.dtype
        hidden = hidden.to(torch.float32)
        variance = hidden.pow(2).mean(-1, keepdim=True)
        hidden = hidden * torch.rsqrt(variance + self.eps)
        return self.weight * hidden.to(dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(config.hidden_size, heads * head_dim, bias=config.qkv_bias)
        self.k_proj = nn.Linear(config.hidden_size, kv_heads * head_dim, bias=config.qkv_bias)
        self.v_proj = nn.Linear(config.hidden_size, kv_heads * head_dim, bias=config.qkv_bias)
        self.o_proj = nn.Linear(heads * head_dim, config.hidden_size, bias=config.o_bias)

    def forward(
        self,
        hidden: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor],
        context: AttentionContext,
        layer: int,
        window: int | None,
    ) -> torch.Tensor:
        batch, length, _ = hidden.shape
        q = self.q_proj(hidden).view(batch, length, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden).view(batch, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden).view(batch, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = rotary
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)  # [B, heads, T, d], [B, kv_heads, T, d]
        out = context.attend(layer, q, k, v, window)  # [B, heads, T, d]
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)
        self.act = _ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nn.Module):
    """Pre-norm attention + gated MLP, each with a residual connection."""

    def __init__(self, config: ModelConfig, layer_index: int):
        super().__init__()
        self.window = config.sliding_windows[layer_index] if config.sliding_windows else None
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self,
        hidden: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor],
        context: AttentionContext,
        layer: int,
    ) -> torch.Tensor:
        """hidden: [B, T, hidden]; `layer` indexes this block inside the context's cache."""
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), rotary, context, layer, self.window)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))
