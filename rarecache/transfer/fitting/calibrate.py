"""Streaming calibration: run both models over the same text, accumulate statistics, fit.

Both models prefill each calibration sequence; the content rows of every layer at
the sampled positions feed float64 sufficient statistics (stats.py). The state is
checkpointed to `<out>.state` (safetensors, atomically replaced) every few
sequences; a killed run resumes at the next sequence and ends with exactly the
statistics of an uninterrupted one, because sums are added in the same order.
A run killed mid-write leaves `<out>.state.partial` or `<out>.partial` (a GB and
tens of MB for the bundled pair); the next run over `<out>` deletes both first.

Memory: per side, XᵀX is (Ls·ds)² and XᵀY is (Ls·ds)×(Lt·dt) float64 numbers.
For Qwen2.5-Coder 0.5B -> 1.5B that is 3072² + 3072·7168 ≈ 31M numbers (250 MB)
per side. For Qwen3-0.6B -> 14B (28×1024 -> 40×1024) it is about 2 GB + 9.4 GB per
side, 23 GB for both: it fits one large GPU (pass device="cuda"). Time is the two
prefills plus 2·N·(Ls·ds)·(Ls·ds + Lt·dt) float64 FLOPs per side for N tokens.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from ...engine.runner import Runner
from ...errors import RarecacheError
from ...models.tokenizer import Tokenizer
from ..features import SIDES, features, features_received, token_block, token_rows
from ..mapcheck import identity
from ..mapfile import MapInfo, partial_path
from ..mapper import Mapper
from ..sidefit import Layout, SideFit, sharpen
from .corpus import Corpus, token_sequences
from .fit import fit_side, fit_side_heads, head_rows, heldout_r2, heldout_r2_heads, matched_heads
from .stats import RegressionStats


# choices made after the statistics: a state resumes under any of them
FIT_ONLY = ("sharpen", "plain_sharpen", "exact_layer0")


@dataclass(frozen=True)
class CalibrationConfig:
    tokens: int = 65536  # sampled positions used for fitting
    heldout_tokens: int = 8192  # sampled positions after those, for held-out R² (0 = none)
    seq_len: int = 512
    stride: int = 1  # sample every stride-th position ...
    skip_first: int = 0  # ... from this position on (1 leaves out the attention sink)
    k: int = 8
    lam: float = 0.01
    rank: int | None = None  # None: d_t / 8 (the paper's 128 for d_t = 1024)
    checkpoint_every: int = 8  # sequences between state checkpoints
    head_matched: bool = False  # each target KV head from the same head of the source layers (fit.py)
    sharpen: tuple[float, float] = (0.0, 0.0)  # keys', values' power p: centred predictions scaled by R²^-p (fit.py)
    plain_sharpen: tuple[float, float] | None = None  # the powers plain transfer uses (Mapper.plain); None: sharpen's
    token_inputs: bool = False  # every layer also reads the target's own layer-0 K, V rows of the token (mapper.py)
    exact_layer0: bool = False  # the target's layer-0 rows are computed from the token, not mapped
    # each fit position weighs (attention it receives in the target / the mean over its sequence's fit
    # positions)^power, capped at weight_cap, then scaled to mean 1 per sequence (0: every position alike, the
    # plain ridge); the in-sample R² that picks source layers and sharpens is then weighted too; `Calibration`
    attention_weights: float = 0.0
    weight_cap: float = 8.0

    def __post_init__(self):
        if self.tokens < 1 or self.heldout_tokens < 0 or self.seq_len < 2 or self.stride < 1 or self.k < 1:
            raise RarecacheError("calibration needs tokens >= 1, heldout >= 0, seq_len >= 2, stride >= 1, k >= 1")
        if self.lam < 0 or (self.rank is not None and self.rank < 0):
            raise RarecacheError("lambda and rank must be >= 0")
        check_sharpen(self.sharpen)
        if self.plain_sharpen is not None:
            check_sharpen(self.plain_sharpen)
            if self.head_matched:
                raise RarecacheError("a head-matched map has one sharpening for every budget (no plain_sharpen)")
        if self.token_inputs and self.head_matched:
            raise RarecacheError("token inputs need a dense map (not head-matched)")
        if not 0 <= self.attention_weights <= 4 or not self.weight_cap >= 1:  # (NaN fails both)
            raise RarecacheError("attention weights take a power in [0, 4] and a cap >= 1")


def layouts(source: Runner, target: Runner, token_inputs: bool = False) -> tuple[Layout, Layout]:
    """The statistics' row layouts: the source's (with the token block after its layers when `token_inputs`)
    and the target's."""
    return (Layout(source.config.num_layers, source.config.kv_dim, 2 * target.config.kv_dim if token_inputs else 0),
            Layout(target.config.num_layers, target.config.kv_dim))


