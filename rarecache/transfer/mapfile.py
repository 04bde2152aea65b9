"""The map file: safetensors (data only, no pickle) with JSON metadata (`MapInfo`) naming the source and
target (config and weight fingerprints), the direction and every fitting choice.

A map file is untrusted input: a bad one must be refused, never answer garbage or end in a traceback.
`read` checks what the file alone can show (metadata types, tensor dtypes and shapes against each other,
every value finite, and the sha256 of the tensor data that `write` records, so a flipped bit is caught;
files written before the checksum load without it); `Mapper.check_pair` checks it against the two models.
`write` never writes what `read` refuses, and leaves optional fields out when they are off, so files
without them stay byte-identical to earlier ones.

A file may store its weights (the ridge weights and an MLP's matrices, nearly all of its bytes) in bfloat16
(`write(..., weights="bfloat16")`, recorded as `MapInfo.weights`, which a map made from it keeps): half the
bytes. `read` turns every floating tensor into float32, so the code past it sees one dtype. A handoff run in
bfloat16 casts the stored fit's weights to bfloat16 anyway, so it maps the same rows from either file
(tested); a float32 handoff, and plain transfer through a map's plain view (re-sharpened from the stored
weights before the cast), see the rounding.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ..errors import RarecacheError
from .features import SIDES
from .sidefit import SideFit, SideMLP, from_head_blocks, head_blocks

FORMAT_VERSION = 1
_META_KEY = "rarecache.map"
_SUM_KEY = "rarecache.map.sha256"  # of the tensor data, beside the metadata (older files lack it)
_TENSORS = ("sources", "weight", "bias", "mean", "basis", "eigenvalues", "r2", "r2_single")
_MLP = ("w1", "b1", "w2", "b2")
WEIGHT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # how `write` may store the weights
_WEIGHTS = ("weight", "mlp.w1", "mlp.w2")
_OPTIONAL = (("plain_sharpen", None), ("token_inputs", False), ("exact_layer0", False), ("refined", None),
             ("weights", "float32"))  # (field, left out when)


def _is_weight(name: str) -> bool:
    """A tensor `write` may store in bfloat16 ("k.weight", "v.mlp.w1", ...)."""
    return name.split(".", 1)[-1] in _WEIGHTS


def partial_path(path: Path) -> Path:
    """Where a file is written before it is renamed into place (and what a killed write leaves)."""
    return path.with_name(path.name + ".partial")


def canonical_header(path: Path) -> None:
    """Rewrite a safetensors file's metadata in key order, in place. safetensors writes it from a hash map
    whose order changes from one process to the next, so the same map would get another sha256 each time it
    is saved (and a result file, which names its map by sha256, would no longer match its map). Same bytes
    otherwise: the reordered header is as long as the old one (padded with spaces, as safetensors pads)."""
    with open(path, "r+b") as f:
        n = int.from_bytes(f.read(8), "little")
        head = json.loads(f.read(n))
        meta = head.pop("__metadata__", None)
        if not meta:
            return
        raw = json.dumps({"__metadata__": dict(sorted(meta.items())), **head}, separators=(",", ":")).encode()
        if len(raw) > n:  # (not the compact JSON safetensors writes): leave the file as it is
            return
        f.seek(8)
        f.write(raw.ljust(n, b" "))


def tensors_sha256(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over the tensors' names, dtypes, shapes and bytes, in name order."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}\n".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


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
    mlp_hidden: int = 0  # > 0: ridge + a residual MLP of this width per target layer and side (transfer/fitting/mlp.py)
    heads: int = 0  # > 0: head-matched with this many KV heads (fit.py); the file keeps the weight's head blocks
    sharpen: dict[str, float] = field(default_factory=dict)  # side -> power p: predictions scaled by R²^-p (sidefit.py)
    plain_sharpen: dict[str, float] | None = None  # side -> power plain transfer (rho 0) uses; None: `sharpen`
    token_inputs: bool = False  # every layer also reads the target's own layer-0 K, V rows of the token
    exact_layer0: bool = False  # the target's layer-0 rows computed from the token, not mapped
    refined: dict[str, Any] | None = None  # the output-aware refinement's record (fitting/refine.py), when refined
    weights: str = "float32"  # how the file stores its weights (WEIGHT_DTYPES); what a new file of it keeps

    @property
    def direction(self) -> str:
        return f"{self.source['name']} -> {self.target['name']}"


def write(info: MapInfo, sides: dict[str, SideFit], mlp: dict[str, SideMLP] | None, path: str | Path,
          weights: str | None = None) -> None:
    """Write a map file atomically (through `partial_path`), its metadata in key order (`canonical_header`);
    `weights`: the weights' storage dtype (WEIGHT_DTYPES; the module docstring), by default `info.weights`:
    a map made from a bf16 file stays bf16."""
    weights = info.weights if weights is None else weights
    if weights not in WEIGHT_DTYPES:
        raise RarecacheError(f"a map stores its weights as {' or '.join(WEIGHT_DTYPES)}, not {weights!r}")
    info = replace(info, weights=weights)
    tensors = {f"{s}.{name}": getattr(sides[s], name).contiguous() for s in SIDES for name in _TENSORS}
    if info.heads:  # only the blocks: the rest of a head-matched weight is zero by construction
        tensors.update({f"{s}.weight": head_blocks(sides[s].weight, info.k, info.heads)
                        for s in SIDES})
    if mlp:
        tensors.update({k: v.contiguous() for s in SIDES for k, v in mlp[s].tensors(s).items()})
    tensors = {k: (v.float() if v.is_floating_point() else v.long()) for k, v in tensors.items()}
    tensors.update({k: v.to(WEIGHT_DTYPES[weights]) for k, v in tensors.items() if _is_weight(k)})
    try:  # what `read` refuses is never written
        check_info(info)
    except TypeError as e:
        raise RarecacheError(f"not writing {path}: the map's metadata is invalid ({e})") from None
    meta = {f.name: getattr(info, f.name) for f in fields(MapInfo)}
    for name, off in _OPTIONAL:
        if meta[name] is off or isinstance(off, str) and meta[name] == off:  # left out: files without it stay
            # byte-identical to earlier ones
            del meta[name]
    path = Path(path)
    tmp = partial_path(path)
    save_file(tensors, str(tmp), metadata={_META_KEY: json.dumps(meta), _SUM_KEY: tensors_sha256(tensors)})
    canonical_header(tmp)
    tmp.chmod(0o644)  # safetensors writes 0600; a map is meant to be shared
    tmp.replace(path)


def read(path: str | Path) -> tuple[MapInfo, dict[str, SideFit], dict[str, SideMLP] | None]:
    """A map file's metadata, fits and MLPs, checked on their own (the module docstring);
    `Mapper.check_pair` then checks them against the models."""
    path = Path(path)
    if not path.is_file():
        raise RarecacheError(f"no map file {path}")
    try:
        with safe_open(str(path), framework="pt") as f:
            header = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (OSError, SafetensorError, ValueError, TypeError, RuntimeError) as e:
        raise RarecacheError(f"{path} is not a map file: {e}") from None
    try:
        meta = json.loads(header.get(_META_KEY))
        if not isinstance(meta, dict):
            raise TypeError("the metadata is not a JSON object")
        if meta.get("format_version") != FORMAT_VERSION:
            raise RarecacheError(f"{path}: map format {meta.get('format_version')!r}, "
                                 f"this rarecache reads {FORMAT_VERSION}")
        info = MapInfo(**meta)
        check_info(info)
    except (TypeError, ValueError, OverflowError) as e:  # (OverflowError: an integer too big for a float)
        raise RarecacheError(f"{path} has no valid rarecache map metadata ({e})") from None
    want = header.get(_SUM_KEY)
    if want is not None and tensors_sha256(tensors) != want:
        raise RarecacheError(f"{path} is damaged: its tensor data does not match its sha256 checksum")
    stored = {str(v.dtype).removeprefix("torch.") for k, v in tensors.items() if _is_weight(k)}
    if stored - {info.weights}:
        raise RarecacheError(f"{path}: its metadata says the weights are stored as {info.weights}, and its "
                             f"tensors hold {', '.join(sorted(stored))}")
    tensors = {k: (v.float() if v.is_floating_point() else v) for k, v in tensors.items()}  # (bf16 weights too)
    missing = sorted({f"{s}.{n}" for s in SIDES for n in _TENSORS} - set(tensors))
    if missing:
        raise RarecacheError(f"{path} lacks tensor(s) {', '.join(missing)}")
    if info.heads:
        for s in SIDES:
            w = tensors[f"{s}.weight"]
            if w.dim() != 4 or w.shape[1] != info.heads or w.shape[2] % info.k or not w.is_floating_point():
                raise RarecacheError(f"{path}: {s}.weight of a head-matched map must be float head blocks "
                                     f"(layers, {info.heads} heads, k·source width, target width); it has "
                                     f"shape {tuple(w.shape)}")
            tensors[f"{s}.weight"] = from_head_blocks(w, info.k)
    sides = {s: SideFit(**{n: tensors[f"{s}.{n}"] for n in _TENSORS}) for s in SIDES}
    mlp = None
    if info.mlp_hidden:
        names = sorted({f"{s}.mlp.{n}" for s in SIDES for n in _MLP} - set(tensors))
        if names:
            raise RarecacheError(f"{path} lacks tensor(s) {', '.join(names)}")
        mlp = {s: SideMLP(*(tensors[f"{s}.mlp.{n}"] for n in _MLP)) for s in SIDES}
    validate(info, sides, mlp, path)
    return info, sides, mlp


def validate(info: MapInfo, sides: dict[str, SideFit], mlp: dict[str, SideMLP] | None, where: Path | str) -> None:
    """The tensors agree with each other and with the metadata: dtypes, shapes, finite values, and
    source-layer indices within the source layers the file scores (r2_single)."""
    k, rank = info.k, info.rank
    for s, fit in sides.items():
        for name in _TENSORS:
            t = getattr(fit, name)
            if name == "sources":
                if t.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
                    raise RarecacheError(f"{where}: {s}.sources has dtype {t.dtype}, expected integers")
            elif not t.is_floating_point():
                raise RarecacheError(f"{where}: {s}.{name} has dtype {t.dtype}, expected floating point")
            elif not torch.isfinite(t).all():
                raise RarecacheError(f"{where}: {s}.{name} holds values that are not finite (NaN or inf)")
        if fit.weight.dim() != 3 or fit.r2_single.dim() != 2:
            raise RarecacheError(f"{where}: {s}.weight or {s}.r2_single has the wrong number of dimensions")
        lt, kd, dt = fit.weight.shape
        ls = fit.r2_single.shape[1]
        kd -= 2 * dt if info.token_inputs else 0  # the source rows' part
        shapes = {"sources": (lt, k), "bias": (lt, dt), "mean": (lt, dt), "basis": (lt, dt, rank),
                  "eigenvalues": (lt, dt), "r2": (lt,), "r2_single": (lt, ls)}
        for name, shape in shapes.items():
            if tuple(getattr(fit, name).shape) != shape:
                raise RarecacheError(f"{where}: {s}.{name} has shape {tuple(getattr(fit, name).shape)}, "
                                     f"expected {shape}")
        if lt < 1 or dt < 1 or kd < 1 or kd % k or rank > dt or k > ls:
            raise RarecacheError(f"{where}: {s}.weight has shape {(lt, kd, dt)}, which does not fit "
                                 f"k={k} of {ls} source layers and rank {rank}")
        if (info.sharpen or info.plain_sharpen) and bool((fit.r2 > 1 + 1e-6).any()):
            raise RarecacheError(f"{where}: {s}.r2 holds values above 1, which sharpening cannot scale by")
        src = fit.sources.long()
        if len(src) and (src.min() < 0 or src.max() >= ls):
            raise RarecacheError(f"{where}: {s}.sources names a source layer outside 0..{ls - 1}")
        fit.sources = src
    for s, m in (mlp or {}).items():
        lt, kd, dt = sides[s].weight.shape
        h = info.mlp_hidden
        for name, shape in {"w1": (lt, kd, h), "b1": (lt, h), "w2": (lt, h, dt), "b2": (lt, dt)}.items():
            t = getattr(m, name)
            if tuple(t.shape) != shape or not t.is_floating_point() or not torch.isfinite(t).all():
                raise RarecacheError(f"{where}: {s}.mlp.{name} is not a finite float tensor of shape {shape}")
    if info.r2_heldout and any(len(v) != sides["k"].weight.shape[0]
                                    for v in info.r2_heldout.values()):
        raise RarecacheError(f"{where}: r2_heldout does not have one value per target layer")
    if info.token_inputs and sides["k"].weight.shape[2] != sides["v"].weight.shape[2]:
        raise RarecacheError(f"{where}: a token-input map's sides must write rows of one width")


def check_info(info: MapInfo) -> None:
    """The metadata has the types the code reads (it comes from a file: anything may be there)."""
    def whole(x, low: int) -> bool:
        return isinstance(x, int) and not isinstance(x, bool) and x >= low

    for side in (info.source, info.target):
        if not (isinstance(side, dict) and all(isinstance(side.get(k), str) for k in ("name", "config", "weights"))):
            raise TypeError("source and target must each give a name, config and weights string")
    if not (whole(info.k, 1) and whole(info.rank, 0) and whole(info.tokens, 0) and whole(info.mlp_hidden, 0)
            and whole(info.heads, 0) and info.heads != 1):
        raise TypeError("k (>= 1), rank, tokens, mlp_hidden and heads (0 or >= 2) must be integers")
    if not (isinstance(info.lam, (int, float)) and not isinstance(info.lam, bool) and math.isfinite(info.lam)):
        raise TypeError("lam must be a finite number")
    if not all(isinstance(x, dict) for x in (info.corpus, info.calibration, info.r2_heldout)):
        raise TypeError("corpus, calibration and r2_heldout must be JSON objects")
    used = info.calibration.get("documents_used", 0)
    if not whole(used, 0) or not isinstance(info.calibration.get("document_ids", []), list):
        raise TypeError("calibration.documents_used must be an integer >= 0 and document_ids a list")
    if not (isinstance(info.sharpen, dict) and all(side in SIDES and isinstance(p, (int, float)) and not isinstance(
            p, bool) and 0 < p <= 2 for side, p in info.sharpen.items())):
        raise TypeError("sharpen maps k and/or v to powers in (0, 2]")
    if not all(isinstance(x, bool) for x in (info.token_inputs, info.exact_layer0)):
        raise TypeError("token_inputs and exact_layer0 must be true or false")
    if info.token_inputs and (info.heads or info.mlp_hidden):
        raise TypeError("token_inputs needs a dense linear map (not head-matched, no MLP)")
    if info.refined is not None and not isinstance(info.refined, dict):
        raise TypeError("refined must be null or a JSON object")
    prompts = (info.refined or {}).get("prompts", {})  # what Mapper.refined_ids reads for disjointness checks
    if not isinstance(prompts, dict) or not all(isinstance(p, dict) and isinstance(p.get("ids"), list) and all(
            isinstance(i, str) for i in p["ids"]) for p in prompts.values()):
        raise TypeError("refined.prompts maps task names to objects whose ids are a list of strings")
    if not (isinstance(info.weights, str) and info.weights in WEIGHT_DTYPES):
        raise TypeError(f"weights must be one of {', '.join(WEIGHT_DTYPES)}")
    plain = info.plain_sharpen
    if plain is not None:
        if not (isinstance(plain, dict) and all(side in SIDES and isinstance(p, (int, float)) and not isinstance(
                p, bool) and 0 <= p <= 2 for side, p in plain.items())):
            raise TypeError("plain_sharpen is null or maps k and/or v to powers in [0, 2]")
        if info.heads or info.mlp_hidden:
            raise TypeError("plain_sharpen needs a dense linear map (not head-matched, no MLP)")
    for side, values in info.r2_heldout.items():
        if side not in SIDES or not isinstance(values, list) or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            raise TypeError("r2_heldout maps k and v to lists of numbers")
