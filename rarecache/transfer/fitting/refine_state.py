"""A refinement's saved state (`rarecache refine` resumes from it): the change, Adam's moments and the best
change so far, in safetensors with a JSON record. The file is untrusted input on reading: checksum, names,
shapes, dtypes, finite values and a consistent record are checked; no pickle."""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path

import torch

from ...errors import RarecacheError
from ..mapfile import partial_path, tensors_sha256
from ..mapper import SIDES, Mapper


def identity(cfg, mapper: Mapper) -> dict:
    """What a saved state must match to be resumed: the settings and the map's tensors."""
    return {"config": json.loads(json.dumps(asdict(cfg))),  # (tuples as JSON reads them back: lists)
            "map": tensors_sha256({f"{s}.{n}": getattr(mapper.sides[s], n) for s in SIDES for n in ("weight", "bias")})}


def save_state(path: Path, cfg, mapper: Mapper, delta, opt, step: int, checks: list,
                best: tuple) -> None:
    """The run so far, in safetensors (no pickle): the change, Adam's moments, the best change and a JSON record."""
    from safetensors.torch import save_file

    names = [n for n, _ in delta.named_parameters()]
    tensors = {f"delta.{n}": p.detach() for n, p in delta.named_parameters()}
    tensors.update({f"best.{n}": best[2][n] for n in names})
    for n, p in zip(names, delta.parameters()):
        st = opt.state[p]  # (saved after a step: every parameter has its moments)
        tensors[f"adam.{n}.exp_avg"], tensors[f"adam.{n}.exp_avg_sq"] = st["exp_avg"], st["exp_avg_sq"]
    tensors = {k: v.detach().contiguous() for k, v in tensors.items()}
    meta = {**identity(cfg, mapper), "step": step, "checks": checks, "best": [best[0], best[1]],
            "adam_step": int(opt.state[next(iter(delta.parameters()))]["step"])}
    tmp = partial_path(path)
    save_file(tensors, str(tmp), metadata={"refine": json.dumps(meta), "sha256": tensors_sha256(tensors)})
    tmp.replace(path)


def resume(path: Path, cfg, mapper: Mapper, delta, opt) -> tuple[int, list, tuple]:
    """Load a saved run into `delta` and `opt`; refuse one of other settings or another map, and a damaged one
    (the file is checked as untrusted input: checksum, names, shapes, dtypes, finite values, a consistent record)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            header = f.metadata() or {}
            meta = json.loads(header["refine"])
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (OSError, SafetensorError, KeyError, ValueError, TypeError) as e:
        raise RarecacheError(f"{path} is not a refinement state ({e}): delete it to start again") from None
    if not isinstance(meta, dict) or {k: meta.get(k) for k in ("config", "map")} != identity(cfg, mapper):
        raise RarecacheError(f"{path} was saved by a refinement of another map or with other settings: delete it "
                             "or give the same ones")
    damaged = RarecacheError(f"{path} is a damaged refinement state: delete it to start again")
    params = dict(delta.named_parameters())
    want = {f"{kind}.{n}": p for n, p in params.items() for kind in ("delta", "best")}
    want.update({f"adam.{n}.{m}": p for n, p in params.items() for m in ("exp_avg", "exp_avg_sq")})
    if header.get("sha256") != tensors_sha256(tensors) or set(tensors) != set(want) or any(
            tensors[k].shape != p.shape or tensors[k].dtype != p.dtype or not torch.isfinite(tensors[k]).all()
            for k, p in want.items()):
        raise damaged
    step, checks, best = meta.get("step"), meta.get("checks"), meta.get("best")
    steps = [c.get("step") for c in checks] if isinstance(checks, list) and all(isinstance(c, dict) for c in checks) \
        else None
    ok = (isinstance(step, int) and 0 < step <= cfg.steps and meta.get("adam_step") == step and steps is not None
          and steps == [0, *[t for t in range(1, step + 1) if t % cfg.every == 0 or t == cfg.steps]]
          and all(isinstance(c.get("heldout_kl"), float) and math.isfinite(c["heldout_kl"]) for c in checks)
          and isinstance(best, list) and len(best) == 2 and [best[1], best[0]] in [[c["step"], c["heldout_kl"]]
                                                                                  for c in checks])
    if not ok:
        raise damaged
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(tensors[f"delta.{n}"])
            opt.state[p] = {"step": torch.tensor(float(step)), "exp_avg": tensors[f"adam.{n}.exp_avg"].clone(),
                            "exp_avg_sq": tensors[f"adam.{n}.exp_avg_sq"].clone()}
    kept = {**delta.state_dict(), **{n: tensors[f"best.{n}"] for n in params}}
    return step, checks, (float(best[0]), int(best[1]), kept)
