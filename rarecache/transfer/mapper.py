"""A fitted cross-model KV map and its application (its file format: mapfile.py; the checks of it against
models, text and its own fit, and its summary: mapcheck.py, which the methods of the same names delegate to).

A map file names the source and target it was fitted for; loading it against another pair, or the
other way round, is refused with a message naming both. `load` checks the file on its own
(mapfile.read); `check_pair` checks it against the two models (mapcheck: identity, then `check_fits`:
layer counts, row widths, source-layer indices). Every path that runs a map calls `check_pair` first.

One file serves every budget. Plain transfer (nothing recomputed but the last position) and a
handoff that recomputes part of the prompt want different fits of the same statistics: with every
key mapped, ridge's shrunken keys give the target flatter attention than its own, and sharpening
them (sidefit.py) helps; next to exact recomputed rows the sharpened mapped rows pull attention away
from them, and plain ridge is better (docs/RESULTS.md 8.1). `MapInfo.plain_sharpen` records the
sharpening plain transfer applies; `Mapper.plain` is that view, derived exactly from the stored fit
(sharpening is a known per-layer scale), so the file holds one set of tensors.

Two options read the tokens being mapped (features.py: a model's layer-0 rows depend on the token
alone). `MapInfo.token_inputs`: every target layer's ridge also reads the target's own layer-0 K and V
rows of the token, an input block after the source rows (the weight is K·ds + 2·dt rows tall).
`MapInfo.exact_layer0`: the target's layer-0 rows are those computed rows, not a prediction (they carry
no map error, so the rank score leaves them out). Every `apply*` takes the tokens (B, T) beside the
positions; the target's weights compute the rows. Both are left out of the file when off.
"""

from __future__ import annotations

from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import torch

from ..engine.cache import KVCache
from ..engine.runner import Runner
from ..errors import RarecacheError
from . import mapcheck, mapfile
from .features import SIDES, rows, token_block, token_rows, write_rows
from .fused import map_into
from .mapfile import MapInfo
from .sidefit import SideFit, SideMLP, sharpen, unsharpen

