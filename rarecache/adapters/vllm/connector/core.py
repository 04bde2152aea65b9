"""The connector's engine-free half: its settings, which prefix to claim, and the handoff of claimed rows.

`connector.py` only wires these to vLLM's hooks. Everything here runs without vLLM and is
tested against the plain transfer and the handoff core (transfer/).

How the ρ budget is spent inside an engine. vLLM computes every prompt position after the
tokens a connector claims, and it must compute at least the last one; claims are whole
blocks. So for a prompt of P tokens with a claim of n (block aligned, n < P), the target's
own weights compute ⌈ρ·P⌉ positions in all, as in `transfer.handoff`: the unclaimed tail
P − n (vLLM's own prefill, which includes the last position) counts inside that budget, and
the rest, max(0, ⌈ρ·P⌉ − (P − n)), goes to the claimed positions the selector scores highest,
recomputed by our Runner over the mapped cache. ρ = 1 is then the target's own prefill and
ρ = 0 plain transfer (whatever the tail holds). The `suffix` selector needs no Runner at
all: it claims only the first P − ⌈ρ·P⌉ positions (rounded down to a block) and lets vLLM
recompute the rest natively, so it can recompute up to a block more than the budget.
`suffix+rank` is scored like `rank`: the claimed positions in the library's own order (the newest
and rank disagreement's picks in turn, transfer/selectors.py), after vLLM's tail, the newest of all.

The query-aware selectors (`query`, ...; transfer/query.py) run their two passes around vLLM's
tail: the claim leaves the tail to be pass 1's window (the newest w positions, rounded up to a
block), our Runner computes the tail over the mapped claimed rows and reads its queries' attention
(pass 1), recomputes the k claimed positions they attend to most (pass 2), and vLLM then computes
the tail itself (the newest again, over rows pass 2 made exact). All three count: tail + k + tail =
⌈ρ·P⌉ (k = ⌈ρ·P⌉ − 2·tail), the same passes `transfer.handoff` runs with the tail as its window.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import torch

from ....defaults import SERVED, default_selector
from ....engine.cache import KVCache
from ....engine.runner import Runner
from ....errors import RarecacheError
from ....models.config import ModelConfig
from ....models.rope import Rope
from ....registry import LAYER_PREFIX, RANDOM, RANK, SUFFIX, SUFFIX_RANK
from ....transfer.features import rows, write_rows
from ....transfer.handoff import budget
from ....transfer.mapper import Mapper
from ....transfer.query import before_tail
from ....transfer.selectors import SELECTORS, SelectionContext
from ..rowstore.interface import RECORD_NAME, model_identity, same_model
from .sharding import HeadRange


RECOMPUTE_SELECTORS = (RANK, RANDOM, SUFFIX_RANK)  # scored positions, recomputed by our Runner
# two passes around vLLM's tail; a refining variant's middle pass keeps rows a third stage would have to build
# before vLLM's tail (not built here: those run in our engine only); a blend reads the source's attention, which
# the row store does not hold
QUERY_SELECTORS = tuple(n for n, s in SELECTORS.items()
                        if s.two_pass and not (s.config.refine or s.needs_source_attention))
NATIVE_SELECTORS = (SUFFIX,)  # the newest positions, recomputed by vLLM itself
ENGINE_SELECTORS = RECOMPUTE_SELECTORS + QUERY_SELECTORS + NATIVE_SELECTORS
ENGINE_DEFAULT = default_selector(ENGINE_SELECTORS)[0]  # the served default, or its fallback where it cannot run
DEFAULT_RHO = SERVED.rho  # as `rarecache serve`
KEYS = ("store", "store_bytes", "store_ttl", "model", "maps", "manifests", "rho", "selector", "seed", "capture",
        "accept_poor_map")
REQUEST_KEYS = ("handoff", "scope", "rho", "selector", "seed", "capture", "debug", "record")


@dataclass(frozen=True)
class Peer:
    """A model this engine takes handoffs from: the map fitted peer -> this model."""

    name: str
    path: Path
    mapper: Mapper
    manifest: dict[str, Any] | None = None  # pinned (transfer/manifest.py); the peer's layout is checked late

    @property
    def identity(self) -> dict[str, str]:
        return self.mapper.info.source


@dataclass(frozen=True)
class Settings:
    """`kv_connector_extra_config`, checked."""

    store: str  # a directory, or redis://HOST:PORT/DB / unix:///path.sock (store_open.open_store)
    model: Path
    identity: dict[str, str]
    config: ModelConfig
    peers: dict[str, Peer] = field(default_factory=dict)
    rho: float = DEFAULT_RHO
    selector: str = ENGINE_DEFAULT
    seed: int = 0
    capture: bool = True
    store_bytes: int | None = None  # a directory store's capacity (None: unbounded)
    store_ttl: float | None = None  # seconds an entry lives (None: until evicted)


def _number(value: Any, key: str, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise RarecacheError(f"{key} must be a number in [{low:g}, {high:g}], not {value!r}"[:200])
    return float(value)


def _whole(value: Any, key: str) -> int:
    if type(value) is not int:
        raise RarecacheError(f"{key} must be an integer, not {value!r}"[:200])
    return value


def _flag(value: Any, key: str) -> bool:
    if not isinstance(value, bool):
        raise RarecacheError(f"{key} must be true or false, not {value!r}"[:200])
    return value


def check_selector(name: Any, where: str = "selector") -> str:
    """A selector the engine adapter can run, or a clear error saying why not."""
    if name in ENGINE_SELECTORS:
        return name
    sel = SELECTORS.get(name) if isinstance(name, str) else None
    if sel is not None and sel.needs_source_attention:
        why = "needs the source's attention, which the row store does not hold"
    elif sel is not None and sel.oracle:
        why = "is an oracle (it reads the target's own prefill): not for serving"
    elif sel is not None and sel.two_pass and sel.config.refine:
        why = ("keeps a refining pass's rows, a third stage before vLLM's tail that this adapter does not build "
               "(the two-pass variants run)")
    elif name == LAYER_PREFIX:
        why = "is a schedule that runs the first layers for every position; the vLLM adapter has positions only"
    else:
        why = "is not a selector"
    raise RarecacheError(f"{where} {name!r} {why}; the vLLM adapter runs {', '.join(ENGINE_SELECTORS)}")


def read_settings(extra: Any, engine_model: str | Path | None, tensor_parallel: int = 1) -> Settings:
    """Check the connector's extra config and load its maps (each must map a peer into this model).

    `engine_model` is the model vLLM was started with; `model` in the config overrides it (it
    must be the checkpoint directory, whose fingerprints key the rows and tie the maps)."""
    if extra is None:
        extra = {}
    if not isinstance(extra, dict):
        raise RarecacheError("kv_connector_extra_config must be a JSON object")
    _refuse_unknown(extra, KEYS, "RarecacheConnector setting")
    store = extra.get("store")
    if not isinstance(store, (str, Path)) or not str(store):
        raise RarecacheError("RarecacheConnector needs 'store': a directory shared by the engines "
                             "(e.g. under /dev/shm) or a Redis address (redis://HOST:PORT/DB)")
    store_bytes = extra.get("store_bytes")
    if store_bytes is not None and (type(store_bytes) is not int or store_bytes <= 0):
        raise RarecacheError(f"store_bytes must be a positive integer, not {store_bytes!r}"[:200])
    ttl = extra.get("store_ttl")
    ttl = None if ttl is None else _number(ttl, "store_ttl", 1e-3, 1e9)
    model = Path(extra.get("model") or engine_model or "")
    if not (model / "config.json").is_file():
        raise RarecacheError(f"RarecacheConnector: {str(model) or 'the model'} is not a checkpoint directory "
                             "(config.json + safetensors); give the directory as 'model'")
    identity = model_identity(model)
    config = ModelConfig.from_dir(model)
    rho = _number(extra.get("rho", DEFAULT_RHO), "rho", 0, 1)
    selector = extra.get("selector")
    if selector is not None:
        selector = check_selector(selector)
    seed = _whole(extra.get("seed", 0), "seed")
    capture = _flag(extra.get("capture", True), "capture")
    accept_poor = _flag(extra.get("accept_poor_map", False), "accept_poor_map")
    maps = extra.get("maps") or {}
    if not isinstance(maps, dict) or not all(isinstance(k, str) and isinstance(v, (str, Path))
                                             for k, v in maps.items()):
        raise RarecacheError("maps must be an object {peer model name: map file fitted peer -> this model}")
    manifests = extra.get("manifests") or {}
    if not isinstance(manifests, dict) or not set(manifests) <= set(maps) or not all(
            isinstance(v, (str, Path)) for v in manifests.values()):
        raise RarecacheError("manifests must be an object {peer model name in maps: manifest file to pin}")
    peers = {}
    for name, path in maps.items():
        mapper = Mapper.load(path)
        mapper.check_fit(accept_poor, f"maps[{name!r}] ({path})")
        check_map(mapper, identity, config, where=f"maps[{name!r}] ({path})")
        pinned = None
        if name in manifests:
            pinned = pin_manifest(manifests[name], path, mapper, model, tensor_parallel,
                                  where=f"maps[{name!r}] ({path})")
        peers[name] = Peer(name, Path(path), mapper, pinned)
    if selector is None:  # as `rarecache serve`: the served default
        selector = ENGINE_DEFAULT
    return Settings(str(store), model, identity, config, peers, rho, selector, seed, capture, store_bytes, ttl)


def check_map(mapper: Mapper, identity: dict[str, str], config: ModelConfig, where: str = "the map") -> None:
    """Refuse a map that does not map into this model (wrong target, wrong direction, wrong shape)."""
    info = mapper.info
    if not same_model(info.target, identity):
        if same_model(info.source, identity):
            raise RarecacheError(f"{where} runs {info.direction}, out of this engine's model {identity['name']}: "
                                 f"this engine needs maps into it (peer -> {identity['name']})")
        raise RarecacheError(
            f"{where} was fitted for {info.direction} (target config {info.target['config']}, weights "
            f"{info.target['weights']}), not for this engine's model {identity['name']} (config "
            f"{identity['config']}, weights {identity['weights']})")
    if same_model(info.source, identity):
        raise RarecacheError(f"{where} maps {identity['name']} into itself")
    for side, fit in mapper.sides.items():
        lt, _, dt = fit.weight.shape
        if (lt, dt) != (config.num_layers, config.kv_dim):
            raise RarecacheError(f"{where}: its {side} side writes {lt} layers of rows {dt} wide; this model has "
                                 f"{config.num_layers} layers of rows {config.kv_dim} wide")


def check_peer_fits(mapper: Mapper, peer: ModelConfig, target: ModelConfig) -> None:
    """The map reads rows of the peer's shape (its config comes from the store)."""
    mapper.check_fits(SimpleNamespace(config=peer, path=None), SimpleNamespace(config=target, path=None))


