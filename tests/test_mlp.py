"""The residual MLP map: recovers a planted nonlinearity ridge cannot, and adds nothing where ridge is exact."""

from __future__ import annotations

import torch

from rarecache.transfer.fitting.fit import fit_side
from rarecache.transfer.sidefit import Layout
from rarecache.transfer.fitting.mlp import MLPConfig, ridge_rows, train_side
from rarecache.transfer.fitting.stats import RegressionStats

SRC, TGT = Layout(3, 8), Layout(2, 6)


def planted(n: int, nonlinear: float, seed: int):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(SRC.layers * SRC.width, TGT.layers * TGT.width, generator=torch.Generator().manual_seed(1))
    b = torch.randn(SRC.layers * SRC.width, 32, generator=torch.Generator().manual_seed(2))
    c = torch.randn(32, TGT.layers * TGT.width, generator=torch.Generator().manual_seed(3)) / 4
    x = torch.randn(n, SRC.layers * SRC.width, generator=g)
    return x, x @ a * 0.3 + nonlinear * torch.relu(x @ b) @ c


def fitted(x, y):
    s = RegressionStats(x.shape[1], y.shape[1])
    s.update(x.double(), y.double())
    return fit_side(s, SRC, TGT, k=3, lam=0.01, rank=2)


def test_mlp_recovers_a_planted_nonlinearity():
    x, y = planted(6000, 1.0, 0)
    xh, yh = planted(1500, 1.0, 1)
    fit = fitted(x, y)
    mlp, r2 = train_side(fit, x, y, xh, yh, SRC, TGT, MLPConfig(hidden=64, epochs=40, lr=3e-3), progress=False)
    for l in range(TGT.layers):
        assert r2["mlp"][l] > r2["ridge"][l] + 0.05, r2
    # the stored (folded) weights give what training measured
    xl, ridge = ridge_rows(fit, 0, xh, SRC)
    pred = ridge + mlp.residual(0, xl)
    want = 1 - (pred - yh[:, TGT.block(0)]).square().sum() / (yh[:, TGT.block(0)] - yh[:, TGT.block(0)].mean(0)).square().sum()
    assert abs(want.item() - r2["mlp"][0]) < 1e-4


def test_mlp_adds_nothing_where_ridge_is_exact():
    x, y = planted(3000, 0.0, 0)  # purely linear: ridge is (nearly) exact
    xh, yh = planted(800, 0.0, 1)
    fit = fitted(x, y)
    mlp, r2 = train_side(fit, x, y, xh, yh, SRC, TGT, MLPConfig(hidden=16, epochs=5), progress=False)
    for l in range(TGT.layers):
        assert r2["mlp"][l] >= r2["ridge"][l] - 1e-6  # early stopping keeps the start (= ridge) if nothing helps
        xl, _ = ridge_rows(fit, l, xh, SRC)
        assert mlp.residual(l, xl).abs().max() < 0.05 * yh.std()


def test_a_map_with_mlp_round_trips_and_applies_ridge_plus_mlp(fitted, tmp_path):
    """The file keeps the MLP (and its checksum covers it), and map_rows adds each layer's residual to
    ridge's output; a zero MLP maps exactly as the ridge map does."""
    from rarecache.transfer.mapper import SIDES, Mapper
    from rarecache.transfer.sidefit import SideMLP

    source, target, mapper, _ = fitted
    g = torch.Generator().manual_seed(0)
    lt, kd, dt = mapper.sides["k"].weight.shape
    rand = {s: SideMLP(torch.randn(lt, kd, 8, generator=g), torch.randn(lt, 8, generator=g),
                       torch.randn(lt, 8, dt, generator=g) / 10, torch.randn(lt, dt, generator=g) / 10) for s in SIDES}
    with_mlp = mapper.with_mlp(rand, 8)
    with_mlp.save(tmp_path / "m.safetensors")
    back = Mapper.load(tmp_path / "m.safetensors")
    assert back.info.mlp_hidden == 8 and "ridge + MLP 8" in back.summary()
    x = torch.randn(1, 5, source.num_layers * source.config.kv_dim, generator=g)
    for s in SIDES:
        y_ridge, _ = mapper.map_rows(s, x)
        y, z = back.map_rows(s, x)
        for l in range(lt):
            xl = x.reshape(5, source.num_layers, -1)[:, mapper.sides[s].sources[l]].reshape(5, -1)
            torch.testing.assert_close(y[l, 0], y_ridge[l, 0] + rand[s].residual(l, xl), rtol=1e-5, atol=1e-5)
    zero = {s: SideMLP(*(torch.zeros_like(t) for t in (m.w1, m.b1, m.w2, m.b2))) for s, m in rand.items()}
    for s in SIDES:
        torch.testing.assert_close(mapper.with_mlp(zero, 8).map_rows(s, x)[0], mapper.map_rows(s, x)[0])
    # a file that says it has an MLP but lacks its tensors is refused
    from safetensors.torch import load_file, save_file
    import json
    from safetensors import safe_open
    with safe_open(str(tmp_path / "m.safetensors"), framework="pt") as f:
        meta = f.metadata()
    t = load_file(str(tmp_path / "m.safetensors"))
    del t["v.mlp.w2"]
    meta.pop("rarecache.sha256", None)
    save_file(t, str(tmp_path / "broken.safetensors"), metadata={k: v for k, v in meta.items() if "sha" not in k})
    import pytest
    from rarecache.errors import RarecacheError
    with pytest.raises(RarecacheError, match="lacks tensor"):
        Mapper.load(tmp_path / "broken.safetensors")
