"""The nonlinear map option (the closed-form KV mapping paper, arXiv 2608.03893, §4.4): a per-(target
layer, K|V) MLP on top of ridge.

The paper trains an MLP on the same MSE loss as ridge and uses it as a drop-in
replacement. Here the MLP learns ridge's residual: ŷ = ridge(x) + MLP(x), with the
output layer started at zero, so training starts from the ridge map and a map
whose MLP learned nothing is exactly the ridge map. The input is the same
concatenation of the top-K source rows ridge reads; it is standardised during
training and the standardisation is folded into the first layer, so applying it
is two matrix products per target layer. Rank disagreement keeps using ridge's
basis (z = ŷ − ȳ as before).

Training needs rows, not sufficient statistics: a second pass over calibration
text collects them (`calibrate.collect_rows`), a few tens of thousands of positions. `rarecache mlp`
runs `fit_mlp` on the map's own calibration text: rows of its fit documents train, the documents
after them stop early and give the held-out R². The network a map applies is `sidefit.SideMLP`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from tqdm import tqdm

from ...engine.runner import Runner
from ...errors import RarecacheError
from ..features import SIDES
from ..mapper import Mapper
from ..sidefit import Layout, SideFit, SideMLP
from .calibrate import collect_rows
from .corpus import Corpus


@dataclass(frozen=True)
class MLPConfig:
    hidden: int = 256
    epochs: int = 30
    lr: float = 1e-3
    batch: int = 512
    patience: int = 4  # epochs without held-out improvement before stopping
    seed: int = 0

    def __post_init__(self):
        if self.hidden < 1 or self.epochs < 1 or self.batch < 1 or not self.lr > 0:
            raise ValueError("MLP needs hidden >= 1, epochs >= 1, batch >= 1 and lr > 0")


def ridge_rows(fit: SideFit, layer: int, x_all: torch.Tensor, src: Layout) -> tuple[torch.Tensor, torch.Tensor]:
    """The gathered source rows (N, K·ds) ridge reads for `layer`, and ridge's prediction (N, dt)."""
    x = x_all[:, src.index(fit.sources[layer].tolist())]
    return x, x @ fit.weight[layer].to(x.dtype) + fit.bias[layer].to(x.dtype)


def _r2(pred: torch.Tensor, y: torch.Tensor) -> float:
    return 1 - ((pred - y).square().sum() / (y - y.mean(0)).square().sum()).item()


def train_side(fit: SideFit, x_train: torch.Tensor, y_train: torch.Tensor, x_held: torch.Tensor,
               y_held: torch.Tensor, src: Layout, tgt: Layout, cfg: MLPConfig, progress: bool = True
               ) -> tuple[SideMLP, dict[str, list[float]]]:
    """Fit each target layer's residual MLP on (x, y) rows (N, Ls·ds), (N, Lt·dt); early stopping on
    the held-out rows. Returns the MLPs and held-out R² per layer of ridge alone and of ridge + MLP."""
    g = torch.Generator().manual_seed(cfg.seed)
    layers = []
    r2 = {"ridge": [], "mlp": []}
    for l in tqdm(range(tgt.layers), desc="mlp", unit="layer", disable=not progress, leave=False):
        xt, rt = ridge_rows(fit, l, x_train, src)
        xh, rh = ridge_rows(fit, l, x_held, src)
        yt, yh = y_train[:, tgt.block(l)], y_held[:, tgt.block(l)]
        mu, sd = xt.mean(0), xt.std(0).clamp(min=1e-6)
        scale = (yt - rt).std().clamp(min=1e-6)  # residuals are learnt in units of their spread
        w1 = (torch.randn(xt.shape[1], cfg.hidden, generator=g) * math.sqrt(2 / xt.shape[1])).requires_grad_()
        b1 = torch.zeros(cfg.hidden, requires_grad=True)
        w2 = torch.zeros(cfg.hidden, tgt.width, requires_grad=True)  # starts as ridge exactly
        b2 = torch.zeros(tgt.width, requires_grad=True)
        params = [w1, b1, w2, b2]
        opt = torch.optim.Adam(params, lr=cfg.lr)

        def predict(x, base):
            return base + scale * (torch.relu((x - mu) / sd @ w1 + b1) @ w2 + b2)

        with torch.no_grad():
            best = ((predict(xh, rh) - yh).square().mean().item(), [p.detach().clone() for p in params])
        stale = 0
        for _ in range(cfg.epochs):
            order = torch.randperm(xt.shape[0], generator=g)
            for i in range(0, len(order), cfg.batch):
                idx = order[i : i + cfg.batch]
                loss = (predict(xt[idx], rt[idx]) - yt[idx]).square().mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
            with torch.no_grad():
                held = (predict(xh, rh) - yh).square().mean().item()
            if held < best[0] - 1e-9:
                best, stale = (held, [p.detach().clone() for p in params]), 0
            else:
                stale += 1
                if stale >= cfg.patience:
                    break
        w1b, b1b, w2b, b2b = best[1]
        # fold the standardisation and the output scale into the weights: relu(x W1' + b1') W2' + b2'
        w1f = w1b / sd[:, None]
        b1f = b1b - (mu / sd) @ w1b
        layers.append((w1f, b1f, w2b * scale, b2b * scale))
        with torch.no_grad():
            r2["ridge"].append(_r2(rh, yh))
            r2["mlp"].append(_r2(rh + torch.relu(xh @ w1f + b1f) @ (w2b * scale) + b2b * scale, yh))
    stack = [torch.stack([layer[i] for layer in layers]).detach() for i in range(4)]
    return SideMLP(*stack), r2


def fit_mlp(mapper: Mapper, source: Runner, target: Runner, tokenizer, corpus: Corpus, cfg: MLPConfig,
            tokens: int, heldout_tokens: int, seq_len: int, name: str = "the map") -> tuple[Mapper, dict]:
    """The map with an MLP trained per target layer and side on ridge's residual, and the held-out R²
    ({side: {"ridge": [...], "mlp": [...]}}). `corpus` must be the map's own calibration text; `name` says
    which map in the error if it is not."""
    if mapper.info.token_inputs:  # (before collecting rows: Mapper.with_mlp refuses it)
        raise RarecacheError(f"{name} reads token inputs, which a residual MLP would not: no MLP for it")
    mapper.check_corpus(corpus, name)
    train = collect_rows(source, target, tokenizer, corpus, tokens, seq_len)
    held = collect_rows(source, target, tokenizer, corpus, heldout_tokens, seq_len,
                        first_document=mapper.info.calibration.get("documents_used", 0))
    src = Layout(source.num_layers, source.config.kv_dim)
    tgt = Layout(target.num_layers, target.config.kv_dim)
    mlps, r2 = {}, {}
    for s in SIDES:
        mlps[s], r2[s] = train_side(mapper.sides[s], *train[s], *held[s], src, tgt, cfg)
    return mapper.with_mlp(mlps, cfg.hidden), r2
