"""Where a map's error lands, as the target's attention sees it (the closed-form KV mapping paper,
arXiv 2608.03893, §4.5).

R² weighs every K and V channel alike; attention does not. These diagnostics look at
a map through the target's own attention, on prompts the map did not see:

- attention-output cosine: per layer, the target's attention output for its own
  queries over the mapped cache against over its own cache (the paper finds the
  mean predicts retention across pairs where R² does not);
- K- and V-concentration: per head, the key error projected on the right singular
  vectors of the target's queries and weighted by their squared singular values,
  and the value error weighted by the squared attention a position receives, each
  over the unweighted mean (> 1: the error lies where attention reads);
- per-layer agreement of the top-ρ sets: how much of each layer's own top-ρ set by
  rank disagreement (and by true error, an oracle) the one shared set covers.

The target runs its own prefill layer by layer; at each layer its queries attend
both caches, so every layer is compared under the same (true) residual stream.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..defaults import SERVED
from ..engine.cache import KVCache
from ..engine.runner import Runner, pad_batch
from .handoff import budget, select_top
from .mapper import SIDES, Mapper


@dataclass
class Diagnostics:
    """Per target layer, averaged over prompts (and heads, queries)."""

    cosine: list[float]
    k_concentration: list[float]
    v_concentration: list[float]
    rank_agreement: list[float]  # |own top-ρ ∩ shared| / |shared|, own set by that layer's rank score
    error_agreement: list[float]  # the same with each layer's own top-ρ by true relative error (oracle)
    rho: float
    prompts: int
    tokens: int
    per_prompt_cosine: list[float] = field(default_factory=list)  # mean over layers, one per prompt

    def summary(self) -> dict[str, float]:
        mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
        return {"cosine": mean(self.cosine), "k_concentration": mean(self.k_concentration),
                "v_concentration": mean(self.v_concentration), "rank_agreement": mean(self.rank_agreement),
                "error_agreement": mean(self.error_agreement)}


def _k_concentration(err: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """err (Hkv, n, D) key error, q (H, n, D) queries -> per kv head concentration (Hkv,)."""
    hkv, group = err.shape[0], q.shape[0] // err.shape[0]
    out = []
    for h in range(hkv):
        qh = q[h * group:(h + 1) * group].reshape(-1, q.shape[-1])  # (group·n, D)
        _, s, vh = torch.linalg.svd(qh, full_matrices=False)  # vh (D, D) rows: right singular vectors
        energy = (err[h] @ vh.T).square().sum(0)  # (D,) error per query direction
        w = s.square() / s.square().mean()
        out.append((w * energy).sum() / energy.sum().clamp(min=1e-30))
    return torch.stack(out)


def _v_concentration(err: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """err (Hkv, n, D) value error, probs (H, n, n) attention -> per kv head concentration (Hkv,)."""
    hkv, group = err.shape[0], probs.shape[0] // err.shape[0]
    e = err.square().sum(-1)  # (Hkv, n)
    a = probs.reshape(hkv, group, *probs.shape[1:]).mean((1, 2))  # (Hkv, n) attention each key receives
    w = a.square() / a.square().mean(-1, keepdim=True).clamp(min=1e-30)
    return (w * e).sum(-1) / e.sum(-1).clamp(min=1e-30)


@torch.inference_mode()
def diagnose(source: Runner, target: Runner, mapper: Mapper, prompts: list[list[int]], rho: float = SERVED.rho
             ) -> Diagnostics:
    """The diagnostics of `mapper` on `prompts` (each handed off whole, batch one)."""
    L = target.num_layers
    mapper = mapper.at_rho(rho)  # what a handoff at rho maps with
    sums = {k: torch.zeros(L, dtype=torch.float64) for k in ("cos", "kc", "vc", "ra", "ea")}
    per_prompt, tokens = [], 0
    for ids in prompts:
        n = len(ids)
        tokens += n
        toks, pos = pad_batch([ids], target.device)  # (1, n)
        source_cache, _ = source.prefill([ids])
        mapped = target.new_cache(1, n)
        centred = mapper.apply(source, source_cache, target, mapped, pos, tokens=toks)
        true = target.new_cache(1, n)
        true.mark(pos)
        h = target.embed(toks)
        cos_sin = target.cos_sin(pos)
        k = budget(rho, n)
        per_layer = layer_rank_scores(mapper, centred)  # (Lt, 1, n)
        shared = set(select_top(per_layer[mapper.exact_layers:].sum(0)[0], k).tolist())  # the rank selector's
        cos_layers = []
        for i in range(L):
            q, kk, vv = target.qkv(i, h, cos_sin)  # q (1, H, n, D), kk, vv (1, Hkv, n, D)
            true.write(i, pos, kk, vv)
            rows = torch.arange(n, device=target.device)[None]
            out_true, probs = target.attend(i, q, pos, true, rows)  # probs (1, H, n, n)
            out_mapped, _ = target.attend(i, q, pos, mapped)
            cos_layers.append(head_cosine(out_true, out_mapped).item())
            km, vm = mapped.layer(i, n)  # (1, Hkv, n, D)
            k_err, v_err = (km - kk).float()[0], (vm - vv).float()[0]
            sums["kc"][i] += _k_concentration(k_err, q.float()[0]).mean().item()
            sums["vc"][i] += _v_concentration(v_err, probs.float()[0]).mean().item()
            own = set(select_top(per_layer[i, 0], k).tolist())
            sums["ra"][i] += len(own & shared) / len(shared)
            rel = (k_err.norm(dim=-1) / kk.float()[0].norm(dim=-1).clamp(min=1e-6)
                   + v_err.norm(dim=-1) / vv.float()[0].norm(dim=-1).clamp(min=1e-6)).mean(0)  # (n,)
            own_err = set(select_top(rel, k).tolist())
            sums["ea"][i] += len(own_err & shared) / len(shared)
            h = target.finish(i, h, out_true)
        sums["cos"] += torch.tensor(cos_layers, dtype=torch.float64)
        per_prompt.append(sum(cos_layers) / L)
    m = len(prompts)
    avg = {k: (v / m).tolist() for k, v in sums.items()}
    return Diagnostics(avg["cos"], avg["kc"], avg["vc"], avg["ra"], avg["ea"], rho, m, tokens, per_prompt)


def head_cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Attention outputs a (1 or A, H, m, D) against b (A, H, m, D): the cosine of each head's output
    vectors, averaged over heads and positions -> (A,)."""
    return torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1).mean((1, 2))


