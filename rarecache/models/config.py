"""Model configuration, read from a Hugging Face config.json.

One frozen dataclass covers the three families we run (Llama, Qwen2, Qwen3): they
differ only in biases, q/k norms and RoPE scaling. Unknown keys are dropped; a
missing required key or an unsupported feature is a clear error rather than a
silently different model.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..errors import RarecacheError

FAMILIES = ("llama", "qwen2", "qwen3")
ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    type: str = "default"  # one of ROPE_TYPES
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int = 8192  # llama3 only


@dataclass(frozen=True)
class ModelConfig:
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # q/k/v projections carry a bias (Qwen2 always; Llama if attention_bias)
    o_bias: bool  # o_proj bias (Llama attention_bias only)
    mlp_bias: bool
    qk_norm: bool  # per-head RMSNorm on q and k before RoPE (Qwen3)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def kv_dim(self) -> int:
        """Width of one cache row with all KV heads concatenated."""
        return self.num_kv_heads * self.head_dim

    def fingerprint(self) -> str:
        """Stable hash of the architecture (used to tie map files to a model pair)."""
        blob = json.dumps(asdict(self), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        family = raw.get("model_type")
        if family not in FAMILIES:
            raise RarecacheError(
                f"unsupported model_type {family!r}; rarecache runs {', '.join(FAMILIES)}"
            )

        def need(key: str) -> Any:
            if raw.get(key) is None:
                raise RarecacheError(f"config.json ({family}) is missing required key {key!r}")
            return raw[key]

        if raw.get("use_sliding_window"):
            raise RarecacheError("sliding-window attention is not supported (use_sliding_window=true)")
        hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
        head_dim = raw.get("head_dim") or hidden // heads
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        attention_bias = bool(raw.get("attention_bias", False))
        return cls(
            family=family,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=int(need("num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope=_rope_from_dict(raw),
            max_position_embeddings=int(raw.get("max_position_embeddings", 32768)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=family == "qwen2" or attention_bias,
            o_bias=family != "qwen2" and attention_bias,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=family == "qwen3",
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelConfig":
        file = Path(path) / "config.json"
        if not file.is_file():
            raise RarecacheError(f"no config.json in {path}")
        try:
            raw = json.loads(file.read_text())
        except json.JSONDecodeError as e:
            raise RarecacheError(f"{file} is not valid JSON: {e}") from None
        if not isinstance(raw, dict):
            raise RarecacheError(f"{file} does not hold a JSON object")
        return cls.from_dict(raw)


def _rope_from_dict(raw: dict[str, Any]) -> RopeConfig:
    # transformers 5 writes `rope_parameters` (theta inside); 4.x wrote
    # `rope_theta` + optional `rope_scaling`.
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise RarecacheError(f"unsupported RoPE type {kind!r}; supported: {', '.join(ROPE_TYPES)}")
    return RopeConfig(
        theta=float(theta),
        type=kind,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
    )
