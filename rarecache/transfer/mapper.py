"""A fitted cross-model KV map: identity, tensors, file format and application.

A map file is safetensors (data only, no pickle) with JSON metadata naming the
source and target (config and weight fingerprints), the direction and every
fitting choice. Loading it against another pair, or the other way round, is
refused with a message naming both.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ..engine.cache import KVCache
from ..engine.runner import Runner
from ..errors import RarecacheError
from ..models.loader import checkpoint_fingerprint
from .features import rows, write_rows
from .fit import SideFit

FORMAT_VERSION = 1
SIDES = ("k", "v")
_META_KEY = "rarecache.map"
_TENSORS = ("sources", "weight", "bias", "mean", "basis", "eigenvalues", "r2", "r2_single")


def identity(runner: Runner) -> dict[str, str]:
    """Who a model is, for tying maps to it: name, architecture hash, weight fingerprint."""
    path = runner.path
    return {"name": path.name if path else "unnamed", "config": runner.config.fingerprint(),
            "weights": checkpoint_fingerprint(path) if path else "unknown"}


@dataclass(frozen=True)
class MapInfo:
    source: dict[str, str]
    target: dict[str, str]
    k: int  # source layers per target layer
    lam: float
    rank: int  # rank-disagreement probe rank r
    tokens: int  # calibration tokens in the fit
    corpus: dict[str, Any] = field(default_factory=dict)
    calibration: dict[str, Any] = field(default_factory=dict)  # seq_len, stride, dtype, documents used, ...
    r2_heldout: dict[str, list[float]] = field(default_factory=dict)  # side -> per target layer
    format_version: int = FORMAT_VERSION

    @property
    def direction(self) -> str:
        return f"{self.source['name']} -> {self.target['name']}"


class Mapper:
    def __init__(self, info: MapInfo, sides: dict[str, SideFit]):
        self.info = info
        self.sides = sides
        self._cast: dict[tuple[str, torch.dtype, Any], tuple[torch.Tensor, ...]] = {}

    # -- file format -------------------------------------------------------------------

    def save(self, path: str | Path) -> None:
        tensors = {f"{s}.{name}": getattr(self.sides[s], name).contiguous() for s in SIDES for name in _TENSORS}
        tensors = {k: (v.float() if v.is_floating_point() else v.long()) for k, v in tensors.items()}
        meta = {f.name: getattr(self.info, f.name) for f in fields(MapInfo)}
        path = Path(path)
        tmp = path.with_name(path.name + ".partial")
        save_file(tensors, str(tmp), metadata={_META_KEY: json.dumps(meta)})
        tmp.chmod(0o644)  # safetensors writes 0600; a map is meant to be shared
        tmp.replace(path)

    @classmethod
    def load(cls, path: str | Path) -> "Mapper":
        path = Path(path)
        if not path.is_file():
            raise RarecacheError(f"no map file {path}")
        try:
            with safe_open(str(path), framework="pt") as f:
                raw = (f.metadata() or {}).get(_META_KEY)
                tensors = {k: f.get_tensor(k) for k in f.keys()}
        except (OSError, SafetensorError) as e:
            raise RarecacheError(f"{path} is not a map file: {e}") from None
        try:
            meta = json.loads(raw)
            if meta.get("format_version") != FORMAT_VERSION:
                raise RarecacheError(f"{path}: map format {meta.get('format_version')}, "
                                     f"this rarecache reads {FORMAT_VERSION}")
            info = MapInfo(**meta)
        except (TypeError, json.JSONDecodeError) as e:
            raise RarecacheError(f"{path} has no valid rarecache map metadata ({e})") from None
        try:
            sides = {s: SideFit(**{n: tensors[f"{s}.{n}"] for n in _TENSORS}) for s in SIDES}
        except KeyError as e:
            raise RarecacheError(f"{path} lacks tensor {e}") from None
        mapper = cls(info, sides)
        mapper._validate(path)
        return mapper

    def _validate(self, path: Path) -> None:
        for s, fit in self.sides.items():
            lt, kd, dt = fit.weight.shape
            shapes = {"sources": (lt, self.info.k), "bias": (lt, dt), "mean": (lt, dt),
                      "basis": (lt, dt, self.info.rank), "eigenvalues": (lt, dt), "r2": (lt,)}
            for name, shape in shapes.items():
                if tuple(getattr(fit, name).shape) != shape:
                    raise RarecacheError(f"{path}: {s}.{name} has shape {tuple(getattr(fit, name).shape)}, "
                                         f"expected {shape}")
            if kd % self.info.k or not torch.isfinite(fit.weight).all():
                raise RarecacheError(f"{path}: {s}.weight is malformed")

    # -- identity ------------------------------------------------------------------------

    def check_pair(self, source: Runner, target: Runner) -> None:
        """Refuse to run with models other than the ones this map was fitted for."""
        got_s, got_t = identity(source), identity(target)
        want_s, want_t = self.info.source, self.info.target

        def same(a, b):
            return a["config"] == b["config"] and a["weights"] == b["weights"]

        if same(got_s, want_s) and same(got_t, want_t):
            return
        if same(got_s, want_t) and same(got_t, want_s):
            raise RarecacheError(f"this map runs {self.info.direction}; you asked for "
                                 f"{got_s['name']} -> {got_t['name']}: fit a map in that direction")
        raise RarecacheError(f"this map was fitted for {self.info.direction} "
                             f"(configs {want_s['config']}/{want_t['config']}, weights {want_s['weights']}/"
                             f"{want_t['weights']}), not for {got_s['name']} -> {got_t['name']} "
                             f"(configs {got_s['config']}/{got_t['config']}, weights {got_s['weights']}/"
                             f"{got_t['weights']})")

    def summary(self) -> str:
        """Direction, fitting choices, corpus and R2 per side (in-sample, and held out when measured)."""
        i = self.info
        lines = [f"map {i.direction}: k={i.k} lambda={i.lam} rank={i.rank} tokens={i.tokens} "
                 f"corpus={i.corpus.get('name')} ({i.corpus.get('documents')} docs, "
                 f"{i.calibration.get('documents_used')} used)"]
        for side, name in (("k", "keys"), ("v", "values")):
            r2 = self.sides[side].r2
            held = i.r2_heldout.get(side)
            lines.append(f"  R2 {name:6s} mean {r2.mean():.4f} (min {r2.min():.4f}, max {r2.max():.4f})"
                         + (f"   held-out mean {sum(held) / len(held):.4f}" if held else ""))
        return "\n".join(lines)

    # -- application ---------------------------------------------------------------------

    def _tensors(self, side: str, dtype: torch.dtype, device) -> tuple[torch.Tensor, ...]:
        key = (side, dtype, str(device))
        if key not in self._cast:
            f = self.sides[side]
            self._cast[key] = (f.sources.to(device), f.weight.to(device, dtype), f.bias.to(device, dtype),
                               f.mean.to(device, dtype))
        return self._cast[key]

    def map_rows(self, side: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Source content rows x (B, T, Ls·ds) -> target rows ŷ (Lt, B, T, dt) and centred z = ŷ − ȳ."""
        sources, weight, bias, mean = self._tensors(side, x.dtype, x.device)
        B, T, _ = x.shape
        Lt, kd, dt = weight.shape
        layers = x.reshape(B * T, -1, kd // self.info.k)  # (B·T, Ls, ds)
        y = torch.empty(Lt, B * T, dt, dtype=x.dtype, device=x.device)
        for l in range(Lt):  # one gather of whole source-layer rows and one matmul per target layer
            torch.addmm(bias[l], layers.index_select(1, sources[l]).reshape(B * T, kd), weight[l], out=y[l])
        y = y.view(Lt, B, T, dt)
        return y, y - mean[:, None, None]

    @torch.inference_mode()
    def apply(self, source: Runner, source_cache: KVCache, target: Runner, target_cache: KVCache,
              positions: torch.Tensor, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """Map the source cache at positions (B, T) into the target cache (all layers, slots filled).

        Returns the centred predictions z per side, (Lt, B, T, dt), for scoring.
        """
        dtype = dtype or target.dtype
        out = {}
        for side in SIDES:
            x = rows(source, source_cache, positions, side).to(dtype)  # each source layer de-rotated once
            out[side] = self.map_rows(side, x)
        write_rows(target, target_cache, positions, out["k"][0], out["v"][0])
        return {side: z for side, (_, z) in out.items()}
