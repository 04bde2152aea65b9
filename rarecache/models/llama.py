"""Llama-family decoder (Llama 2/3.x), the base the Qwen variants build on.

The model holds parameters and per-layer pieces only; it never loops over its own
layers with a cache. The engine drives the loop: `DecoderLayer.qkv` gives rotated
q, k, v for a set of tokens at explicit positions, the engine writes k, v into
its cache and attends, and `DecoderLayer.finish` applies o_proj, the residual and
the MLP. Keeping the loop outside is what lets the transfer package overwrite KV
rows between layers. Parameter names are Hugging Face's, so safetensors
checkpoints load without renaming.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .rope import rotate_half


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # float32 statistics, cast back before the weight (as transformers does)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.o_bias)

    def qk_norm(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return q, k  # Qwen3 overrides

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x (B, T, C) normed -> q (B, H, T, D), k and v (B, Hkv, T, D); q and k rotated."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim)  # (B, T, H, D)
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        q, k = self.qk_norm(q, k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, T, D)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        return q, k, v


class DecoderLayer(nn.Module):
    attention_cls = Attention

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = self.attention_cls(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def qkv(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Residual stream h (B, T, C) -> rotated q, k and v for this layer."""
        return self.self_attn.qkv(self.input_layernorm(h), cos, sin)

    def finish(self, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Residual h (B, T, C) and attention output (B, H, T, D) -> the layer's output."""
        B, H, T, D = attn.shape
        h = h + self.self_attn.o_proj(attn.transpose(1, 2).reshape(B, T, H * D))
        return h + self.mlp(self.post_attention_layernorm(h))


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_cls: type[DecoderLayer]):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(layer_cls(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


HEAD_CHUNK = 16384  # vocabulary rows per float32 head product (`CausalLM.logits`)


class CausalLM(nn.Module):
    """Embedding, decoder layers, final norm and LM head, under HF names."""

    layer_cls = DecoderLayer

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.packed_head: nn.Module | None = None
        self.model = Backbone(cfg, self.layer_cls)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    @property
    def layers(self) -> nn.ModuleList:
        return self.model.layers

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(tokens)

    @property
    def head_weight(self) -> torch.Tensor:
        """The LM head's plain (V, C) weight: the embedding when tied."""
        return self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight

    def logits(self, h: torch.Tensor, float32: bool = False) -> torch.Tensor:
        """Final norm and LM head; h (..., C) -> float32 logits (..., V).

        A bfloat16 head rounds every logit to bf16's 8 significant bits (steps of 1/16 near 10, 1/8 near 20),
        so two choices a few hundredths apart score the same. `float32`: the same normed rows and weight,
        their products summed and kept in float32 (the weight upcast HEAD_CHUNK rows at a time, so no
        float32 copy of it is kept)."""
        h = self.model.norm(h)
        if float32 and h.dtype != torch.float32:
            x, w = h.float(), self.head_weight
            return torch.cat([F.linear(x, w[i : i + HEAD_CHUNK].float()) for i in range(0, w.shape[0], HEAD_CHUNK)],
                             -1)
        if self.packed_head is not None:  # models.packed.pack_model
            return self.packed_head(h).float()
        return F.linear(h, self.head_weight).float()
