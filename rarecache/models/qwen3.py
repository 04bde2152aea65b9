"""Qwen3: the Llama decoder with a per-head RMSNorm on q and k, applied before RoPE."""

from __future__ import annotations

import torch

from .config import ModelConfig
from .llama import Attention, CausalLM, DecoderLayer, RMSNorm


class Qwen3Attention(Attention):
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def qk_norm(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q_norm(q), self.k_norm(k)  # (B, T, H, D): normed over D


class Qwen3DecoderLayer(DecoderLayer):
    attention_cls = Qwen3Attention


class Qwen3ForCausalLM(CausalLM):
    layer_cls = Qwen3DecoderLayer
