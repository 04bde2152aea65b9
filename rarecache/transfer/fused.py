"""The map applied one target layer at a time: the fast path behind `Mapper.apply`.

Why: the map and the rank score are a fixed cost of a handoff that does not shrink
with ρ, so at low budgets they are a large share of it. The plain pipeline
(`Mapper.apply_reference`) makes a pass per step over tensors of Lt x B x T x dt:
de-rotate every source row, gather each target layer's K·ds input columns, map
every target layer into one tensor, subtract the mean into a second, rotate all of
it, write it row by row, then score it. Here each target layer's rows are made,
written and scored while they are still in cache:

- the source rows are copied once per side into a layer-major buffer (Ls, B·T, ds),
  keys de-rotated on the way in (the rotation is the copy: no separate strip pass);
- a target layer's prediction is K products of contiguous source-layer blocks with
  the matching row blocks of its weight, summed into one (B·T, dt) tile, so the K·ds
  input columns are never gathered (float32 / float64; in bf16 the tile would round
  after each product, so there, and for MLP maps, the K blocks are concatenated and
  multiplied once, as the reference does);
- the tile is rotated straight into the target cache (keys) or copied there (values);
- then centred in place, and only what the caller asks for is kept: the
  rank-disagreement score (B, T) (one small product and two norms per layer), the
  centred rows z (diagnostics, evaluation variants), or nothing (selectors that do
  not read the map).

A token-input map's layers also read the target's own layer-0 rows of the tokens (`own`, made
by `Mapper.own_rows`): one more product per layer with the token block; an exact layer 0 writes
`own` itself, at the target's precision, and is left out of the rank score.

Memory: the reference holds the prediction and the centred rows of every layer
(2 x Lt·B·T·dt per side); this path holds the source buffer (B·T·Ls·ds) and one tile.
"""

from __future__ import annotations

import torch

from ..engine.cache import KVCache
from .features import SIDES, token_block


def span(positions: torch.Tensor) -> int | None:
    """The first position, if positions (B, T) are one run s, s+1, ... of batch one (a slice, not a gather)."""
    if positions.shape[0] != 1 or positions.numel() == 0:
        return None
    start = int(positions[0, 0])
    want = torch.arange(start, start + positions.shape[1], device=positions.device)
    return start if start >= 0 and bool((positions[0] == want).all()) else None


