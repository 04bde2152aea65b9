"""Our Runner over the model vLLM loaded: the selective recompute without a second copy of the weights.

The handoff's recompute runs the target's layers over a scattered set of positions against a
cache that the map filled (engine/runner.py); vLLM's own forward only computes the positions
after a prefix. So the connector drives the layers itself, as our Runner does, but with the
modules vLLM already holds: its embedding, RMSNorms, fused qkv_proj / gate_up_proj, o_proj,
down_proj and LM head, called as vLLM calls them. Only attention (exact causal by position,
over our KVCache) and RoPE (ours, checked against vLLM's at build time) are our code.

Why modules and not parameter views: on a CPU, vLLM repacks every linear layer's weight for
oneDNN after loading and drops the dense tensor (`dispatch_cpu_unquantized_gemm(...,
remove_weight=True)` leaves `qkv_proj.weight` empty), so there is nothing to take a view of;
calling the module is zero-copy on every platform, and also keeps quantized weights working.
The embedding and norm weights are kept by vLLM, and `shared_tensors` shows the view reads
exactly those tensors (tested by data_ptr). Under tensor parallelism the same view runs on
every rank over that rank's shards (`rank_config`); the collectives are vLLM's, inside its
modules.

This module does not import vllm: it reads attributes of the modules it is given.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

from ....engine.runner import Runner
from ....errors import RarecacheError
from ....models.config import ModelConfig
from ....models.rope import rotate_half
from .sharding import kv_head_range


class _Layer:
    """One vLLM decoder layer behind our DecoderLayer's `qkv` / `finish` interface."""

    def __init__(self, layer, cfg: ModelConfig, index: int):
        self.layer, self.attn = layer, layer.self_attn
        a = self.attn
        heads = getattr(a, "num_heads", None)
        kv_heads = getattr(a, "num_kv_heads", None)
        if (heads, kv_heads, getattr(a, "head_dim", None)) != (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim):
            raise RarecacheError(
                f"vLLM's layer {index} has {heads} heads / {kv_heads} KV heads of {getattr(a, 'head_dim', None)} "
                f"on this rank, rarecache expects {cfg.num_heads} / {cfg.num_kv_heads} of {cfg.head_dim} (the "
                "config's heads over the tensor-parallel ranks, by vLLM's rule: sharding.py)")
        self.q_size, self.kv_size = a.q_size, a.kv_size
        self.qk_norm = cfg.qk_norm
        if self.qk_norm and not (hasattr(a, "q_norm") and hasattr(a, "k_norm")):
            raise RarecacheError(f"vLLM's layer {index} has no q_norm / k_norm although config.json says qwen3")

    def modules(self):
        mods = [self.layer.input_layernorm, self.attn.qkv_proj, self.attn.o_proj,
                self.layer.post_attention_layernorm, self.layer.mlp]
        return mods + ([self.attn.q_norm, self.attn.k_norm] if self.qk_norm else [])

    def qkv(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Residual h (B, T, C) -> rotated q (B, H, T, D), k and v (B, Hkv, T, D)."""
        B, T, C = h.shape
        a = self.attn
        x = self.layer.input_layernorm(h.reshape(B * T, C))  # (B·T, C)
        qkv, _ = a.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        H, Hkv, D = a.num_heads, a.num_kv_heads, a.head_dim
        q, k, v = q.reshape(B * T, H, D), k.reshape(B * T, Hkv, D), v.reshape(B * T, Hkv, D)
        if self.qk_norm:  # per head, before RoPE (as vLLM's Qwen3Attention)
            q, k = a.q_norm(q.contiguous()), a.k_norm(k.contiguous())
        q = q.view(B, T, H, D).transpose(1, 2)  # (B, H, T, D)
        k = k.view(B, T, Hkv, D).transpose(1, 2)
        v = v.reshape(B, T, Hkv, D).transpose(1, 2)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v

    def finish(self, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Residual h (B, T, C) and attention output (B, H, T, D) -> the layer's output."""
        B, H, T, D = attn.shape
        C = h.shape[-1]
        o, _ = self.attn.o_proj(attn.transpose(1, 2).reshape(B * T, H * D))
        h = h + o.view(B, T, C)
        m = self.layer.mlp(self.layer.post_attention_layernorm(h.reshape(B * T, C)))
        return h + m.view(B, T, C)


class _Inner:
    def __init__(self, embed_tokens):
        self.embed_tokens = embed_tokens  # Runner reads .embed_tokens.weight for dtype and device


class VllmBackedLM:
    """vLLM's loaded `*ForCausalLM` behind the interface our Runner drives (models/llama.py's
    CausalLM: `config`, `layers[i].qkv/finish`, `embed`, `logits`). Holds no tensors of its own."""

    def __init__(self, vllm_model, cfg: ModelConfig):
        inner = getattr(vllm_model, "model", None)
        layers = getattr(inner, "layers", None)
        if inner is None or layers is None or not hasattr(inner, "embed_tokens") or not hasattr(inner, "norm"):
            raise RarecacheError(f"vLLM's {type(vllm_model).__name__} does not have the model.embed_tokens / "
                                 "layers / norm structure of a Llama-family model; the recompute cannot drive it")
        if len(layers) != cfg.num_layers or any(not hasattr(layer, "self_attn") for layer in layers):
            raise RarecacheError(f"vLLM holds {len(layers)} decoder layers here, config.json {cfg.num_layers}: the "
                                 "recompute needs every layer on this rank (pipeline parallel is not supported)")
        self.config = cfg
        self.vllm_model = vllm_model
        self.model = _Inner(inner.embed_tokens)
        self.norm = inner.norm
        self.layers = [_Layer(layer, cfg, i) for i, layer in enumerate(layers)]
        self.head = inner.embed_tokens if cfg.tie_word_embeddings else getattr(vllm_model, "lm_head", None)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (B, T) -> residual stream (B, T, C)."""
        B, T = tokens.shape
        return self.model.embed_tokens(tokens.reshape(B * T)).view(B, T, -1)

    def logits(self, h: torch.Tensor, float32: bool = False) -> torch.Tensor:
        """Final norm and LM head; h (..., C) -> float32 logits (..., V) (vLLM pads the vocabulary). `float32`:
        the products in float32 (`CausalLM.logits`' flag, which `Runner` passes; the handoff reads only the
        argmax of its last logits, so the head's own dtype serves otherwise)."""
        head = self.head
        w = getattr(head, "weight", None)
        if w is None or w.dim() != 2 or w.shape[0] < self.config.vocab_size:
            # (a tensor-parallel rank holds a shard of the vocabulary; the handoff needs no logits)
            raise RarecacheError("vLLM's LM head keeps no dense weight of the whole vocabulary here; logits are "
                                 "unavailable")
        shape = h.shape
        x = self.norm(h.reshape(-1, shape[-1]))
        w = head.weight[: self.config.vocab_size]
        if float32:
            x, w = x.float(), w.float()
        return F.linear(x, w).float().view(*shape[:-1], -1)

    def modules(self) -> list[torch.nn.Module]:
        return [self.model.embed_tokens, self.norm, self.head] + [m for layer in self.layers for m in layer.modules()]


def rank_config(cfg: ModelConfig, tp_size: int = 1, tp_rank: int = 0) -> ModelConfig:
    """The model as one tensor-parallel rank holds it: its share of the query heads and the KV
    heads vLLM gives the rank (sharding.kv_head_range); the config itself at tp_size 1."""
    if tp_size == 1:
        return cfg
    if cfg.num_heads % tp_size:
        raise RarecacheError(f"{cfg.num_heads} attention heads do not split over tensor_parallel_size {tp_size}")
    heads = kv_head_range(cfg.num_kv_heads, tp_size, tp_rank)
    return replace(cfg, num_heads=cfg.num_heads // tp_size, num_kv_heads=heads.count)


def runner_over(vllm_model, model_dir: str | Path, tp_size: int = 1, tp_rank: int = 0) -> Runner:
    """Our Runner over the modules of vLLM's loaded model (zero-copy), RoPE checked against vLLM's.
    With tensor parallelism, over the rank's shards: its heads (`rank_config`), and vLLM's
    row-parallel o_proj / down_proj and vocabulary-parallel embedding do the all-reduces, so
    every rank must run the same forward passes in the same order."""
    cfg = rank_config(ModelConfig.from_dir(model_dir), tp_size, tp_rank)
    runner = Runner(VllmBackedLM(vllm_model, cfg), Path(model_dir), pack=False)
    check_rope(runner, vllm_model)
    return runner


def shared_tensors(runner: Runner) -> list[torch.Tensor]:
    """Every parameter and buffer the view's recompute reads: all of them vLLM's own."""
    seen, out = set(), []
    for module in runner.model.modules():
        for t in [*module.parameters(recurse=True), *module.buffers(recurse=True)]:
            if id(t) not in seen:
                seen.add(id(t))
                out.append(t)
    return out


@torch.inference_mode()
def check_rope(runner: Runner, vllm_model, positions=(0, 1, 7, 100, 1000)) -> float:
    """Refuse a model whose vLLM RoPE differs from ours: the map strips and re-applies RoPE with
    ours, and the recompute rotates with ours, so the two must agree (neox rotate_half
    for Llama / Qwen). Returns the largest difference seen."""
    rotary = getattr(vllm_model.model.layers[0].self_attn, "rotary_emb", None)
    if rotary is None:
        raise RarecacheError("vLLM's attention has no rotary_emb to check RoPE against")
    cfg = runner.config
    pos = torch.tensor([p for p in positions if p < cfg.max_position_embeddings], dtype=torch.long)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(len(pos), cfg.num_heads, cfg.head_dim, generator=g).to(runner.dtype)
    k = torch.randn(len(pos), cfg.num_kv_heads, cfg.head_dim, generator=g).to(runner.dtype)
    vq, vk = rotary(pos, q.reshape(len(pos), -1).clone(), k.reshape(len(pos), -1).clone())
    ours_q = runner.rope.apply(q.transpose(0, 1)[None], pos[None])[0].transpose(0, 1)  # (T, H, D)
    ours_k = runner.rope.apply(k.transpose(0, 1)[None], pos[None])[0].transpose(0, 1)
    err = max(float((vq.view_as(q) - ours_q).abs().max()), float((vk.view_as(k) - ours_k).abs().max()))
    tol = 1e-4 if runner.dtype == torch.float32 else 3e-2
    if not err <= tol:
        raise RarecacheError(f"vLLM's RoPE for {runner.path} differs from rarecache's (max error {err:.3g}); "
                             "the handoff needs both to rotate keys the same way")
    return err
