"""Fitting a map again without a pass over data: `refit` from the statistics a calibration kept
(`calibrate --keep-state`), with other k, lambda, rank, head matching or sharpening; `resharpen` from the
map alone. Both are seconds where calibration is an hour, which is why fitting choices are tried this way."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from ...errors import RarecacheError
from ..features import SIDES
from ..mapper import Mapper
from ..sidefit import Layout, sharpen, unsharpen
from .calibrate import check_sharpen, fit_sides, read_state, sharpen_info, stat_names
from .fit import head_stats, matched_heads
from .stats import RegressionStats


def refit(mapper: Mapper, state: Path, k: int | None = None, lam: float | None = None, rank: int | None = None,
          head_matched: bool = False, powers: tuple[float, float] | None = None) -> Mapper:
    """The map fitted again from the statistics its calibration kept (`calibrate --keep-state`), with other
    fitting choices: k, λ, rank, or head-matched (a dense state holds every head block, `fit.head_stats`,
    so the head-matched map of the very same positions costs no pass over data), or sharpening (`powers`,
keys' and values'; None keeps the map's). Plain transfer's sharpening (`MapInfo.plain_sharpen`) is kept,
except by a head-matched refit, which has none. Seconds, not hours."""
    meta, tensors = read_state(state)
    run, info = meta["run"], mapper.info
    if run.get("source") != info.source or run.get("target") != info.target:
        raise RarecacheError(f"{state} is the state of another pair's calibration, not of {info.direction}")
    heads = 0
    if "fit.k.h0.xx" in tensors:
        heads = sum(1 for n in tensors if n.startswith("fit.k.h") and n.endswith(".xx"))
        if not head_matched:
            raise RarecacheError(f"{state} holds head-matched statistics: it refits head-matched maps only "
                                 "(pass --head-matched)")
    names = [n for part in ("fit", "heldout") for s in SIDES for n in stat_names(part, s, heads)]
    try:
        stats = {n: RegressionStats.from_tensors(tensors, n) for n in names}
    except KeyError as e:
        raise RarecacheError(f"{state} lacks statistics {e}") from None
    if stats[names[0]].n != info.tokens:
        raise RarecacheError(f"{state} holds {stats[names[0]].n} fit positions, the map {info.tokens}: "
                             "not the state this map was fitted from")
    if bool(run.get("config", {}).get("token_inputs", False)) != info.token_inputs:
        raise RarecacheError(f"{state} and the map disagree on token inputs: not the state this map was fitted from")
    weighted = (run.get("config", {}).get("attention_weights") or 0.0,
                (info.calibration.get("attention_weights") or {}).get("power", 0.0))
    if weighted[0] != weighted[1]:
        raise RarecacheError(f"{state} and the map disagree on attention weights ({weighted[0]} vs {weighted[1]}): "
                             "not the state this map was fitted from")
    if head_matched and info.token_inputs:
        raise RarecacheError("a token-input map has no head-matched refit (its token block spans every head)")
    fit = mapper.sides["k"]
    src = Layout(fit.r2_single.shape[1], (fit.weight.shape[1] - mapper.extra_width) // info.k, mapper.extra_width)
    tgt = Layout(fit.weight.shape[0], fit.weight.shape[2])
    if head_matched and not heads:
        heads = info.heads or _heads_of(run)
        for part in ("fit", "heldout"):
            for s in SIDES:
                for h, block in enumerate(head_stats(stats.pop(f"{part}.{s}"), src, tgt, heads)):
                    stats[f"{part}.{s}.h{h}"] = block
    k, lam, rank = k or info.k, info.lam if lam is None else lam, info.rank if rank is None else rank
    if rank > tgt.width or k < 1 or lam < 0:
        raise RarecacheError(f"refit needs k >= 1, lambda >= 0 and rank <= {tgt.width}")
    if powers is None:
        powers = tuple(info.sharpen.get(s, 0.0) for s in SIDES)
    check_sharpen(powers)
    sides, r2_held = fit_sides(stats, src, tgt, heads, k, lam, rank, powers)
    return Mapper(replace(info, k=min(k, src.layers), lam=lam, rank=rank, r2_heldout=r2_held, heads=heads,
                          mlp_hidden=0, sharpen=sharpen_info(powers), refined=None,
                          plain_sharpen=None if heads else info.plain_sharpen), sides)


def resharpen(mapper: Mapper, powers: tuple[float, float]) -> Mapper:
    """The map with other sharpening powers, from the map alone (no statistics): sharpening scales each
    layer's centred prediction by a known factor (sidefit.sharpen), so it is undone and redone exactly.
    The recorded held-out R² belonged to the old predictions and is dropped (`calibrate --keep-state`
    and `refit` give it again). Dense linear maps only."""
    info = mapper.info
    if info.heads or info.mlp_hidden:
        raise RarecacheError("changing the sharpening without the calibration state works on dense linear maps "
                             "only; refit from the state (calibrate --keep-state)")
    check_sharpen(powers)
    sides = {s: sharpen(unsharpen(mapper.sides[s], info.sharpen.get(s, 0.0)), p) for s, p in zip(SIDES, powers)}
    return Mapper(replace(info, r2_heldout={}, sharpen=sharpen_info(powers), refined=None), sides)  # (new weights)


def _heads_of(run: dict) -> int:
    """The KV heads of a dense state's models, if a head-matched refit can split them."""
    heads = run.get("kv_heads")
    if not (isinstance(heads, list) and len(heads) == 2 and all(isinstance(h, int) for h in heads)):
        raise RarecacheError("this calibration state does not record the models' KV heads (it was written "
                             "before head-matched maps): calibrate again with --head-matched")
    return matched_heads(*heads)
