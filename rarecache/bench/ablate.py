"""`rarecache bench ablate`: each optimisation of the handoff against the reference it replaces,
timed in the same run on the same prompt (median of repeats after a warm-up).

- attention: sparse-causal query blocks vs the dense ρT x T mask (recompute phase);
- logits: at the last position only vs at every recomputed position;
- prepacked weights: the target's linear layers prepacked for oneDNN vs plain `F.linear` (recompute,
  prefill and one decode step): bf16 on a CPU, where packing is the default, against a plain copy;
  float32 with `pack=True` (`--pack`), the same runner timed before and after packing in place (no
  second copy of the weights in memory);
- the map in one pass per target layer (`transfer.fused`) vs the plain pipeline it replaces
  (`Mapper.apply_reference` + `rank_scores`), and its parts: the rank score fused into the map vs
  scored afterwards from the kept centred rows; nothing kept for a selector that reads no score vs
  the centred rows kept; source rows de-rotated inside the layer-major copy vs gather, strip, reshape;
- map dtype: bf16 vs float32 matmuls;
- shared de-rotation: each source layer de-rotated once vs once per target layer that reads it
  (both through the plain pipeline);
- map gathers: whole source-layer rows (index_select, bias fused in addmm) vs a flat column index;
- batching: B requests of different lengths in one handoff vs one after another.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

from ..engine.attention import attend, attend_reference
from ..engine.runner import Runner
from ..errors import RarecacheError
from ..models.packed import pack_float32
from ..registry import RANK
from ..transfer.features import rows, write_rows
from ..transfer.fused import source_rows
from ..transfer.handoff import HandoffConfig, budget, handoff, select_top, subset
from ..transfer.mapper import SIDES, Mapper
from ..transfer.selectors import rank_scores
from .handoffbench import synchronize


def median_time(fn, repeats: int, device: torch.device) -> float:
    """Median wall-clock seconds of `fn` over `repeats` after one warm-up, the device's queue drained each time."""
    times = []
    for i in range(repeats + 1):
        t = time.perf_counter()
        fn()
        synchronize(device)
        if i:
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def map_unshared(source: Runner, source_cache, target: Runner, cache, positions, mapper: Mapper, dtype) -> None:
    """Reference mapping: de-rotate each source layer again for every target layer that reads it
    (the RaReCache paper's reference implementation, arXiv 2610.11358). Batch of one."""
    out = {}
    for side in SIDES:
        f = mapper.sides[side]
        store = source_cache.k if side == "k" else source_cache.v  # (L, 1, Hkv, S+1, D)
        ys = []
        for l in range(f.weight.shape[0]):
            blocks = []
            for j in f.sources[l].tolist():
                x = store[j][:, :, positions[0]]  # (1, Hkv, T, D)
                if side == "k":
                    x = source.rope.strip(x, positions)
                blocks.append(x.transpose(1, 2).flatten(2))  # (1, T, Hkv·D)
            x = torch.cat(blocks, -1).to(dtype)
            ys.append(x @ f.weight[l].to(x.device, dtype) + f.bias[l].to(x.device, dtype))
        out[side] = torch.stack(ys)  # (Lt, 1, T, dt)
    write_rows(target, cache, positions, out["k"], out["v"])


def map_rows_flat(mapper: Mapper, side: str, x: torch.Tensor) -> torch.Tensor:
    """Reference for `Mapper.map_rows`: gather the K·ds input columns by a flat index, matmul, add the bias
    (the previous implementation). x (B, T, Ls·ds) -> ŷ (Lt, B, T, dt)."""
    f = mapper.sides[side]
    width = f.weight.shape[1] // mapper.info.k
    index = (f.sources[..., None] * width + torch.arange(width)).flatten(1).to(x.device)  # (Lt, K·ds)
    w, b = f.weight.to(x.device, x.dtype), f.bias.to(x.device, x.dtype)
    return torch.stack([x[..., index[l]] @ w[l] + b[l] for l in range(w.shape[0])])


def _row(name: str, before: float, after: float) -> dict:
    return {"optimisation": name, "before_ms": before * 1e3, "after_ms": after * 1e3}


