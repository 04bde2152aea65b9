"""A map held against what it meets: the two models (identity, then shapes), the text a step trains it on
again, the task prompts a refinement read, and its own fit; and the summary that prints its record.

Apart from applying a map (mapper.py) because none of this touches a cache: it reads a map's record
(`MapInfo`) and its fitted sides, and refuses what does not belong together with a message naming both.
A map file names the source and target it was fitted for; loading it against another pair, or the other
way round, is refused. `check_identity` compares the models' config and weight fingerprints with the
record's, `check_fits` the map's tensors with the models' shapes; `Mapper.check_pair` runs both, and
every path that runs a map calls it first. `Mapper`'s methods of the same names delegate here.
"""

from __future__ import annotations

from ..engine.runner import Runner
from ..errors import RarecacheError
from ..models.loader import checkpoint_fingerprint
from .mapfile import MapInfo
from .sidefit import SideFit

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


def check_identity(info: MapInfo, source: Runner, target: Runner) -> None:
    """Refuse models other than the ones the map was fitted for, naming the direction it runs when they
    are the same pair the other way round."""
    got_s, got_t = identity(source), identity(target)
    want_s, want_t = info.source, info.target

    def same(a, b):
        return a["config"] == b["config"] and a["weights"] == b["weights"]

    if same(got_s, want_s) and same(got_t, want_t):
        return
    if same(got_s, want_t) and same(got_t, want_s):
        raise RarecacheError(f"this map runs {info.direction}; you asked for "
                             f"{got_s['name']} -> {got_t['name']}: fit a map in that direction")
    raise RarecacheError(f"this map was fitted for {info.direction} "
                         f"(configs {want_s['config']}/{want_t['config']}, weights {want_s['weights']}/"
                         f"{want_t['weights']}), not for {got_s['name']} -> {got_t['name']} "
                         f"(configs {got_s['config']}/{got_t['config']}, weights {got_s['weights']}/"
                         f"{got_t['weights']})")


def check_fits(info: MapInfo, sides: dict[str, SideFit], extra_width: int, source: Runner, target: Runner) -> None:
    """Refuse a map whose tensors do not fit these models: target layers, target row width, source
    layers and source row width (what `Mapper.map_rows` and `apply` rely on). `extra_width`: the input
    columns each layer reads after its source rows (`Mapper.extra_width`)."""
    cs, ct, k = source.config, target.config, info.k
    if info.heads and not info.heads == cs.num_kv_heads == ct.num_kv_heads:
        raise RarecacheError(f"this map is head-matched over {info.heads} KV heads; {_name(source)} has "
                             f"{cs.num_kv_heads} and {_name(target)} {ct.num_kv_heads}")
    want = (ct.num_layers, ct.kv_dim, k * cs.kv_dim, cs.num_layers)
    for s, fit in sides.items():
        (lt, kd, dt), ls = fit.weight.shape, fit.r2_single.shape[1]
        kd -= extra_width
        if (lt, dt, kd, ls) != want:
            raise RarecacheError(
                f"this map ({info.direction}) does not fit {_name(source)} -> {_name(target)}: its {s} "
                f"side has {lt} target layers with rows {dt} wide, read from {ls} source layers in rows "
                f"{kd // k} wide; these models have {want[0]} target layers with rows {want[1]} wide and "
                f"{want[3]} source layers with rows {cs.kv_dim} wide")


def check_corpus(info: MapInfo, corpus, name: str = "this map") -> None:
    """Refuse text other than the map's own calibration text (`corpus.Corpus`, by fingerprint): what the
    steps that train on it again (`mlp`, `refine`) must read."""
    want = info.corpus.get("fingerprint")
    if corpus.fingerprint != want:
        raise RarecacheError(f"{name} was calibrated on {info.corpus.get('name')} (fingerprint {want}), not "
                             f"on {corpus.name} ({corpus.fingerprint}{', chat' if corpus.chat else ''}): give "
                             "the map's own calibration text")


def refined_ids(info: MapInfo) -> set[str]:
    """Ids of the task prompts a refinement trained or chose its step on (`refine --prompts`; the record's
    form is checked on loading): an evaluation refuses the map on any of them (`Task.check_map`)."""
    return {i for p in (info.refined or {}).get("prompts", {}).values() for i in p["ids"]}


def fit_problems(info: MapInfo, sides: dict[str, SideFit]) -> list[str]:
    """Why a map fits badly, from its own record (POOR_R2, POOR_GAP); empty when it does not, or when
    no held-out R² was measured (`calibrate --heldout-tokens 0`)."""
    out = []
    for side, name in (("k", "keys"), ("v", "values")):
        held = info.r2_heldout.get(side)
        if not held:
            continue
        h, r = sum(held) / len(held), float(sides[side].r2.mean())
        if h < POOR_R2:
            out.append(f"held-out R2 of the {name} is {h:.3f} (below {POOR_R2})")
        elif r - h > POOR_GAP:
            out.append(f"held-out R2 of the {name} is {r - h:.3f} below in-sample ({h:.3f} vs {r:.3f}; more "
                       f"than {POOR_GAP})")
    return out


def check_fit(info: MapInfo, sides: dict[str, SideFit], accept: bool = False, where: str = "this map") -> list[str]:
    """Refuse a map that fits badly (`fit_problems`) unless `accept`; returns the problems accepted."""
    problems = fit_problems(info, sides)
    if problems and not accept:
        raise RarecacheError(f"{where} fits badly: {'; '.join(problems)}; calibrate on more text, or serve it "
                             "anyway with --accept-poor-map (accept_poor_map)")
    return problems


def summary(info: MapInfo, sides: dict[str, SideFit], has_plain_view: bool) -> str:
    """Direction, fitting choices, corpus and R2 per side (in-sample ridge's, and held out of the map as
    served when measured); `has_plain_view`: plain transfer maps with its own sharpening (`Mapper.plain`)."""
    i = info
    kind = ("head-matched " if i.heads else "") + "ridge" + (f" + MLP {i.mlp_hidden}" if i.mlp_hidden else "")
    kind += " + token inputs" if i.token_inputs else ""
    kind += ", layer 0 exact" if i.exact_layer0 else ""
    if i.sharpen:
        kind += ", sharpened " + " ".join(f"{s}:R2^-{p:g}" for s, p in i.sharpen.items())
    if has_plain_view:
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
        r2 = sides[side].r2
        held = i.r2_heldout.get(side)
        lines.append(f"  R2 {name:6s} mean {r2.mean():.4f} (min {r2.min():.4f}, max {r2.max():.4f})"
                     + (f"   held-out mean {sum(held) / len(held):.4f}" if held else ""))
    return "\n".join(lines)


def _name(runner: Runner) -> str:
    return runner.path.name if runner.path else "unnamed"
