"""Real model configs with random weights, for timing at the papers' shapes.

Timing does not depend on weight values, so these stand in for checkpoints that
cannot be downloaded here. Nothing is fetched: the configs are written out below.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..engine.runner import Runner
from ..errors import RarecacheError
from ..models.config import ModelConfig
from ..models.loader import build_model
from ..transfer.sidefit import SideFit
from ..transfer.mapper import MapInfo, Mapper

_LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
CONFIGS: dict[str, dict] = {
    "qwen3-0.6b": dict(model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       rope_theta=1e6, tie_word_embeddings=True, max_position_embeddings=40960),
    "qwen3-14b": dict(model_type="qwen3", vocab_size=151936, hidden_size=5120, intermediate_size=17408,
                      num_hidden_layers=40, num_attention_heads=40, num_key_value_heads=8, head_dim=128,
                      rope_theta=1e6, tie_word_embeddings=False, max_position_embeddings=40960),
    "llama-3.1-8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                         rope_parameters=_LLAMA3_ROPE, max_position_embeddings=131072),
    "llama-3.3-70b": dict(model_type="llama", vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                          num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                          rope_parameters=_LLAMA3_ROPE, max_position_embeddings=131072),
    # toys of the same families, for smoke runs of the GPU bench on a CPU (scripts/gpu.sh SMOKE=1) and tests
    "toy-source": dict(model_type="qwen3", vocab_size=512, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       rope_theta=1e6, tie_word_embeddings=True, max_position_embeddings=4096),
    "toy-target": dict(model_type="qwen3", vocab_size=512, hidden_size=96, intermediate_size=192,
                       num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2, head_dim=16,
                       rope_theta=1e6, tie_word_embeddings=False, max_position_embeddings=4096),
}


def random_runner(name: str, dtype: torch.dtype, device: str, max_layers: int | None = None) -> Runner:
    return textless(Runner(random_model(name, dtype, device, max_layers)))


def textless(runner: Runner) -> Runner:
    """A runner of random weights reads random tokens: no token breaks a line, so the selectors that recompute
    whole lines cut their pieces by length alone (what they cost is what a bench times)."""
    runner.break_flags = torch.zeros(runner.config.vocab_size, dtype=torch.uint8, device=runner.device)
    return runner


def random_model(name: str, dtype: torch.dtype, device: str, max_layers: int | None = None) -> torch.nn.Module:
    """Our model of shape `name` with random weights (not yet packed: `Runner` packs where it pays)."""
    if name not in CONFIGS:
        raise RarecacheError(f"unknown shape {name!r}; known: {', '.join(CONFIGS)}")
    cfg = ModelConfig.from_dict(CONFIGS[name])
    if max_layers:
        cfg = replace(cfg, num_layers=min(cfg.num_layers, max_layers))
    with torch.device("meta"):
        model = build_model(cfg)
    return random_weights(model, dtype, device)


def random_weights(model: torch.nn.Module, dtype: torch.dtype, device: str) -> torch.nn.Module:
    """A model built on the meta device, given memory on `device` in `dtype` and random weights (N(0, 0.02),
    norms 1): frozen, in eval mode. Buffers that `to_empty` leaves empty are the caller's to rebuild."""
    model = model.to_empty(device=device).to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
    return model.eval().requires_grad_(False)


def random_mapper(source: Runner, target: Runner, k: int = 8, rank: int = 128) -> Mapper:
    """A map of the right shapes (K source layers per target layer) with random weights."""
    ls, lt, ds, dt = source.num_layers, target.num_layers, source.config.kv_dim, target.config.kv_dim
    k, rank = min(k, ls), min(rank, dt)
    g = torch.Generator().manual_seed(0)

    def side() -> SideFit:
        sources = torch.stack([torch.randperm(ls, generator=g)[:k].sort().values for _ in range(lt)])
        return SideFit(sources, torch.randn(lt, k * ds, dt, generator=g) * (k * ds) ** -0.5,
                       torch.zeros(lt, dt), torch.zeros(lt, dt),
                       torch.linalg.qr(torch.randn(lt, dt, rank, generator=g)).Q, torch.ones(lt, dt),
                       torch.zeros(lt), torch.zeros(lt, ls))

    ident = dict.fromkeys(("name", "config", "weights"), "random-weights")  # no checkpoint: any pair's shapes
    return Mapper(MapInfo(ident, ident, k, 0.01, rank, 0), {"k": side(), "v": side()})
