"""`rarecache bench ablate`: each optimisation of the handoff against the reference it replaces,
timed in the same run on the same prompt (median of repeats after a warm-up).

- attention: sparse-causal query blocks vs the dense ρT x T mask (recompute phase);
- map dtype: bf16 vs float32 matmuls;
- shared de-rotation: each source layer de-rotated once vs once per target layer that reads it;
- map gathers: whole source-layer rows (index_select, bias fused in addmm) vs a flat column index;
- logits: at the last position only vs at every recomputed position;
- prepacked weights: the target's linear layers prepacked for oneDNN vs plain `F.linear` (recompute,
  prefill and one decode step; bf16 on a CPU, where packing applies);
- batching: B requests of different lengths in one handoff vs one after another.
"""

from __future__ import annotations

import statistics
import time

import torch

from ..engine.attention import attend_reference
from ..engine.runner import Runner
from ..transfer.features import write_rows
from ..transfer.handoff import HandoffConfig, budget, handoff, select_top, subset
from ..transfer.mapper import SIDES, Mapper


def _median(fn, repeats: int) -> float:
    times = []
    for i in range(repeats + 1):
        t = time.perf_counter()
        fn()
        if i:
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def map_unshared(source: Runner, source_cache, target: Runner, cache, positions, mapper: Mapper, dtype) -> None:
    """Reference mapping: de-rotate each source layer again for every target layer that reads it
    (the seed paper's reference implementation). Batch of one."""
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
            ys.append(x @ f.weight[l].to(dtype) + f.bias[l].to(dtype))
        out[side] = torch.stack(ys)  # (Lt, 1, T, dt)
    write_rows(target, cache, positions, out["k"], out["v"])


def map_rows_flat(mapper: Mapper, side: str, x: torch.Tensor) -> torch.Tensor:
    """Reference for `Mapper.map_rows`: gather the K·ds input columns by a flat index, matmul, add the bias
    (the previous implementation). x (B, T, Ls·ds) -> ŷ (Lt, B, T, dt)."""
    f = mapper.sides[side]
    width = f.weight.shape[1] // mapper.info.k
    index = (f.sources[..., None] * width + torch.arange(width)).flatten(1)  # (Lt, K·ds)
    w, b = f.weight.to(x.dtype), f.bias.to(x.dtype)
    return torch.stack([x[..., index[l]] @ w[l] + b[l] for l in range(w.shape[0])])


@torch.inference_mode()
def ablate(source: Runner, target: Runner, mapper: Mapper, T: int, rho: float, batch: int, repeats: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    vocab = min(source.config.vocab_size, target.config.vocab_size)
    prompt = torch.randint(0, vocab, (1, T), generator=g)
    pos = torch.arange(T)[None]
    src_cache, _ = source.prefill(prompt.tolist())
    res = []

    # recompute attention: sparse-causal vs dense mask
    mapped = target.new_cache(1, T)
    z = mapper.apply(source, src_cache, target, mapped, pos)
    from ..transfer.selectors import rank_scores

    chosen = [select_top(rank_scores(mapper, z)[0], budget(rho, T))]
    sel_tok, sel_pos = subset(prompt, chosen)

    def recompute(logits_at="last", runner=target):
        cache = runner.new_cache(1, T)
        for name in ("k", "v", "filled"):
            getattr(cache, name).copy_(getattr(mapped, name))
        runner.forward(sel_tok, sel_pos, cache, logits_at=logits_at)

    fast = _median(recompute, repeats)
    target.attention = attend_reference
    try:
        dense = _median(recompute, repeats)
    finally:
        from ..engine.attention import attend

        target.attention = attend
    res.append({"optimisation": "sparse-causal recompute attention", "before_ms": dense * 1e3, "after_ms": fast * 1e3})
    res.append({"optimisation": "logits at the last position only",
                "before_ms": _median(lambda: recompute("all"), repeats) * 1e3, "after_ms": fast * 1e3})

    if target.packed and target.path is not None:  # the same checkpoint with plain F.linear
        plain = Runner.load(target.path, dtype=target.dtype, device=target.device, pack=False)
        res.append({"optimisation": f"prepacked weights: recompute ({len(chosen[0])} rows)",
                    "before_ms": _median(lambda: recompute(runner=plain), repeats) * 1e3, "after_ms": fast * 1e3})
        for name, n in (("prefill", T), ("decode step", 1)):
            tok, at = prompt[:, :n], pos[:, :n] if n > 1 else pos[:, -1:]

            def step(runner, tok=tok, at=at):
                cache = runner.new_cache(1, T)
                for key in ("k", "v", "filled"):
                    getattr(cache, key).copy_(getattr(mapped, key))
                runner.forward(tok, at, cache)

            res.append({"optimisation": f"prepacked weights: target {name} ({n} row{'s' * (n > 1)})",
                        "before_ms": _median(lambda: step(plain), repeats) * 1e3,
                        "after_ms": _median(lambda: step(target), repeats) * 1e3})
        del plain

    # map: dtype and shared de-rotation
    def mapping(dtype):
        return lambda: mapper.apply(source, src_cache, target, target.new_cache(1, T), pos, dtype=dtype)

    bf16 = _median(mapping(torch.bfloat16), repeats)
    res.append({"optimisation": "map matmuls in bf16", "before_ms": _median(mapping(torch.float32), repeats) * 1e3,
                "after_ms": bf16 * 1e3})
    unshared = _median(lambda: map_unshared(source, src_cache, target, target.new_cache(1, T), pos, mapper,
                                            target.dtype), repeats)
    shared = _median(mapping(target.dtype), repeats)
    res.append({"optimisation": "de-rotated source layers shared", "before_ms": unshared * 1e3,
                "after_ms": shared * 1e3})
    from ..transfer.features import rows

    x = rows(source, src_cache, pos, "k").to(target.dtype)
    res.append({"optimisation": "map gathers whole source-layer rows, bias fused",
                "before_ms": _median(lambda: map_rows_flat(mapper, "k", x), repeats) * 1e3,
                "after_ms": _median(lambda: mapper.map_rows("k", x), repeats) * 1e3})

    # batching requests of different lengths
    lengths = [T - (T // (2 * batch)) * i for i in range(batch)]
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]
    caches = [source.prefill([p])[0] for p in prompts]
    batched_src, _ = source.prefill(prompts)
    cfg = HandoffConfig(rho=rho)
    one_by_one = _median(lambda: [handoff(source, target, mapper, [p], cfg, source_cache=c, source_kept=[len(p)])
                                  for p, c in zip(prompts, caches)], repeats)
    together = _median(lambda: handoff(source, target, mapper, prompts, cfg, source_cache=batched_src,
                                       source_kept=lengths), repeats)
    res.append({"optimisation": f"batched handoff of {batch} requests ({min(lengths)}-{max(lengths)} tokens)",
                "before_ms": one_by_one * 1e3, "after_ms": together * 1e3})
    for r in res:
        r["gain"] = r["before_ms"] / r["after_ms"]
    return res