def pin_manifest(manifest: str | Path, map_path: str | Path, mapper: Mapper, model: Path, tensor_parallel: int,
                 where: str) -> dict[str, Any]:
    """Refuse the map unless it and this engine's model are what the pinned manifest says; returns the
    manifest (the peer's KV layout is checked once its config is known: `check_peer_layout`)."""
    from ....transfer.manifest import check_manifest, manifest_of, read_manifest

    pinned = read_manifest(manifest)
    check_manifest(pinned, manifest_of(mapper, map_path, target_dir=model, tensor_parallel=tensor_parallel),
                   where=where)
    return pinned


def check_peer_layout(peer: Peer, cfg: ModelConfig) -> None:
    """The peer's KV layout, as its config in the store gives it, is the one its pinned manifest names."""
    if peer.manifest is not None:
        from ....transfer.manifest import check_manifest, kv_layout

        check_manifest(peer.manifest, {"kv_layout": {"source": kv_layout(cfg)}}, where=f"the map from {peer.name}")


@dataclass(frozen=True)
class RequestParams:
    """Per-request `kv_transfer_params["rarecache"]`, checked; None fields take the engine's settings."""

    handoff: bool = True
    scope: str | None = None  # the salt the store files rows under; default: the request's cache_salt
    rho: float | None = None
    selector: str | None = None
    seed: int | None = None
    capture: bool = True
    debug: bool = False  # report the claimed block ids in the output
    record: str | None = None  # the worker files what its load did under this name (RowStore.put_record)