@torch.inference_mode()
def ablate(source: Runner, target: Runner, mapper: Mapper, T: int, rho: float, batch: int, repeats: int,
           pack: bool = False, on_row: Callable[[dict], None] | None = None) -> list[dict]:
    """Every row, in the order printed. `pack`: also time float32 packing (packs `target` in place).
    `on_row(row)`, if given, hears each row as soon as it is measured (the whole takes minutes on a CPU)."""
    if mapper.needs_tokens:  # its row references (map_unshared, map_rows_flat) map source rows alone
        raise RarecacheError("bench ablate times a map that reads source rows alone; this one reads the tokens "
                             "(token inputs or exact layer 0): time it with `bench handoff`")

    def _median(fn, n: int) -> float:
        return median_time(fn, n, target.device)

    g = torch.Generator().manual_seed(0)
    vocab = min(source.config.vocab_size, target.config.vocab_size)
    prompt = torch.randint(0, vocab, (1, T), generator=g).to(target.device)
    pos = torch.arange(T, device=target.device)[None]
    src_cache, _ = source.prefill(prompt.tolist())
    res = []

    def add(*rows: dict) -> None:
        for r in rows:
            res.append({**r, "gain": r["before_ms"] / r["after_ms"]})
            if on_row is not None:
                on_row(res[-1])

    mapped = target.new_cache(1, T)
    chosen = [select_top(mapper.apply_scored(source, src_cache, target, mapped, pos)[0], budget(rho, T))]
    sel_tok, sel_pos = subset(prompt, chosen)

    def recompute(logits_at="last", runner=target):
        cache = runner.new_cache(1, T)
        for name in ("k", "v", "filled"):
            getattr(cache, name).copy_(getattr(mapped, name))
        runner.forward(sel_tok, sel_pos, cache, logits_at=logits_at)

    def step(runner, n):  # the target's own prefill of n rows (n = 1: one decode step at the last position)
        tok, at = (prompt[:, :n], pos[:, :n]) if n > 1 else (prompt[:, -1:], pos[:, -1:])
        cache = runner.new_cache(1, T)
        for key in ("k", "v", "filled"):
            getattr(cache, key).copy_(getattr(mapped, key))
        runner.forward(tok, at, cache)

    def packing_rows(plain: Runner, packed: Runner | None, kind: str) -> list[dict]:
        """Recompute, prefill and one decode step, plain then packed (packed None: pack `plain` in between)."""
        cases = [(f"recompute ({len(chosen[0])} rows)", lambda r: recompute(runner=r)),
                 (f"target prefill ({T} rows)", lambda r: step(r, T)), ("target decode step (1 row)", lambda r: step(r, 1))]
        before = [_median(lambda f=f: f(plain), repeats) for _, f in cases]
        packed = packed or plain.pack()
        return [_row(f"prepacked weights ({kind}): {name}", b, _median(lambda f=f: f(packed), repeats))
                for (name, f), b in zip(cases, before)]

    if pack and not target.packed and pack_float32(target.dtype, target.device):  # before the rows below use it
        add(*packing_rows(target, None, "float32"))

    fast = _median(recompute, repeats)
    target.attention = attend_reference  # the dense mask: what the device's kernel (`attention.choose`) replaces
    try:
        before = _median(recompute, repeats)
    finally:
        target.attention = attend
    add(_row("sparse-causal recompute attention" if target.device.type == "cpu" else
                    f"recompute attention: {target.kernel}, not the dense mask (GPU)", before, fast))
    add(_row("logits at the last position only", _median(lambda: recompute("all"), repeats), fast))

    if target.packed and target.path is not None and target.dtype != torch.float32:  # a plain copy to compare
        plain = Runner.load(target.path, dtype=target.dtype, device=target.device, pack=False)
        add(*packing_rows(plain, target, "bf16"))
        del plain

    # the map: one pass per target layer vs the plain pipeline, and its parts
    def fresh():
        return target.new_cache(1, T)

    def reference():
        rank_scores(mapper, mapper.apply_reference(source, src_cache, target, fresh(), pos))

    scored = _median(lambda: mapper.apply_scored(source, src_cache, target, fresh(), pos), repeats)
    centred = _median(lambda: rank_scores(mapper, mapper.apply(source, src_cache, target, fresh(), pos)), repeats)
    add(_row("map + rank score in one pass per target layer", _median(reference, repeats), scored))
    add(_row("rank score fused into the map vs from the kept centred rows", centred, scored))
    add(_row("map for a selector reading no score: nothing kept vs centred rows",
                    _median(lambda: mapper.apply(source, src_cache, target, fresh(), pos), repeats),
                    _median(lambda: mapper.apply_scored(source, src_cache, target, fresh(), pos, rank=False),
                            repeats)))
    add(_row("source keys de-rotated inside the layer-major copy",
                    _median(lambda: rows(source, src_cache, pos, "k").to(target.dtype), repeats),
                    _median(lambda: source_rows(source, src_cache, pos, "k", target.dtype, 0), repeats)))

    def mapping(dtype):
        return lambda: mapper.apply(source, src_cache, target, fresh(), pos, dtype=dtype)

    add(_row("map matmuls in bf16", _median(mapping(torch.float32), repeats),
                    _median(mapping(torch.bfloat16), repeats)))
    add(_row("de-rotated source layers shared (plain pipeline)",
                    _median(lambda: map_unshared(source, src_cache, target, fresh(), pos, mapper, target.dtype),
                            repeats),
                    _median(lambda: mapper.apply_reference(source, src_cache, target, fresh(), pos), repeats)))
    x = rows(source, src_cache, pos, "k").to(target.dtype)
    add(_row("map gathers whole source-layer rows, bias fused", _median(lambda: map_rows_flat(mapper, "k", x),
                                                                               repeats),
                    _median(lambda: mapper.map_rows("k", x), repeats)))

    # batching requests of different lengths
    lengths = [T - (T // (2 * batch)) * i for i in range(batch)]
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]
    caches = [source.prefill([p])[0] for p in prompts]
    batched_src, _ = source.prefill(prompts)
    cfg = HandoffConfig(rho, RANK)  # rank, not the served default: the batched path that scores in the map
    one_by_one = _median(lambda: [handoff(source, target, mapper, [p], cfg, source_cache=c, source_kept=[len(p)])
                                  for p, c in zip(prompts, caches)], repeats)
    together = _median(lambda: handoff(source, target, mapper, prompts, cfg, source_cache=batched_src,
                                       source_kept=lengths), repeats)
    add(_row(f"batched handoff of {batch} requests ({min(lengths)}-{max(lengths)} tokens)", one_by_one,
                    together))
    return res
