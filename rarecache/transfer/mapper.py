"""A fitted cross-model KV map: identity and application (its file format: mapfile.py).

A map file names the source and target it was fitted for; loading it against another pair, or the
other way round, is refused with a message naming both. `load` checks the file on its own
(mapfile.read); `check_pair` checks it against the two models (identity, then `check_fits`: layer
counts, row widths, source-layer indices). Every path that runs a map calls `check_pair` first.

One file serves every budget. Plain transfer (nothing recomputed but the last position) and a
handoff that recomputes part of the prompt want different fits of the same statistics: with every
key mapped, ridge's shrunken keys give the target flatter attention than its own, and sharpening
them (fit.py) helps; next to exact recomputed rows the sharpened mapped rows pull attention away
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
from ..models.loader import checkpoint_fingerprint
from . import mapfile
from .features import SIDES, rows, token_block, token_rows, write_rows
from .fused import map_into
from .mapfile import MapInfo
from .sidefit import SideFit, SideMLP, sharpen, unsharpen

# A map fits badly (`fit_problems`) when, on either side, its mean held-out R² is below POOR_R2 (it predicts
# little of the target's rows: a 2k-token calibration's values reach -0.006) or more than POOR_GAP below its
# in-sample R² (it learnt its calibration text, not the pair). The committed general maps pass with room.
POOR_R2 = 0.2
POOR_GAP = 0.15


def identity(runner: Runner) -> dict[str, str]:
    """Who a model is, for tying maps to it: name, architecture hash, weight fingerprint."""
    path = runner.path
    return {"name": path.name if path else "unnamed", "config": runner.config.fingerprint(),
            "weights": checkpoint_fingerprint(path) if path else "unknown"}


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



    def check_fits(self, source: Runner, target: Runner) -> None:
        """Refuse a map whose tensors do not fit these models: target layers, target row width, source
        layers and source row width (what `map_rows` and `apply` rely on)."""
        cs, ct, k = source.config, target.config, self.info.k
        if self.info.heads and not self.info.heads == cs.num_kv_heads == ct.num_kv_heads:
            raise RarecacheError(f"this map is head-matched over {self.info.heads} KV heads; {_name(source)} has "
                                 f"{cs.num_kv_heads} and {_name(target)} {ct.num_kv_heads}")
        want = (ct.num_layers, ct.kv_dim, k * cs.kv_dim, cs.num_layers)
        for s, fit in self.sides.items():
            (lt, kd, dt), ls = fit.weight.shape, fit.r2_single.shape[1]
            kd -= self.extra_width
            if (lt, dt, kd, ls) != want:
                raise RarecacheError(
                    f"this map ({self.info.direction}) does not fit {_name(source)} -> {_name(target)}: its {s} "
                    f"side has {lt} target layers with rows {dt} wide, read from {ls} source layers in rows "
                    f"{kd // k} wide; these models have {want[0]} target layers with rows {want[1]} wide and "
                    f"{want[3]} source layers with rows {cs.kv_dim} wide")

    # -- identity ------------------------------------------------------------------------

    def check_pair(self, source: Runner, target: Runner) -> None:
        """Refuse to run with models other than the ones this map was fitted for, or that its tensors do
        not fit (`check_fits`)."""
        got_s, got_t = identity(source), identity(target)
        want_s, want_t = self.info.source, self.info.target

        def same(a, b):
            return a["config"] == b["config"] and a["weights"] == b["weights"]

        if same(got_s, want_s) and same(got_t, want_t):
            self.check_fits(source, target)
            return
        if same(got_s, want_t) and same(got_t, want_s):
            raise RarecacheError(f"this map runs {self.info.direction}; you asked for "
                                 f"{got_s['name']} -> {got_t['name']}: fit a map in that direction")
        raise RarecacheError(f"this map was fitted for {self.info.direction} "
                             f"(configs {want_s['config']}/{want_t['config']}, weights {want_s['weights']}/"
                             f"{want_t['weights']}), not for {got_s['name']} -> {got_t['name']} "
                             f"(configs {got_s['config']}/{got_t['config']}, weights {got_s['weights']}/"
                             f"{got_t['weights']})")

    def check_corpus(self, corpus, name: str = "this map") -> None:
        """Refuse text other than this map's own calibration text (`corpus.Corpus`, by fingerprint): what the
        steps that train on it again (`mlp`, `refine`) must read."""
        want = self.info.corpus.get("fingerprint")
        if corpus.fingerprint != want:
            raise RarecacheError(f"{name} was calibrated on {self.info.corpus.get('name')} (fingerprint {want}), not "
                                 f"on {corpus.name} ({corpus.fingerprint}{', chat' if corpus.chat else ''}): give "
                                 "the map's own calibration text")

    def refined_ids(self) -> set[str]:
        """Ids of the task prompts a refinement trained or chose its step on (`refine --prompts`; the record's
        form is checked on loading): an evaluation refuses the map on any of them (`Task.check_map`)."""
        return {i for p in (self.info.refined or {}).get("prompts", {}).values() for i in p["ids"]}

    def fit_problems(self) -> list[str]:
        """Why this map fits badly, from its own record (POOR_R2, POOR_GAP); empty when it does not, or when
        no held-out R² was measured (`calibrate --heldout-tokens 0`)."""
        out = []
        for side, name in (("k", "keys"), ("v", "values")):
            held = self.info.r2_heldout.get(side)
            if not held:
                continue
            h, r = sum(held) / len(held), float(self.sides[side].r2.mean())
            if h < POOR_R2:
                out.append(f"held-out R2 of the {name} is {h:.3f} (below {POOR_R2})")
            elif r - h > POOR_GAP:
                out.append(f"held-out R2 of the {name} is {r - h:.3f} below in-sample ({h:.3f} vs {r:.3f}; more "
                           f"than {POOR_GAP})")
        return out

    def check_fit(self, accept: bool = False, where: str = "this map") -> list[str]:
        """Refuse a map that fits badly (`fit_problems`) unless `accept`; returns the problems accepted."""
        problems = self.fit_problems()
        if problems and not accept:
            raise RarecacheError(f"{where} fits badly: {'; '.join(problems)}; calibrate on more text, or serve it "
                                 "anyway with --accept-poor-map (accept_poor_map)")
        return problems

    def summary(self) -> str:
        """Direction, fitting choices, corpus and R2 per side (in-sample ridge's, and held out of the map as
        served when measured)."""
        i = self.info
        kind = ("head-matched " if i.heads else "") + "ridge" + (f" + MLP {i.mlp_hidden}" if i.mlp_hidden else "")
        kind += " + token inputs" if i.token_inputs else ""
        kind += ", layer 0 exact" if i.exact_layer0 else ""
        if i.sharpen:
            kind += ", sharpened " + " ".join(f"{s}:R2^-{p:g}" for s, p in i.sharpen.items())
        if self.has_plain_view:
            kind += "; plain transfer (rho 0) " + (" ".join(f"{s}:R2^-{p:g}" for s, p in i.plain_sharpen.items() if p)
                                                   or "unsharpened")
        lines = [f"map {i.direction}: {kind}, "
                 f"k={i.k} lambda={i.lam} rank={i.rank} tokens={i.tokens} "
                 f"corpus={i.corpus.get('name')} ({i.corpus.get('documents')} docs, "
                 f"{i.calibration.get('documents_used')} used)"]
        if i.refined:
            r = i.refined
            lines.append(f"  refined on the target's next-token KL: held-out {r.get('heldout_kl_before', float('nan')):.4f}"
                         f" -> {r.get('heldout_kl', float('nan')):.4f} nats (step {r.get('kept_step')} of "
                         f"{r.get('steps')}); R2 below is the closed-form fit's")
            if r.get("prompts"):
                lines.append("  refined also on task prompts: " + ", ".join(
                    f"{n} ({len(p['ids'])} read)" for n, p in sorted(r["prompts"].items())))
        for side, name in (("k", "keys"), ("v", "values")):
            r2 = self.sides[side].r2
            held = i.r2_heldout.get(side)
            lines.append(f"  R2 {name:6s} mean {r2.mean():.4f} (min {r2.min():.4f}, max {r2.max():.4f})"
                         + (f"   held-out mean {sum(held) / len(held):.4f}" if held else ""))
        return "\n".join(lines)

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
        `rank` (equal to `selectors.rank_scores` of `apply`'s output), else nothing (None)."""
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


def _name(runner: Runner) -> str:
    return runner.path.name if runner.path else "unnamed"