def _refuse_unknown(given: dict, known, what: str) -> None:
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise RarecacheError(f"unknown {what}(s) {', '.join(map(repr, unknown))}; known: {', '.join(known)}")


def request_params(raw: Any) -> RequestParams:
    if raw is None:
        return RequestParams()
    if not isinstance(raw, dict):
        raise RarecacheError("kv_transfer_params['rarecache'] must be an object")
    _refuse_unknown(raw, REQUEST_KEYS, "rarecache request parameter")
    scope = raw.get("scope")
    if scope is not None and (not isinstance(scope, str) or not scope):
        raise RarecacheError("rarecache scope must be a non-empty string")
    record = raw.get("record")
    if record is not None and not (isinstance(record, str) and RECORD_NAME.fullmatch(record)):
        raise RarecacheError("rarecache record must be a name of 32 lowercase hex digits")
    return RequestParams(
        handoff=_flag(raw.get("handoff", True), "rarecache handoff"), scope=scope,
        rho=None if raw.get("rho") is None else _number(raw["rho"], "rarecache rho", 0, 1),
        selector=None if raw.get("selector") is None else check_selector(raw["selector"], "rarecache selector"),
        seed=None if raw.get("seed") is None else _whole(raw["seed"], "rarecache seed"),
        capture=_flag(raw.get("capture", True), "rarecache capture"),
        debug=_flag(raw.get("debug", False), "rarecache debug"), record=record)