def _halves(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    h = x.shape[-1] // 2
    return x[..., :h], x[..., h:]


def rotate_into(out: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: float) -> None:
    """out = x·cos + sign·rotate_half(x)·sin, written into `out` half by half (no temporaries).

    sign +1 is `Rope.apply`, −1 is `Rope.strip`; cos and sin broadcast to x (the two halves of a
    RoPE table are equal, so only the first is read)."""
    c, s = _halves(cos)[0], _halves(sin)[0]
    x1, x2 = _halves(x)
    o1, o2 = _halves(out)
    torch.mul(x1, c, out=o1)
    o1.addcmul_(x2, s, value=-sign)  # first half of rotate_half(x) is −x2
    torch.mul(x2, c, out=o2)
    o2.addcmul_(x1, s, value=sign)


def source_rows(source, cache: KVCache, positions: torch.Tensor, side: str, dtype: torch.dtype,
                start: int | None) -> torch.Tensor:
    """Content rows of every source layer at positions (B, T) -> (Ls, B·T, Hs·Ds) in `dtype`, layer-major
    (each layer's block contiguous), keys de-rotated in the same pass."""
    store = cache.k if side == "k" else cache.v  # (Ls, B, Hs, S+1, Ds)
    L, B, H, _, D = store.shape
    T = positions.shape[1]
    if start is not None:
        x = store[:, :, :, start : start + T]  # (Ls, 1, Hs, T, Ds), a view
    else:
        slots = cache.slots(positions)  # (B, T)
        x = store.gather(3, slots[None, :, None, :, None].expand(L, B, H, T, D))  # (Ls, B, Hs, T, Ds)
    out = torch.empty(L, B, T, H, D, dtype=dtype, device=store.device)
    dest = out.permute(0, 1, 3, 2, 4)  # (Ls, B, Hs, T, Ds) view of the layer-major buffer
    if side == "k":
        rotate_into(dest, x, *source.rope.cos_sin(positions, store.dtype), sign=-1.0)
    else:
        dest.copy_(x)
    return out.view(L, B * T, H * D)


def _write(cache: KVCache, layer: int, side: str, tile: torch.Tensor, positions: torch.Tensor, start: int | None,
           cos_sin, slots: torch.Tensor) -> None:
    """One target layer's rows tile (B·T, Ht·Dt), unrotated, into the cache (keys rotated on the way) at
    `slots` (B, T) (`KVCache.slots`, found once per map: each look would read the positions' top back)."""
    store = cache.k if side == "k" else cache.v  # (Lt, B, Ht, S+1, Dt)
    _, B, H, _, D = store.shape
    T = positions.shape[1]
    y = tile.view(B, T, H, D).transpose(1, 2)  # (B, Ht, T, Dt)
    if start is not None:
        dest = store[layer, :, :, start : start + T]  # (1, Ht, T, Dt), a view
        if side == "k":
            rotate_into(dest, y, *cos_sin, sign=1.0)
        else:
            dest.copy_(y)
        return
    if side == "k":
        rot = torch.empty(y.shape, dtype=store.dtype, device=store.device)
        rotate_into(rot, y, *cos_sin, sign=1.0)
        y = rot
    rows = torch.arange(B, device=positions.device)[:, None].expand_as(positions)
    store[layer].transpose(1, 2)[rows, slots] = y.transpose(1, 2).to(store.dtype)


@torch.inference_mode()
def map_into(mapper, source, source_cache: KVCache, target, target_cache: KVCache, positions: torch.Tensor,
             dtype: torch.dtype, centred: bool = False, rank: bool = False,
             own: dict[str, torch.Tensor] | None = None
             ) -> tuple[dict[str, torch.Tensor] | None, torch.Tensor | None]:
    """Map the source cache at positions (B, T) into the target cache (all layers, slots marked).

    Returns the centred rows z per side (Lt, B, T, dt) if `centred`, and the rank-disagreement score
    (B, T) (`selectors.rank_scores` of those z) if `rank`; None for what was not asked for.
    `own`: the target's own layer-0 rows per side (B, T, dt) for a map that `needs_tokens`.
    `source` and `target` need only `rope` (and `target` its cache layout)."""
    B, T = positions.shape
    start = span(positions)
    slots = target_cache.slots(positions) if start is None else None  # (B, T), one read of the top
    cos_sin = target.rope.cos_sin(positions, target_cache.k.dtype)  # (B, 1, T, Dt)
    acc_dtype = torch.promote_types(dtype, torch.float32)  # score norms in at least float32
    score = torch.zeros(B * T, dtype=acc_dtype, device=positions.device) if rank else None
    kept = {} if centred else None
    exact = mapper.exact_layers
    extra = token_block(own).reshape(B * T, -1).to(dtype) if mapper.info.token_inputs else None  # (B·T, 2·dt)
    for side in SIDES:
        t = mapper.tensors(side, dtype, positions.device)
        x = source_rows(source, source_cache, positions, side, dtype, start)  # (Ls, B·T, ds)
        Lt, _, dt = t["weight"].shape
        ds = x.shape[-1]
        tile = torch.empty(B * T, dt, dtype=dtype, device=x.device)
        zs = torch.empty(Lt, B, T, dt, dtype=dtype, device=x.device) if centred else None
        mlp = mapper.mlp[side] if mapper.mlp else None
        split = mlp is None and dtype in (torch.float32, torch.float64)  # bf16 would round after each product
        for l, src in enumerate(t["source_list"]):
            if l < exact:  # the target's own rows, written at its precision
                y = own[side].reshape(B * T, dt)
                _write(target_cache, l, side, y, positions, start, cos_sin, slots)
                if not (centred or rank):
                    continue
                tile.copy_(y)
            else:
                w = t["weight"][l]  # (K·ds [+ 2·dt], dt); row block j reads source layer src[j], then the token block
                if split:
                    torch.addmm(t["bias"][l], x[src[0]], w[:ds], out=tile)
                    for j in range(1, len(src)):
                        tile.addmm_(x[src[j]], w[j * ds : (j + 1) * ds])
                    if extra is not None:
                        tile.addmm_(extra, w[len(src) * ds :])
                else:  # one product over the gathered blocks: one rounding, as the reference
                    xl = torch.cat([x[s] for s in src] + ([extra] if extra is not None else []), dim=1)
                    torch.addmm(t["bias"][l], xl, w, out=tile)
                    if mlp is not None:
                        tile += mlp.residual(l, xl)
                _write(target_cache, l, side, tile, positions, start, cos_sin, slots)
                if not (centred or rank):
                    continue
            z = torch.sub(tile, t["mean"][l], out=zs[l].view(B * T, dt)) if centred else tile.sub_(t["mean"][l])
            if rank and l >= exact:
                proj = z @ t["basis"][l]  # (B·T, r), in the map's dtype
                energy = torch.linalg.vector_norm(z, dim=-1, dtype=acc_dtype).square()
                score += energy - torch.linalg.vector_norm(proj, dim=-1, dtype=acc_dtype).square()
        if centred:
            kept[side] = zs
    target_cache.mark(positions)
    return kept, (score.view(B, T) if rank else None)