@torch.inference_mode()
def attention_cosines(target: Runner, own: KVCache, others: KVCache, tokens: torch.Tensor,
                      positions: torch.Tensor) -> torch.Tensor:
    """Per target layer, the attention-output cosine of `tokens` (1, m) at `positions` (1, m) over the
    target's own cache `own` (batch one) against over each row of `others` (A rows; e.g. handed-off
    caches), along the target's own residual stream: at every layer the same k, v of these tokens are
    written into both, so the two outputs differ only through the rows before them. Writes those rows
    into both caches. -> (L, A)."""
    A = others.batch
    pos_a = positions.expand(A, -1)  # (A, m)
    own.mark(positions)
    others.mark(pos_a)
    h = target.embed(tokens)
    cos_sin = target.cos_sin(positions)
    out = []
    for i in range(target.num_layers):
        q, k, v = target.qkv(i, h, cos_sin)  # q (1, H, m, D), k, v (1, Hkv, m, D)
        own.write(i, positions, k, v)
        others.write(i, pos_a, k.expand(A, -1, -1, -1), v.expand(A, -1, -1, -1))
        mine, _ = target.attend(i, q, positions, own)
        theirs, _ = target.attend(i, q.expand(A, -1, -1, -1), pos_a, others)
        out.append(head_cosine(mine, theirs))
        h = target.finish(i, h, mine)
    return torch.stack(out)  # (L, A)


def layer_rank_scores(mapper: Mapper, centred: dict[str, torch.Tensor]) -> torch.Tensor:
    """Rank disagreement per target layer, both sides summed -> (Lt, B, W); its sum over the mapped layers
    (after `Mapper.exact_layers`) is `selectors.rank_scores`."""
    total = 0
    for side, zs in centred.items():  # zs (Lt, B, W, dt)
        Lt, B, W, dt = zs.shape
        basis = mapper.sides[side].basis.to(zs.device, zs.dtype)  # (Lt, dt, r)
        proj = torch.bmm(zs.reshape(Lt, B * W, dt), basis).view(Lt, B, W, -1)
        total = total + zs.float().square().sum(-1) - proj.float().square().sum(-1)
    return total


def plot_diagnostics(d: Diagnostics, path, title: str = "") -> None:
    """Four panels per target layer: cosine, K/V concentration, top-ρ agreement."""
    from .map_plots import use_matplotlib

    use_matplotlib()
    import matplotlib.pyplot as plt
    layers = list(range(len(d.cosine)))
    fig, ax = plt.subplots(1, 3, figsize=(13, 3.6))
    ax[0].plot(layers, d.cosine, marker="o", ms=3)
    ax[0].set(title="attention-output cosine", xlabel="target layer", ylim=(min(0.0, min(d.cosine)), 1.0))
    ax[1].plot(layers, d.k_concentration, marker="o", ms=3, label="K")
    ax[1].plot(layers, d.v_concentration, marker="s", ms=3, label="V")
    ax[1].axhline(1.0, color="grey", lw=0.8, ls="--")
    ax[1].set(title="error concentration (>1: where attention reads)", xlabel="target layer")
    ax[1].legend()
    ax[2].plot(layers, d.rank_agreement, marker="o", ms=3, label="own rank top-ρ")
    ax[2].plot(layers, d.error_agreement, marker="s", ms=3, label="own true-error top-ρ (oracle)")
    ax[2].set(title=f"shared set covers layer's top-ρ (ρ={d.rho:g})", xlabel="target layer", ylim=(0, 1.02))
    ax[2].legend()
    fig.suptitle(title or f"{d.prompts} prompts, {d.tokens} tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