class Mapper:
    def __init__(self, info: MapInfo, sides: dict[str, SideFit], mlp: dict[str, SideMLP] | None = None):
        self.info = info
        self.sides = sides
        self.mlp = mlp  # residual MLPs per side when info.mlp_hidden > 0
        self._cast: dict[tuple[str, torch.dtype, str], dict[str, Any]] = {}
        self._views: dict[torch.dtype | None, Mapper] = {}  # the plain-transfer view per compute dtype (`plain`)
        self.compute_dtype: torch.dtype | None = None  # the map's products' dtype; None: the target's

    def computing_in(self, dtype: torch.dtype | None) -> "Mapper":
        """This map with its products run in `dtype` whatever the models run in (None: the target's dtype).

        Why: on a CPU with native bf16 products (AVX-512 BF16) a float32 handoff's map runs about 4x
        faster in bfloat16, and the map is a fixed cost that does not shrink with ρ. Its inputs and rows then
        round to bf16's 8 mantissa bits; on the bundled pair that adds 5% to the keys' row error (relative
        error 0.0405 -> 0.0425: the rows carry a large common part) and nothing measurable to the values'
        (research/scripts/map_dtype_error.py), so it is opt-in. Recomputed rows stay exact. The cast tensors are shared."""
        m = Mapper(self.info, self.sides, self.mlp)
        m._cast, m._views, m.compute_dtype = self._cast, self._views, dtype
        return m

    def plain(self) -> "Mapper":
        """The map as plain transfer applies it (a handoff that recomputes only the last position): the
        fit sharpened by `info.plain_sharpen` when the file records it, else this map. Exact from the
        stored tensors (sidefit.sharpen / unsharpen in float64), made once."""
        if not self.has_plain_view:
            return self
        if None not in self._views:
            info, powers = self.info, self.info.plain_sharpen
            if info.mlp_hidden or info.heads:
                raise RarecacheError("a plain-transfer sharpening needs a dense linear map")
            sides = {s: _resharpened(self.sides[s], info.sharpen.get(s, 0.0), powers.get(s, 0.0)) for s in SIDES}
            if not all(torch.isfinite(t).all() for f in sides.values() for t in (f.weight, f.bias, f.eigenvalues)):
                raise RarecacheError(f"this map's plain-transfer view ({info.direction}) is not finite: its r2 and "
                                     "sharpening powers do not fit together")
            self._views[None] = Mapper(replace(info, sharpen=_nonzero(powers),
                                               plain_sharpen=None, r2_heldout={}), sides)
        if self.compute_dtype not in self._views:
            self._views[self.compute_dtype] = self._views[None].computing_in(self.compute_dtype)
        return self._views[self.compute_dtype]

    @property
    def has_plain_view(self) -> bool:
        """Whether plain transfer maps with other sharpening than the stored fit's."""
        p = self.info.plain_sharpen
        return p is not None and _nonzero(p) != self.info.sharpen

    def at_rho(self, rho: float) -> "Mapper":
        """The fit a handoff at budget `rho` maps with: `plain` at rho 0, else this map (the one rule).
        Keyed on the requested budget: rho 0 asks for plain transfer (every handed-off row mapped, only the
        last position computed); any rho > 0 asks for recomputed positions, even where the budget rounds
        to the last position alone."""
        return self.plain() if rho == 0 else self

    def dtype_for(self, target: Runner) -> torch.dtype:
        """The dtype this map's products run in next to `target`."""
        return self.compute_dtype or target.dtype

    @property
    def needs_tokens(self) -> bool:
        """Whether applying this map reads the tokens (and the target's layer-0 weights)."""
        return self.info.token_inputs or self.info.exact_layer0

    @property
    def exact_layers(self) -> int:
        """Leading target layers whose rows are computed from the token, not mapped (0 or 1)."""
        return 1 if self.info.exact_layer0 else 0

    @property
    def extra_width(self) -> int:
        """Input columns each layer reads after its source rows: the token block (2·dt), or none."""
        return 2 * self.sides["k"].weight.shape[2] if self.info.token_inputs else 0

    def own_rows(self, target: Runner, tokens: torch.Tensor | None, positions: torch.Tensor
                 ) -> dict[str, torch.Tensor] | None:
        """The target's own layer-0 rows of `tokens` (B, T) at `positions` (B, T), per side (B, T, dt), when
        this map reads them (`needs_tokens`); None otherwise."""
        if not self.needs_tokens:
            return None
        if tokens is None or tuple(tokens.shape) != tuple(positions.shape):
            raise RarecacheError(f"this map ({self.info.direction}) reads the tokens it maps (token inputs or exact "
                                 f"layer 0): give tokens of the positions' shape {tuple(positions.shape)}")
        return token_rows(target, tokens)

    # -- file format -------------------------------------------------------------------

    def with_mlp(self, mlp: dict[str, SideMLP], hidden: int) -> "Mapper":
        """This ridge map plus residual MLPs (the nonlinear option): one fit for every budget (a plain-transfer
        sharpening, `plain_sharpen`, is for dense linear maps and is dropped)."""
        if self.info.token_inputs:
            raise RarecacheError("a token-input map takes no residual MLP (its MLP would not read the token block)")
        return Mapper(replace(self.info, mlp_hidden=hidden, plain_sharpen=None, refined=None), self.sides, mlp)

    def save(self, path: str | Path, weights: str | None = None) -> None:
        """`weights`: how the file stores the weights, float32 or bfloat16 (half the bytes; mapfile); by
        default as the map's own file did (`info.weights`)."""
        mapfile.write(self.info, self.sides, self.mlp, path, weights)

    @classmethod
    def load(cls, path: str | Path) -> "Mapper":
        """Read a map file and check it on its own (mapfile.read); `check_pair` then checks it against
        the models."""
        return cls(*mapfile.read(path))

    # -- its checks and summary (mapcheck.py) ----------------------------------------------

    def check_pair(self, source: Runner, target: Runner) -> None:
        """Refuse to run with models other than the ones this map was fitted for, or that its tensors do
        not fit (`check_fits`)."""
        mapcheck.check_identity(self.info, source, target)
        self.check_fits(source, target)

    def check_fits(self, source: Runner, target: Runner) -> None:
        mapcheck.check_fits(self.info, self.sides, self.extra_width, source, target)

    def check_corpus(self, corpus, name: str = "this map") -> None:
        mapcheck.check_corpus(self.info, corpus, name)

    def refined_ids(self) -> set[str]:
        return mapcheck.refined_ids(self.info)

    def fit_problems(self) -> list[str]:
        return mapcheck.fit_problems(self.info, self.sides)

    def check_fit(self, accept: bool = False, where: str = "this map") -> list[str]:
        return mapcheck.check_fit(self.info, self.sides, accept, where)

    def summary(self) -> str:
        return mapcheck.summary(self.info, self.sides, self.has_plain_view)

    # -- application ---------------------------------------------------------------------

    def tensors(self, side: str, dtype: torch.dtype, device) -> dict[str, Any]:
        """One side's tensors in `dtype` on `device` (cast once, then cached), and its source layers as
        Python lists (one per target layer)."""
        key = (side, dtype, str(device))
        if key not in self._cast:
            f = self.sides[side]
            self._cast[key] = {"sources": f.sources.to(device), "source_list": f.sources.tolist(),
                               **{n: getattr(f, n).to(device, dtype) for n in ("weight", "bias", "mean", "basis")}}
        return self._cast[key]

    def map_rows(self, side: str, x: torch.Tensor, extra: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """Source content rows x (B, T, Ls·ds) and, for a token-input map, the token block `extra`
        (B, T, 2·dt) -> target rows ŷ (Lt, B, T, dt) and centred z = ŷ − ȳ."""
        t = self.tensors(side, x.dtype, x.device)
        sources, weight, bias, mean = t["sources"], t["weight"], t["bias"], t["mean"]
        B, T, _ = x.shape
        Lt, kd, dt = weight.shape
        e = self.extra_width
        if (0 if extra is None else extra.shape[-1]) != e:
            raise ValueError(f"this map reads {e} token-input columns beside the source rows")
        kd -= e  # the source rows' part
        layers = x.reshape(B * T, -1, kd // self.info.k)  # (B·T, Ls, ds)
        y = torch.empty(Lt, B * T, dt, dtype=x.dtype, device=x.device)
        mlp = self.mlp[side] if self.mlp else None
        for l in range(Lt):  # one gather of whole source-layer rows and one matmul per target layer
            xl = layers.index_select(1, sources[l]).reshape(B * T, kd)
            if extra is not None:
                xl = torch.cat([xl, extra.reshape(B * T, e).to(x.dtype)], dim=1)  # (B·T, K·ds + 2·dt)
            torch.addmm(bias[l], xl, weight[l], out=y[l])
            if mlp is not None:
                y[l] += mlp.residual(l, xl)
        y = y.view(Lt, B, T, dt)
        return y, y - mean[:, None, None]

    def map_sides(self, x: dict[str, torch.Tensor], own: dict[str, torch.Tensor] | None = None
                  ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Both sides' `map_rows` of source rows x[side] (B, T, Ls·ds), reading the target's own layer-0
        rows `own` (`own_rows`) where the map does: side -> (ŷ, z), each (Lt, B, T, dt). The exact layers
        hold `own` rounded to the map's dtype (writers write `own` itself: `write_own`)."""
        extra = token_block(own) if self.info.token_inputs else None
        out = {}
        for side in SIDES:
            y, z = self.map_rows(side, x[side], extra)
            for l in range(self.exact_layers):  # the target's own rows, not a prediction
                y[l] = own[side]
                z[l] = y[l] - self.tensors(side, y.dtype, y.device)["mean"][l]
            out[side] = (y, z)
        return out

    def write_own(self, target, cache: KVCache, positions: torch.Tensor, own: dict[str, torch.Tensor] | None,
                  cols: slice = slice(None)) -> None:
        """Write the exact layers' rows `own` (B, T, dt) into `cache` at the target's precision (columns
        `cols` of each row: a tensor-parallel rank's heads)."""
        if self.exact_layers:
            write_rows(target, cache, positions, own["k"][None][..., cols], own["v"][None][..., cols])

    @torch.inference_mode()
    def apply(self, source: Runner, source_cache: KVCache, target: Runner, target_cache: KVCache,
              positions: torch.Tensor, dtype: torch.dtype | None = None, tokens: torch.Tensor | None = None
              ) -> dict[str, torch.Tensor]:
        """Map the source cache at positions (B, T) into the target cache (all layers, slots filled);
        `tokens` (B, T), the tokens at those positions, are read by maps that `needs_tokens`.

        Returns the centred predictions z per side, (Lt, B, T, dt), for scoring. One pass per target
        layer (`transfer.fused`); equal to `apply_reference` (tested)."""
        centred, _ = map_into(self, source, source_cache, target, target_cache, positions,
                              dtype or self.dtype_for(target), centred=True,
                              own=self.own_rows(target, tokens, positions))
        return centred

    @torch.inference_mode()
    def apply_scored(self, source: Runner, source_cache: KVCache, target: Runner, target_cache: KVCache,
                     positions: torch.Tensor, dtype: torch.dtype | None = None, rank: bool = True,
                     tokens: torch.Tensor | None = None) -> torch.Tensor | None:
        """`apply` keeping only what a handoff's selector reads: the rank-disagreement score (B, T) when
        `rank` (equal to `rank_scores` of `apply`'s output), else nothing (None)."""
        return map_into(self, source, source_cache, target, target_cache, positions,
                        dtype or self.dtype_for(target), rank=rank, own=self.own_rows(target, tokens, positions))[1]

    @torch.inference_mode()
    def apply_reference(self, source: Runner, source_cache: KVCache, target: Runner, target_cache: KVCache,
                        positions: torch.Tensor, dtype: torch.dtype | None = None,
                        tokens: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """The plain pipeline `apply` replaces, kept as its reference: every step over all layers at once."""
        dtype = dtype or self.dtype_for(target)
        own = self.own_rows(target, tokens, positions)
        x = {side: rows(source, source_cache, positions, side).to(dtype) for side in SIDES}  # de-rotated once
        out = self.map_sides(x, own)
        write_rows(target, target_cache, positions, out["k"][0], out["v"][0])
        self.write_own(target, target_cache, positions, own)
        return {side: z for side, (_, z) in out.items()}


def rank_scores(mapper: Mapper, centred: dict[str, torch.Tensor]) -> torch.Tensor:
    """Rank disagreement s = Σ over target layers and sides of ‖z‖² − ‖z V_r‖², per position (B, W),
    z the map's centred outputs (`centred`, per side). Layers computed exactly (`Mapper.exact_layers`) carry
    no map error and are left out."""
    total = 0
    first = mapper.exact_layers
    for side, zs in centred.items():  # zs (Lt, B, W, dt)
        zs = zs[first:]
        Lt, B, W, dt = zs.shape
        basis = mapper.sides[side].basis[first:].to(zs.device, zs.dtype)  # (Lt, dt, r)
        acc = torch.promote_types(zs.dtype, torch.float32)  # norms accumulate in at least float32
        proj = torch.bmm(zs.reshape(Lt, B * W, dt), basis)  # (Lt, B·W, r), in the map's dtype
        energy = torch.linalg.vector_norm(zs, dim=-1, dtype=acc).square()  # (Lt, B, W)
        inside = torch.linalg.vector_norm(proj, dim=-1, dtype=acc).square().view(Lt, B, W)
        total = total + (energy - inside).sum(0)
    return total


def _nonzero(powers: dict[str, float]) -> dict[str, float]:
    """Sharpening powers as `MapInfo.sharpen` records them: the sides actually sharpened."""
    return {s: p for s, p in powers.items() if p}


def _resharpened(fit: SideFit, stored: float, power: float) -> SideFit:
    """A side's fit with its sharpening power changed from `stored` to `power` (computed in float64)."""
    names = [f.name for f in fields(SideFit)]
    t = {n: getattr(fit, n) for n in names}
    out = sharpen(unsharpen(SideFit(**{n: v.double() if v.is_floating_point() else v for n, v in t.items()}),
                            stored), power)
    return SideFit(**{n: getattr(out, n).to(t[n].dtype) for n in names})