def run_config(cfg: CalibrationConfig) -> dict:
    """What of `cfg` a state is tied to: the statistics' choices (token inputs and attention weights only
    when on, so states written before those options resume)."""
    off = (set() if cfg.token_inputs else {"token_inputs"}) | (
        set() if cfg.attention_weights else {"attention_weights", "weight_cap"})
    return {k: v for k, v in asdict(cfg).items() if k not in FIT_ONLY and k not in off}


QUERY_EVERY = 4  # attention weights: the queries whose probabilities are summed (features_received)


def attention_weights(received: torch.Tensor, power: float, cap: float) -> torch.Tensor:
    """Weights (N,) of a sequence's fit positions from the attention each receives (N,) in the target:
    (received / mean)^power, capped at `cap` (the first position, an attention sink, receives hundreds of
    times the mean), then scaled to mean 1. In the spirit of CacheBridge (arXiv 2609.00891), which weighs
    each row of a target head's ridge by how much that head's attention output depends on it: a position
    the target reads more is fitted more closely."""
    r = received.double().clamp(min=0)
    w = (r / r.mean().clamp(min=1e-12)).pow(power).clamp(max=cap)
    return w * (len(w) / w.sum().clamp(min=1e-12))


class Calibration:
    """A resumable calibration run that ends in a Mapper."""

    def __init__(self, source: Runner, target: Runner, tokenizer: Tokenizer, corpus: Corpus,
                 cfg: CalibrationConfig, out: Path, device: str | torch.device = "cpu"):
        if source.config.vocab_size != target.config.vocab_size:
            raise RarecacheError("source and target have different vocabularies: not one family")
        self.source, self.target, self.tokenizer, self.corpus, self.cfg = source, target, tokenizer, corpus, cfg
        self.out, self.state_path = Path(out), Path(str(out) + ".state")
        self.src, self.tgt = layouts(source, target, cfg.token_inputs)
        self.device = device
        self.rank = cfg.rank if cfg.rank is not None else max(1, self.tgt.width // 8)
        if self.rank > self.tgt.width:
            raise RarecacheError(f"rank {self.rank} exceeds the target row width {self.tgt.width}")
        self.run_id = {"source": identity(source), "target": identity(target), "corpus": corpus.describe(),
                       "config": run_config(cfg),
                       "dtype": str(source.dtype),
                       "kv_heads": [source.config.num_kv_heads, target.config.num_kv_heads]}
        # dense statistics (0), or one set per KV head (head-matched)
        self.heads = matched_heads(*self.run_id["kv_heads"]) if cfg.head_matched else 0
        dx, dy = self.src.layers * self.src.width + self.src.extra, self.tgt.layers * self.tgt.width
        self.stats = {name: RegressionStats(dx // max(1, self.heads), dy // max(1, self.heads), device)
                      for name in self._names()}
        self.sequences_done = 0
        self.documents_used = 0
        self.fit_documents = 0  # documents the fit part read; held-out data starts after them

    def _names(self, part: str | None = None, side: str | None = None) -> list[str]:
        return [n for p in ((part,) if part else ("fit", "heldout")) for s in ((side,) if side else SIDES)
                for n in stat_names(p, s, self.heads)]

    def _counter(self, part: str) -> RegressionStats:
        """Statistics of the part whose n counts its positions (every set of a part has the same n)."""
        return self.stats[self._names(part, "k")[0]]

    def _update(self, part: str, xs: dict[str, torch.Tensor], ys: dict[str, torch.Tensor],
                w: torch.Tensor | None = None) -> None:
        for s in SIDES:
            if not self.heads:
                self.stats[f"{part}.{s}"].update(xs[s], ys[s], w)
                continue
            for h in range(self.heads):
                self.stats[f"{part}.{s}.h{h}"].update(head_rows(xs[s], self.src, self.heads, h),
                                                      head_rows(ys[s], self.tgt, self.heads, h), w)

    def _targets(self, ids: list[int], keep: torch.Tensor, part: str):
        """The target's rows at `keep`, and with attention weights (fit part only: held-out R² stays
        unweighted, comparable across maps) each position's weight."""
        if not self.cfg.attention_weights or part != "fit":
            return features(self.target, ids, keep), None
        ys, received = features_received(self.target, ids, keep, QUERY_EVERY)
        return ys, attention_weights(received[keep.to(received.device)], self.cfg.attention_weights,
                                     self.cfg.weight_cap)

    def _inputs(self, ids: list[int], keep: torch.Tensor) -> dict[str, torch.Tensor]:
        """The regression's inputs at positions `keep` per side (N, dx): the source's rows, then with token
        inputs the target's own layer-0 rows of the tokens, computed as `Mapper.own_rows` does."""
        xs = features(self.source, ids, keep)
        if not self.cfg.token_inputs:
            return xs
        block = token_block(token_rows(self.target, torch.tensor(ids)[keep][None]))[0]  # (N, 2·dt)
        return {s: torch.cat([x, block.to(x.device, x.dtype)], dim=1) for s, x in xs.items()}

    # -- state -------------------------------------------------------------------------

    def _save_state(self) -> None:
        tensors = {}
        for name, st in self.stats.items():
            tensors.update({k: v.cpu().contiguous() for k, v in st.tensors(name).items()})
        meta = {"run": self.run_id, "sequences_done": self.sequences_done, "documents_used": self.documents_used,
                "fit_documents": self.fit_documents}
        tmp = partial_path(self.state_path)
        save_file(tensors, str(tmp), metadata={"rarecache.calibration": json.dumps(meta)})
        os.replace(tmp, self.state_path)

    def _load_state(self) -> bool:
        if not self.state_path.is_file():
            return False
        meta, tensors = read_state(self.state_path, self.device)
        run = dict(meta["run"], config={k: v for k, v in meta["run"].get("config", {}).items() if k not in FIT_ONLY})
        if run != json.loads(json.dumps(self.run_id)):  # (states written before FIT_ONLY recorded sharpen)
            raise RarecacheError(f"{self.state_path} belongs to a different calibration (models, corpus or "
                                 "settings differ); delete it or pass --restart")
        self.stats = {name: RegressionStats.from_tensors(tensors, name) for name in self.stats}
        self.sequences_done, self.documents_used = meta["sequences_done"], meta["documents_used"]
        self.fit_documents = meta["fit_documents"]
        return True

    # -- the run -----------------------------------------------------------------------

    def run(self, progress: bool = True, restart: bool = False, max_sequences: int | None = None) -> Mapper | None:
        """Accumulate until the token budgets are met, then fit. Returns None if stopped by
        `max_sequences` first (the state is saved; call again to continue)."""
        for leftover in (partial_path(self.state_path), partial_path(self.out)):  # of a killed write
            leftover.unlink(missing_ok=True)
        if restart:
            self.state_path.unlink(missing_ok=True)
        elif self._load_state() and progress:
            tqdm.write(f"resuming {self.state_path.name} after {self.sequences_done} sequences")
        cfg, fit, held = self.cfg, self._counter("fit"), self._counter("heldout")
        total = cfg.tokens + cfg.heldout_tokens
        bar = tqdm(total=total, initial=min(fit.n + held.n, total), unit="tok", desc="calibrate",
                   disable=not progress, dynamic_ncols=True)
        seqs = token_sequences(self.corpus, self.tokenizer, cfg.seq_len)
        done_now, t0 = 0, time.monotonic()
        for i, (doc, ids) in enumerate(seqs):
            if fit.n + held.n >= total:
                break
            if i < self.sequences_done:
                continue
            if max_sequences is not None and done_now >= max_sequences:
                self._save_state()
                bar.close()
                return None
            keep = torch.arange(cfg.skip_first, len(ids), cfg.stride)
            part = "fit" if fit.n < cfg.tokens else "heldout"
            budget = (cfg.tokens - fit.n) if part == "fit" else (total - fit.n - held.n)
            keep = keep[:budget]
            if part == "heldout" and doc < self.fit_documents:
                keep = keep[:0]  # held-out data never shares a document with the fit
            if len(keep):
                self._update(part, self._inputs(ids, keep), *self._targets(ids, keep, part))
                bar.update(len(keep))
            self.sequences_done, self.documents_used = i + 1, doc + 1
            if part == "fit":
                self.fit_documents = doc + 1
            done_now += 1
            if done_now % cfg.checkpoint_every == 0:
                self._save_state()
        bar.close()
        if fit.n == 0:
            raise RarecacheError(f"corpus {self.corpus.name} yielded no calibration tokens")
        if fit.n + held.n < total and progress:
            tqdm.write(f"corpus exhausted: {fit.n} fit and {held.n} held-out tokens "
                       f"(asked {cfg.tokens} + {cfg.heldout_tokens})")
        self._save_state()
        if progress:
            tqdm.write(f"accumulated {fit.n + held.n} tokens in {time.monotonic() - t0:.0f} s; fitting ...")
        t1 = time.monotonic()
        mapper = self.fit()
        if progress:
            tqdm.write(f"fitted in {time.monotonic() - t1:.0f} s")
        return mapper

    def fit(self) -> Mapper:
        cfg = self.cfg
        sides, r2_held = fit_sides(self.stats, self.src, self.tgt, self.heads, cfg.k, cfg.lam, self.rank, cfg.sharpen)
        calib = {"seq_len": cfg.seq_len, "stride": cfg.stride, "skip_first": cfg.skip_first,
                 "dtype": str(self.source.dtype).replace("torch.", ""), "documents_used": self.documents_used,
                 "cpu": torch.backends.cpu.get_cpu_capability(),  # which kernels accumulated the statistics
                 "sequences": self.sequences_done, "heldout_tokens": self._counter("heldout").n,
                 "document_ids": list(self.corpus.ids[: self.documents_used])}
        if cfg.attention_weights:
            calib["attention_weights"] = {"power": cfg.attention_weights, "cap": cfg.weight_cap,
                                          "query_every": QUERY_EVERY}
        info = MapInfo(source=self.run_id["source"], target=self.run_id["target"], k=min(cfg.k, self.src.layers),
                       lam=cfg.lam, rank=self.rank, tokens=self._counter("fit").n,
                       corpus=self.corpus.describe(), calibration=calib, r2_heldout=r2_held, heads=self.heads,
                       sharpen=sharpen_info(cfg.sharpen), plain_sharpen=plain_info(cfg.plain_sharpen),
                       token_inputs=cfg.token_inputs, exact_layer0=cfg.exact_layer0)
        return Mapper(info, sides)


def stat_names(part: str, side: str, heads: int) -> list[str]:
    """Statistics names of a state: PART.SIDE, or PART.SIDE.hH per head for a head-matched run."""
    return [f"{part}.{side}.h{h}" for h in range(heads)] or [f"{part}.{side}"]


def check_sharpen(powers: tuple[float, float]) -> None:
    if len(powers) != 2 or not all(0 <= p <= 2 for p in powers):
        raise RarecacheError(f"sharpening takes two powers (keys, values) in [0, 2], not {powers}")


def sharpen_info(powers: tuple[float, float]) -> dict[str, float]:
    """What MapInfo.sharpen records: the sides sharpened and their powers (empty: plain ridge)."""
    return {s: float(p) for s, p in zip(SIDES, powers) if p}


def plain_info(powers: tuple[float, float] | None) -> dict[str, float] | None:
    """What MapInfo.plain_sharpen records: both sides' powers at rho 0, zeros included (None: as `sharpen`)."""
    return None if powers is None else {s: float(p) for s, p in zip(SIDES, powers)}


def with_plain(mapper: Mapper, powers: tuple[float, float] | None) -> Mapper:
    """The same map with plain transfer's sharpening set to `powers` (None: the map's own `sharpen`).
    Metadata only: the tensors are the map's, the plain view is derived from them (`Mapper.plain`)."""
    if powers is not None:
        check_sharpen(powers)
        if mapper.info.heads or mapper.info.mlp_hidden:
            raise RarecacheError("a separate plain-transfer sharpening works on dense linear maps only")
    return Mapper(replace(mapper.info, plain_sharpen=plain_info(powers)), mapper.sides, mapper.mlp)


def fit_sides(stats: dict[str, RegressionStats], src: Layout, tgt: Layout, heads: int, k: int, lam: float,
              rank: int, powers: tuple[float, float] = (0.0, 0.0)) -> tuple[dict[str, SideFit], dict[str, list[float]]]:
    """Both sides' fits from a run's statistics (dense, or per head when `heads`), sharpened by `powers`
    (keys, values), and held-out R² per side of the map as served, where held-out statistics were
    accumulated."""
    sides, r2_held = {}, {}
    for s, power in zip(SIDES, powers):
        fit, held = ([stats[n] for n in stat_names(part, s, heads)] for part in ("fit", "heldout"))
        if heads:
            sides[s] = sharpen(fit_side_heads(fit, src, tgt, k, lam, rank), power)
            r2 = heldout_r2_heads(sides[s], held, src, tgt) if held[0].n > 1 else None
        else:
            sides[s] = sharpen(fit_side(fit[0], src, tgt, k, lam, rank), power)
            r2 = heldout_r2(sides[s], held[0], src, tgt) if held[0].n > 1 else None
        if r2 is not None:
            r2_held[s] = r2.tolist()
    return sides, r2_held


def read_state(path: Path, device: str | torch.device = "cpu") -> tuple[dict, dict[str, torch.Tensor]]:
    """A calibration state's record and tensors (an untrusted file: anything else is refused)."""
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = json.loads(f.metadata()["rarecache.calibration"])
            tensors = {k: f.get_tensor(k).to(device) for k in f.keys()}
        if not isinstance(meta, dict) or not isinstance(meta.get("run"), dict):
            raise KeyError("run")
    except (OSError, SafetensorError, KeyError, TypeError, json.JSONDecodeError) as e:
        raise RarecacheError(f"{path} is not a calibration state ({e}); delete it to start over") from None
    return meta, tensors


def collect_rows(source, target, tokenizer, corpus, tokens: int, seq_len: int, first_document: int = 0,
                 progress: bool = True) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Content rows of both models at the first `tokens` positions of the corpus's documents from
    `first_document` on: side -> (x (N, Ls·ds), y (N, Lt·dt)), float32."""
    xs: dict[str, list[torch.Tensor]] = {s: [] for s in SIDES}
    ys: dict[str, list[torch.Tensor]] = {s: [] for s in SIDES}
    n = 0
    bar = tqdm(total=tokens, unit="tok", desc="mlp rows", disable=not progress, leave=False)
    for doc, ids in token_sequences(corpus, tokenizer, seq_len):
        if n >= tokens:
            break
        if doc < first_document:
            continue
        keep = torch.arange(min(len(ids), tokens - n))
        fx, fy = features(source, ids, keep), features(target, ids, keep)
        for s in SIDES:
            xs[s].append(fx[s].float().cpu())
            ys[s].append(fy[s].float().cpu())
        n += len(keep)
        bar.update(len(keep))
    bar.close()
    if n == 0:
        raise ValueError(f"corpus {corpus.name} has no documents from {first_document} on")
    return {s: (torch.cat(xs[s]), torch.cat(ys[s])) for s in SIDES}
