"""A map's manifest: what a deployment pins so a map runs only with the models it was fitted for.

A map file already names its pair (config and weight fingerprints) and `check_pair` refuses
another pair. A deployment wants more, written down once and compared at every start: that
the map is the very file it reviewed (its sha256), that the tokenizer is the one the map's
token ids were read with, and that the KV layout the engine hands rows in (layers, KV heads,
head_dim, the tensor-parallel split and the head order) is the layout the map writes. A
manifest is a small JSON object (`manifest_of` makes one from a map and the model
directories; `rarecache inspect MAP --manifest OUT` writes it):

    {"format": 1, "map_sha256": "...", "dtype": "float32",
     "source": {"name", "config", "weights"}, "target": {...},
     "tokenizer": "<sha256 of the target's tokenizer.json>",
     "kv_layout": {"source": {"layers", "kv_heads", "head_dim"},
                   "target": {"layers", "kv_heads", "head_dim", "tensor_parallel", "head_order"}}}

`check_manifest` compares a pinned manifest with what is actually deployed, field by field,
and refuses the first difference with both values. The vLLM connector checks the maps its
`manifests` setting pins (adapters/vllm/connector/core.py); the peer's KV layout once its config is known.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from ..errors import RarecacheError
from ..models.config import ModelConfig
from ..packages import sha256_file

FORMAT = 1
HEAD_ORDER = "hf"  # KV heads in the checkpoint's order, split into contiguous blocks per tensor-parallel rank
REQUIRED = ("format", "map_sha256", "dtype", "source", "target", "tokenizer", "kv_layout")


def kv_layout(cfg: ModelConfig, tensor_parallel: int | None = None) -> dict[str, Any]:
    """The KV rows a model's cache holds per token (with the engine's split when given)."""
    out: dict[str, Any] = {"layers": cfg.num_layers, "kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim}
    if tensor_parallel is not None:
        out.update(tensor_parallel=tensor_parallel, head_order=HEAD_ORDER)
    return out


def tokenizer_hash(model_dir: str | Path) -> str:
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        raise RarecacheError(f"no tokenizer.json in {model_dir}: a manifest pins the tokenizer's hash")
    return sha256_file(path)


def manifest_of(mapper: Any, map_path: str | Path, *, target_dir: str | Path, source_dir: str | Path | None = None,
                tensor_parallel: int = 1) -> dict[str, Any]:
    """The manifest of the map at `map_path` (loaded as `mapper`) deployed with the target model in
    `target_dir` split over `tensor_parallel` ranks; the source's KV layout when `source_dir` is given."""
    info = mapper.info
    dtypes = {str(fit.weight.dtype).removeprefix("torch.") for fit in mapper.sides.values()}
    layout = {"target": kv_layout(ModelConfig.from_dir(target_dir), tensor_parallel)}
    if source_dir is not None:
        layout["source"] = kv_layout(ModelConfig.from_dir(source_dir))
    return {"format": FORMAT, "map_sha256": sha256_file(Path(map_path)), "dtype": "/".join(sorted(dtypes)),
            "source": {k: info.source.get(k) for k in ("name", "config", "weights")},
            "target": {k: info.target.get(k) for k in ("name", "config", "weights")},
            "tokenizer": tokenizer_hash(target_dir), "kv_layout": layout}


def deployed_manifest(mapper: Any, map_path: str | Path, source_dir: str | Path, target_dir: str | Path,
                      tensor_parallel: int = 1) -> dict[str, Any]:
    """`manifest_of` for the pair in these checkpoint directories, which must be the map's own."""
    from ..models.loader import checkpoint_fingerprint

    if type(tensor_parallel) is not int or tensor_parallel < 1:
        raise RarecacheError(f"the tensor-parallel size must be >= 1, not {tensor_parallel}")
    for side, path in (("source", source_dir), ("target", target_dir)):
        mine = {"config": ModelConfig.from_dir(path).fingerprint(), "weights": checkpoint_fingerprint(path)}
        if any(getattr(mapper.info, side).get(k) != v for k, v in mine.items()):
            raise RarecacheError(f"--{side} {path} is not the model the map was fitted for ({mapper.info.direction})")
    return manifest_of(mapper, map_path, target_dir=target_dir, source_dir=source_dir,
                       tensor_parallel=tensor_parallel)


def read_manifest(path: str | Path) -> dict[str, Any]:
    """A pinned manifest file, checked for form (its values are compared by `check_manifest`)."""
    try:
        raw = json.loads(Path(path).read_text())
    except (OSError, ValueError, RecursionError) as e:
        raise RarecacheError(f"cannot read the manifest {path}: {e}") from None
    missing = [k for k in REQUIRED if not isinstance(raw, dict) or k not in raw]
    if missing:
        raise RarecacheError(f"the manifest {path} lacks {', '.join(missing)}")
    if raw["format"] != FORMAT:
        raise RarecacheError(f"the manifest {path} has format {raw['format']!r}; this rarecache reads {FORMAT}")
    return raw


def _diff(pinned: Any, actual: Any, where: str) -> str | None:
    """The first field (dotted) where the actual value differs from the pinned one, described."""
    if isinstance(actual, dict):
        for key, value in actual.items():
            if key == "name":  # a directory name is not an identity
                continue
            if not isinstance(pinned, dict) or key not in pinned:
                return f"{where}{key} is not pinned"
            found = _diff(pinned[key], value, f"{where}{key}.")
            if found:
                return found
        return None
    if pinned != actual:
        return f"{where.rstrip('.')} is {json.dumps(actual)[:80]}, the manifest pins {json.dumps(pinned)[:80]}"
    return None


def check_manifest(pinned: dict[str, Any], actual: dict[str, Any], where: str = "the map") -> None:
    """Refuse a deployment that differs from its pinned manifest in any field `actual` holds."""
    why = _diff(pinned, actual, "")
    if why:
        raise RarecacheError(f"{where} does not match its pinned manifest: {why}")


def digest(manifest: dict[str, Any]) -> str:
    """A short name of a manifest (logs, metrics)."""
    return hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()[:16]
