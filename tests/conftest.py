"""Tiny random-weight models of each family, written to a temp dir by transformers."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

TINY = dict(
    vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
)

FAMILIES = {
    "llama": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(attention_bias=True, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    ),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, dict(tie_word_embeddings=True)),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(head_dim=24)),
}


def make_tiny(family: str, path, seed: int = 0, **overrides):
    """Save a random `family` model under `path`; return the transformers model (fp32, eval)."""
    cfg_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(seed)
    cfg = cfg_cls(**{**TINY, **extra, **overrides})
    model = model_cls(cfg).eval()
    with torch.no_grad():  # random biases and norm weights, so their handling is tested too
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.normal_(0.0 if name.endswith("bias") else 1.0, 0.2)
    model.save_pretrained(path)
    return model


@pytest.fixture(params=sorted(FAMILIES))
def tiny(request, tmp_path):
    """(family, path, transformers model) for each family."""
    hf = make_tiny(request.param, tmp_path)
    return request.param, tmp_path, hf