def claim(prompt_len: int, matched: int, block_size: int, rho: float, selector: str) -> tuple[int, int]:
    """How many prompt tokens to claim from a peer whose rows cover the first `matched`, and how
    many of the claimed positions our Runner recomputes (see the module docstring). (0, 0): none."""
    total = budget(rho, prompt_len)
    window = SELECTORS[selector].config.split(total, prompt_len) if selector in QUERY_SELECTORS else 0
    native = selector in NATIVE_SELECTORS or (selector in QUERY_SELECTORS and not window)  # one pass: a suffix
    limit = prompt_len - (total if native else window or 1)
    n = min(matched, limit) // block_size * block_size
    if n <= 0:
        return 0, 0
    tail = prompt_len - n  # vLLM's own prefill; with a window, also pass 1 (ours): counted twice
    k = 0 if native else max(0, total - tail * (2 if window else 1))
    return n, k


@dataclass
class Handed:
    """The target rows for the claimed positions, and which of them the target recomputed."""

    k: torch.Tensor  # (L, Hkv, n, D), rotated with the target's RoPE
    v: torch.Tensor
    recomputed: list[int]
    first_pass: int = 0  # a query-aware selector: the tail positions pass 1 computed (vLLM computes them again)


@torch.inference_mode()
def hand_rows(target: Runner | SimpleNamespace, mapper: Mapper, peer: ModelConfig, k_src: torch.Tensor,
              v_src: torch.Tensor, tokens: list[int], recompute: int, selector: str, seed: int = 0,
              heads: HeadRange | None = None, agree: Callable[[torch.Tensor], torch.Tensor] | None = None,
              rho: float | None = None, gather: Callable[[torch.Tensor], torch.Tensor] | None = None,
              tail: list[int] | None = None) -> Handed:
    """Map the peer's rows k_src, v_src (Ls, Hs, n, Ds) of `tokens` into the target and recompute
    the `recompute` positions the selector scores highest with the target's weights, over the
    mixed cache by the exact causal rule: the steps of `transfer.handoff` (map -> score ->
    selective recompute), with rows from the store instead of a source Runner.

    `target` is a Runner (our own or `weights.runner_over` vLLM's model); with recompute = 0 and a map
    that reads no tokens a namespace holding its `config`, `rope`, `dtype` and `device` is enough (a map
    that `needs_tokens` computes the target's layer-0 rows of `tokens` with its weights). Tensor parallel:
    `heads` are the KV heads of this rank, whose config `target` has (weights.rank_config); the
    map and the scores run on whole rows, so every rank picks the same positions, and only the
    rank's columns go into its cache. `agree(positions)` returns the positions every rank is to
    recompute (rank 0's, broadcast), so the ranks' collectives line up whatever their scores.
    A map that `needs_tokens` reads whole layer-0 rows, but a rank's Runner computes its own heads'
    only: `gather(rows)` joins every rank's (..., h·D) into whole rows (..., Hkv·D) (an all-gather
    and sharding.join_gathered); every rank calls it, in step, as it calls the embedding.
    `rho`, the request's budget: at 0 (plain transfer) the map's plain-transfer view maps
    (`Mapper.at_rho`); None maps with the map as it is. A query-aware selector also needs the prompt's
    `tail` (the tokens vLLM computes itself): pass 1 computes it here over the mapped rows (module
    docstring); under tensor parallelism each rank reads its own heads' attention and rank 0's picks
    (`agree`) are recomputed."""
    Ls, Hs, n, Ds = k_src.shape
    if n != len(tokens):
        raise RarecacheError(f"{n} rows for {len(tokens)} tokens")
    device, dtype = target.device, target.dtype
    if rho is not None:
        mapper = mapper.at_rho(rho)
    if mapper.needs_tokens and not isinstance(target, Runner):
        raise RarecacheError("this map reads the tokens (token inputs or exact layer 0): it needs the target's "
                             "Runner to compute their layer-0 rows")
    if mapper.needs_tokens and heads is not None and gather is None:
        raise RarecacheError("this map reads the tokens (token inputs or exact layer 0): under tensor parallelism "
                             "it needs `gather`, which joins the ranks' layer-0 rows into whole rows")
    positions = torch.arange(n, device=device)[None]  # (1, n)
    whole = torch.tensor([tokens], device=device)  # (1, n)
    src_cache = KVCache(Ls, 1, Hs, Ds, n, k_src.dtype, device)
    src_cache.k[:, 0, :, :n], src_cache.v[:, 0, :, :n] = k_src.to(device), v_src.to(device)
    src_cache.mark(positions)
    source = SimpleNamespace(rope=Rope(peer.rope, peer.head_dim, device))
    own = mapper.own_rows(target, whole, positions)  # the target's layer-0 rows, if the map reads them
    if own is not None and heads is not None:  # this rank's heads (1, n, h·D) -> whole rows, one collective
        both = gather(torch.stack([own["k"], own["v"]]))  # (2, 1, n, Hkv·D)
        own = {"k": both[0], "v": both[1]}
    # as Mapper.apply_reference: each source layer de-rotated once, in the target's dtype; (1, n, Ls·Hs·Ds) per side
    out = mapper.map_sides({side: rows(source, src_cache, positions, side).to(dtype) for side in ("k", "v")}, own)
    cfg = target.config
    cols = slice(None) if heads is None else heads.columns(cfg.head_dim)  # this rank's heads of a whole row
    sel = SELECTORS[selector]
    if sel.two_pass and recompute > 0 and not tail:
        raise RarecacheError(f"{selector} reads the attention of the prompt's tail: hand_rows needs its tokens")
    room = n + (len(tail) if sel.two_pass and recompute > 0 else 0)  # pass 1 writes the tail's rows after them
    cache = KVCache.for_model(cfg, 1, room, dtype, device)
    write_rows(target, cache, positions, out["k"][0][..., cols], out["v"][0][..., cols])
    mapper.write_own(target, cache, positions, own, cols)
    chosen: list[int] = []
    first = 0
    if recompute > 0:
        if not isinstance(target, Runner):
            raise RarecacheError("recomputing positions needs the target's Runner")
        centred = {side: z for side, (_, z) in out.items()}
        ctx = SelectionContext(None, target, mapper, whole, positions, cache, centred, None, seed)
        if sel.two_pass:  # pass 1 over the tail; pass 2 below; vLLM's tail after it
            prompt = torch.tensor([tokens + list(tail)], device=device)  # (1, P)
            pos = before_tail(target, cache, prompt, n, recompute, sel, ctx.rank_scores() if sel.needs_rank else None)
            first = len(tail)
        else:
            scores = sel.scores(ctx)[0].float()  # (n,)
            pos = scores.topk(min(recompute, n)).indices.sort().values  # (K,)
        if agree is not None:
            pos = agree(pos)
        target.forward(whole[:, pos], pos[None], cache, logits_at=None)
        chosen = pos.tolist()
    return Handed(cache.k[:, 0, :, :n], cache.v[:, 0, :, :n], chosen, first)


def target_namespace(cfg: ModelConfig, dtype: torch.dtype, device="cpu") -> SimpleNamespace:
    """What `write_rows` / `hand_rows` read of a target when nothing is recomputed."""
    return SimpleNamespace(config=cfg, rope=Rope(cfg.rope, cfg.head_dim, device), dtype=dtype,
                           device=torch.device(device))


def describe(identity: dict[str, str]) -> str:
    return f"{identity.get('name')} (config {identity.get('config')}, weights {identity.get('weights')})"


__all__ = ["Settings", "Peer", "RequestParams", "read_settings", "request_params", "claim", "hand_rows",
           "check_map", "check_peer_fits", "check_selector", "target_namespace", "model_identity"]
