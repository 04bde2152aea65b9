"""Load a Hugging Face checkpoint directory (single or sharded safetensors).

Checkpoints may come from anyone, so the loader reads safetensors only (no
pickle), refuses shard names that leave the directory, and checks every tensor's
name and shape against the model before assigning it: a missing or unexpected
tensor is an error that names it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ..errors import RarecacheError
from .config import ModelConfig
from .llama import CausalLM
from .qwen2 import Qwen2ForCausalLM
from .qwen3 import Qwen3ForCausalLM

MODEL_CLASSES: dict[str, type[CausalLM]] = {
    "llama": CausalLM,
    "qwen2": Qwen2ForCausalLM,
    "qwen3": Qwen3ForCausalLM,
}

# Tensors some checkpoints carry that we derive ourselves.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def build_model(cfg: ModelConfig) -> CausalLM:
    return MODEL_CLASSES[cfg.family](cfg)


def checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise RarecacheError(f"{index} is not a valid safetensors index: {e}") from None
        names = sorted(set(weight_map.values()))
        for name in names:
            if not isinstance(name, str) or Path(name).name != name:
                raise RarecacheError(f"{index} names a shard outside the directory: {name!r}")
        files = [path / n for n in names]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise RarecacheError(f"no .safetensors weights in {path}")
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise RarecacheError(f"{path} lacks shard(s) {', '.join(missing)}")
    return files


def load_model(
    path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> CausalLM:
    """Build the model described by `path/config.json` and load its weights."""
    path = Path(path)
    cfg = ModelConfig.from_dir(path)
    with torch.device("meta"):
        model = build_model(cfg)
    expected = {k: v.shape for k, v in model.state_dict().items()}
    state: dict[str, torch.Tensor] = {}
    unexpected: list[str] = []
    for file in checkpoint_files(path):
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():
                    if name.endswith(_IGNORED_SUFFIXES):
                        continue
                    if name == "lm_head.weight" and cfg.tie_word_embeddings:
                        continue  # a tied head is the embedding
                    if name not in expected:
                        unexpected.append(name)
                        continue
                    t = f.get_tensor(name)
                    if t.shape != expected[name]:
                        raise RarecacheError(
                            f"{file.name}: tensor {name} has shape {tuple(t.shape)}, "
                            f"config.json implies {tuple(expected[name])}"
                        )
                    state[name] = t.to(device=device, dtype=dtype)
        except (OSError, SafetensorError) as e:
            raise RarecacheError(f"cannot read {file}: {e}") from None
    missing = sorted(set(expected) - set(state))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing tensors: {_names(missing)}")
        if unexpected:
            parts.append(f"unexpected tensors: {_names(sorted(unexpected))}")
        raise RarecacheError(f"checkpoint {path} does not match its config ({'; '.join(parts)})")
    model.load_state_dict(state, assign=True)
    return model.eval().requires_grad_(False)


def _names(names: list[str], limit: int = 8) -> str:
    more = f" (+{len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def checkpoint_fingerprint(path: str | Path) -> str:
    """A cheap identity of a checkpoint's weights, independent of the dtype it is run in.

    Hashes each safetensors file's size, header (names, dtypes, shapes, offsets) and
    1 MiB of data from its start, middle and end.
    """
    h = hashlib.sha256()
    for file in checkpoint_files(Path(path)):
        size = file.stat().st_size
        h.update(f"{file.name}:{size}".encode())
        with open(file, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            h.update(f.read(min(header_len, 100 << 20)))
            for at in (0, size // 2, max(size - (1 << 20), 0)):
                f.seek(at)
                h.update(f.read(1 << 20))
    return h.hexdigest()[:16]
