"""Model configuration, read from a Hugging Face config.json.

One frozen dataclass covers the three families we run (Llama, Qwen2, Qwen3): they
differ only in biases, q/k norms and RoPE scaling. Unknown keys are dropped; a
missing required key or an unsupported feature is a clear error rather than a
silently different model.

config.json is untrusted input: a value of the wrong type (a string, a bool, 64.5
where an integer belongs) or out of range (no layers, NaN epsilon, more KV heads than
heads, a million layers to build) is a RarecacheError naming the key, never a
traceback or a model that computes garbage.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..errors import RarecacheError

FAMILIES = ("llama", "qwen2", "qwen3")
ROPE_TYPES = ("default", "linear", "llama3")
MAX_LAYERS = 1024  # far above any real model; a bound on the modules a config can make us build
MAX_SIZE = 2**31 - 1  # any other size or count: products of two stay within int64 shapes


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    type: str = "default"  # one of ROPE_TYPES
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int = 8192  # llama3 only

    def __post_init__(self):
        for key in ("theta", "factor", "low_freq_factor", "high_freq_factor"):
            _positive_real(f"rope {key}", getattr(self, key))
        _whole(self.original_max_position_embeddings, "rope original_max_position_embeddings")
        if self.type == "llama3" and self.high_freq_factor == self.low_freq_factor:
            raise RarecacheError("llama3 RoPE needs high_freq_factor != low_freq_factor")


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

    def __post_init__(self):
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                    "head_dim", "max_position_embeddings"):
            _whole(getattr(self, key), key)
        _positive_real("rms_norm_eps", self.rms_norm_eps)
        if self.num_layers > MAX_LAYERS:
            raise RarecacheError(f"config.json: num_hidden_layers is {self.num_layers}; rarecache builds at most "
                                 f"{MAX_LAYERS}")
        if self.num_heads % self.num_kv_heads:
            raise RarecacheError(f"config.json: num_attention_heads {self.num_heads} do not split into "
                                 f"num_key_value_heads {self.num_kv_heads}")
        if self.head_dim % 2:
            raise RarecacheError(f"config.json: head_dim {self.head_dim} is odd; rotary embeddings need an even one")
        ids = [*self.eos_token_ids, *([] if self.bos_token_id is None else [self.bos_token_id])]
        if any(type(i) is not int or i < 0 for i in ids):
            raise RarecacheError(f"config.json: bos/eos token ids must be integers >= 0, not {ids}")

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
                raise RarecacheError(f"config.json: missing required key {key!r} (a {family} model)")
            return raw[key]

        def opt(key: str, default: Any) -> Any:  # null counts as absent
            return default if raw.get(key) is None else raw[key]

        if raw.get("use_sliding_window"):
            raise RarecacheError("sliding-window attention is not supported (use_sliding_window=true)")
        hidden = _int(need("hidden_size"), "hidden_size")
        heads = _int(need("num_attention_heads"), "num_attention_heads")
        if raw.get("head_dim") is None and heads > 0 and (hidden % heads or hidden // heads % 2):
            raise RarecacheError(f"config.json: hidden_size {hidden} / num_attention_heads {heads} gives no even "
                                 "head_dim (and no head_dim is given); one of them is wrong")
        head_dim = _int(raw.get("head_dim") or hidden // max(heads, 1), "head_dim")
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        attention_bias = _bool(opt("attention_bias", False), "attention_bias")
        return cls(
            family=family,
            vocab_size=_int(need("vocab_size"), "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_int(need("intermediate_size"), "intermediate_size"),
            num_layers=_int(need("num_hidden_layers"), "num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=_int(raw.get("num_key_value_heads") or heads, "num_key_value_heads"),
            head_dim=head_dim,
            rms_norm_eps=_real(opt("rms_norm_eps", 1e-6), "rms_norm_eps"),
            rope=_rope_from_dict(raw),
            max_position_embeddings=_int(opt("max_position_embeddings", 32768), "max_position_embeddings"),
            tie_word_embeddings=_bool(opt("tie_word_embeddings", False), "tie_word_embeddings"),
            qkv_bias=family == "qwen2" or attention_bias,
            o_bias=family != "qwen2" and attention_bias,
            mlp_bias=_bool(opt("mlp_bias", False), "mlp_bias"),
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
        except (ValueError, RecursionError) as e:  # bad JSON, bad UTF-8, a 5000-digit number, deep nesting
            raise RarecacheError(f"{file} is not valid JSON: {str(e)[:200]}") from None
        if not isinstance(raw, dict):
            raise RarecacheError(f"{file} does not hold a JSON object")
        try:
            return cls.from_dict(raw)
        except RarecacheError as e:  # name the file (a copied model's, maybe), not just "config.json"
            raise RarecacheError(f"{file}: {str(e).removeprefix('config.json: ')}") from None


def _rope_from_dict(raw: dict[str, Any]) -> RopeConfig:
    # transformers 5 writes `rope_parameters` (theta inside); 4.x wrote
    # `rope_theta` + optional `rope_scaling`.
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise RarecacheError("config.json: rope_parameters / rope_scaling must be an object")

    def opt(key: str, default: Any) -> Any:  # null counts as absent
        return default if params.get(key) is None else params[key]

    theta = opt("rope_theta", raw.get("rope_theta") if raw.get("rope_theta") is not None else 10000.0)
    kind = params.get("rope_type", params.get("type", "default"))
    if not isinstance(kind, str) or kind not in ROPE_TYPES:
        raise RarecacheError(f"unsupported RoPE type {kind!r}; supported: {', '.join(ROPE_TYPES)}")
    return RopeConfig(
        theta=_real(theta, "rope_theta"),
        type=kind,
        factor=_real(opt("factor", 1.0), "rope factor"),
        low_freq_factor=_real(opt("low_freq_factor", 1.0), "rope low_freq_factor"),
        high_freq_factor=_real(opt("high_freq_factor", 4.0), "rope high_freq_factor"),
        original_max_position_embeddings=_int(opt("original_max_position_embeddings", 8192),
                                              "rope original_max_position_embeddings"),
    )


def _int(value: Any, key: str) -> int:
    """An integer as JSON writes one (7, or 7.0), never a bool, a string or 7.5."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if type(value) is not int:
        raise RarecacheError(f"config.json: {key} must be an integer, not {value!r}"[:200])
    return value


def _real(value: Any, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RarecacheError(f"config.json: {key} must be a number, not {value!r}"[:200])
    try:
        return float(value)
    except OverflowError:
        raise RarecacheError(f"config.json: {key} is out of range") from None


def _bool(value: Any, key: str) -> bool:
    if not isinstance(value, bool):
        raise RarecacheError(f"config.json: {key} must be true or false, not {value!r}"[:200])
    return value


def _whole(value: int, key: str) -> None:
    if type(value) is not int or not 1 <= value <= MAX_SIZE:
        raise RarecacheError(f"config.json: {key} must be an integer in 1..{MAX_SIZE}, not {value!r}"[:200])


def _positive_real(key: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise RarecacheError(f"config.json: {key} must be a finite number > 0, not {value!r}")
