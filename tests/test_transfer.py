"""Cross-model maps: RoPE round trips, planted-map recovery, streaming, resume, files, pairing."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from rarecache.engine.runner import Runner
from rarecache.errors import RarecacheError
from rarecache.models.config import ModelConfig
from rarecache.models.rope import Rope
from rarecache.models.tokenizer import Tokenizer
from rarecache.transfer.fitting.calibrate import Calibration, CalibrationConfig
from rarecache.transfer.fitting.corpus import load_corpus
from rarecache.transfer.fitting.fit import fit_side, fit_side_heads, head_rows, head_stats, heldout_r2, heldout_r2_heads
from rarecache.transfer.mapper import Mapper
from rarecache.transfer.sidefit import Layout, from_head_blocks, head_blocks, sharpen
from rarecache.transfer.fitting.stats import RegressionStats



def test_rope_strip_then_apply_is_identity(tiny):
    _, path, _ = tiny
    cfg = ModelConfig.from_dir(path)
    rope = Rope(cfg.rope, cfg.head_dim)
    x = torch.randn(2, cfg.num_kv_heads, 50, cfg.head_dim, dtype=torch.float64)
    pos = torch.randint(0, 40000, (2, 50))
    torch.testing.assert_close(rope.apply(rope.strip(x, pos), pos), x, atol=1e-12, rtol=0)
    torch.testing.assert_close(rope.strip(rope.apply(x, pos), pos), x, atol=1e-12, rtol=0)
    assert (rope.apply(x, pos) - x).abs().max() > 0.1  # it does rotate
    x32 = x.float()
    torch.testing.assert_close(rope.apply(rope.strip(x32, pos), pos), x32, atol=1e-5, rtol=0)


def planted(n=4000, src=Layout(6, 8), tgt=Layout(3, 5), k=2, noise=0.0, seed=0):
    """Data where target layer l is an affine map of exactly k source layers."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, src.layers * src.width, generator=g, dtype=torch.float64) * 2 + 1
    chosen, ys, maps = [], [], []
    for _ in range(tgt.layers):
        layers = sorted(torch.randperm(src.layers, generator=g)[:k].tolist())
        w = torch.randn(k * src.width, tgt.width, generator=g, dtype=torch.float64)
        b = torch.randn(tgt.width, generator=g, dtype=torch.float64)
        ys.append(x[:, src.index(layers)] @ w + b + noise * torch.randn(n, tgt.width, generator=g, dtype=torch.float64))
        chosen.append(layers)
        maps.append((w, b))
    return x, torch.cat(ys, 1), chosen, maps


def test_ridge_recovers_planted_map_and_top_k_finds_its_layers():
    src, tgt = Layout(6, 8), Layout(3, 5)
    x, y, chosen, maps = planted(src=src, tgt=tgt)
    stats = RegressionStats(x.shape[1], y.shape[1])
    stats.update(x, y)
    fit = fit_side(stats, src, tgt, k=2, lam=1e-9, rank=3)
    for l, (w, b) in enumerate(maps):
        assert fit.sources[l].tolist() == chosen[l]
        torch.testing.assert_close(fit.weight[l], w, atol=1e-6, rtol=0)
        torch.testing.assert_close(fit.bias[l], b, atol=1e-6, rtol=0)
    torch.testing.assert_close(fit.r2, torch.ones(3, dtype=torch.float64), atol=1e-9, rtol=0)
    # the basis is orthonormal and spans the leading directions of the predictions' covariance
    basis = fit.basis[0]
    torch.testing.assert_close(basis.T @ basis, torch.eye(3, dtype=torch.float64), atol=1e-9, rtol=0)
    pred = x[:, src.index(chosen[0])] @ maps[0][0]
    cov = torch.cov(pred.T, correction=0)
    top = torch.linalg.eigh(cov).eigenvectors[:, -3:]
    torch.testing.assert_close((basis @ basis.T), top @ top.T, atol=1e-6, rtol=0)


def test_sharpening_at_half_power_gives_the_predictions_the_targets_variance():
    """Least squares shrinks: Var(ŷ) = R²·Var(y) per layer in-sample. Scaling the centred prediction by R^-1/2
    restores the target's variance, keeps the mean, and equals ȳ + s(ŷ − ȳ) computed directly."""
    src, tgt = Layout(5, 6), Layout(3, 4)
    x, y, _, _ = planted(n=5000, src=src, tgt=tgt, k=2, noise=3.0)
    stats = RegressionStats(x.shape[1], y.shape[1])
    stats.update(x, y)
    fit = fit_side(stats, src, tgt, k=2, lam=1e-9, rank=2)
    assert (fit.r2 < 0.9).all() and (fit.r2 > 0.1).all()  # noisy enough to shrink
    sharp = sharpen(fit, 0.5)
    assert sharpen(fit, 0) is fit and torch.equal(sharp.r2, fit.r2) and torch.equal(sharp.basis, fit.basis)
    for l in range(tgt.layers):
        xs, yl = x[:, src.index(fit.sources[l].tolist())], y[:, tgt.block(l)]
        plain, sharp_pred = xs @ fit.weight[l] + fit.bias[l], xs @ sharp.weight[l] + sharp.bias[l]
        var = lambda a: ((a - a.mean(0)) ** 2).sum()  # noqa: E731
        torch.testing.assert_close(var(plain), fit.r2[l] * var(yl), rtol=1e-6, atol=0)
        torch.testing.assert_close(var(sharp_pred), var(yl), rtol=1e-6, atol=0)
        torch.testing.assert_close(sharp_pred.mean(0), yl.mean(0), rtol=0, atol=1e-8)
        s = fit.r2[l] ** -0.5
        torch.testing.assert_close(sharp_pred, fit.mean[l] + s * (plain - fit.mean[l]), rtol=0, atol=1e-9)
        torch.testing.assert_close(sharp.eigenvalues[l], fit.eigenvalues[l] * s ** 2, rtol=1e-12, atol=0)
    # it costs squared error: held-out (here in-sample) R² of the sharpened map is below the ridge's
    assert (heldout_r2(sharp, stats, src, tgt) < fit.r2).all()


def test_heldout_r2_equals_direct_computation():
    src, tgt = Layout(4, 6), Layout(2, 4)
    x, y, _, _ = planted(n=3000, src=src, tgt=tgt, noise=1.0)
    train, test = RegressionStats(x.shape[1], y.shape[1]), RegressionStats(x.shape[1], y.shape[1])
    train.update(x[:2000], y[:2000])
    test.update(x[2000:], y[2000:])
    fit = fit_side(train, src, tgt, k=2, lam=0.01, rank=2)
    got = heldout_r2(fit, test, src, tgt)
    for l in range(2):
        xs, ys = x[2000:, src.index(fit.sources[l].tolist())], y[2000:, tgt.block(l)]
        pred = xs @ fit.weight[l] + fit.bias[l]
        want = 1 - ((ys - pred) ** 2).sum() / ((ys - ys.mean(0)) ** 2).sum()
        torch.testing.assert_close(got[l], want, atol=1e-10, rtol=0)
    assert 0.3 < got.min() < 0.99


def test_streamed_statistics_equal_one_shot():
    x, y, _, _ = planted(n=1000)
    one, chunked = RegressionStats(x.shape[1], y.shape[1]), RegressionStats(x.shape[1], y.shape[1])
    one.update(x, y)
    for i in range(0, 1000, 137):
        chunked.update(x[i : i + 137], y[i : i + 137])
    assert one.n == chunked.n
    for name in ("sx", "sy", "syy", "xx", "xy"):
        torch.testing.assert_close(getattr(chunked, name), getattr(one, name), atol=1e-9, rtol=1e-12)


# -- head-matched maps ------------------------------------------------------------------------

def planted_heads(n=4000, src=Layout(5, 2 * 6), tgt=Layout(3, 2 * 4), heads=2, k=2, noise=0.0, seed=0):
    """Data where head h of target layer l is an affine map of head h of exactly k source layers
    (the same k for every head of a layer)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, src.layers * src.width, generator=g, dtype=torch.float64) * 2 + 1
    sh = Layout(src.layers, src.width // heads)
    chosen, blocks, ys = [], [], []
    for _ in range(tgt.layers):
        layers = sorted(torch.randperm(src.layers, generator=g)[:k].tolist())
        out = []
        for h in range(heads):
            w = torch.randn(k * sh.width, tgt.width // heads, generator=g, dtype=torch.float64)
            b = torch.randn(tgt.width // heads, generator=g, dtype=torch.float64)
            out.append(head_rows(x, src, heads, h)[:, sh.index(layers)] @ w + b)
            blocks.append((w, b))
        ys.append(torch.cat(out, 1))
        chosen.append(layers)
    y = torch.cat(ys, 1)
    return x, y + noise * torch.randn(y.shape, generator=g, dtype=torch.float64), chosen, blocks


def test_head_statistics_are_the_blocks_of_the_dense_ones():
    """Accumulating per head gives exactly the head blocks of the dense statistics."""
    src, tgt = Layout(5, 12), Layout(3, 8)
    x, y, _, _ = planted_heads(n=500, noise=0.5)
    dense = RegressionStats(x.shape[1], y.shape[1])
    dense.update(x, y)
    for h, block in enumerate(head_stats(dense, src, tgt, 2)):
        own = RegressionStats(x.shape[1] // 2, y.shape[1] // 2)
        own.update(head_rows(x, src, 2, h), head_rows(y, tgt, 2, h))
        for name in ("sx", "sy", "syy", "xx", "xy"):
            torch.testing.assert_close(getattr(block, name), getattr(own, name), atol=1e-9, rtol=1e-12)


def test_head_matched_fit_recovers_a_planted_head_map():
    src, tgt = Layout(5, 12), Layout(3, 8)
    x, y, chosen, blocks = planted_heads()
    dense = RegressionStats(x.shape[1], y.shape[1])
    dense.update(x, y)
    fit = fit_side_heads(head_stats(dense, src, tgt, 2), src, tgt, k=2, lam=1e-9, rank=3)
    assert fit.sources.tolist() == chosen
    torch.testing.assert_close(fit.r2, torch.ones(3, dtype=torch.float64), atol=1e-9, rtol=0)
    got = head_blocks(fit.weight, 2, 2)  # (Lt, H, K·Ds, Dt)
    for l in range(3):
        for h in range(2):
            w, b = blocks[2 * l + h]
            torch.testing.assert_close(got[l, h], w, atol=1e-6, rtol=0)
            torch.testing.assert_close(fit.bias[l, 4 * h : 4 * (h + 1)], b, atol=1e-6, rtol=0)
    # the dense weight is zero off the head blocks and predicts y exactly
    torch.testing.assert_close(from_head_blocks(got, 2), fit.weight, atol=0, rtol=0)
    for l in range(3):
        pred = x[:, src.index(fit.sources[l].tolist())] @ fit.weight[l] + fit.bias[l]
        torch.testing.assert_close(pred, y[:, tgt.block(l)], atol=1e-6, rtol=0)
    # a dense fit of the same data finds the same map (the truth is head-matched)
    full = fit_side(dense, src, tgt, k=2, lam=1e-9, rank=3)
    torch.testing.assert_close(full.weight, fit.weight, atol=1e-6, rtol=0)
    basis = fit.basis[0]
    torch.testing.assert_close(basis.T @ basis, torch.eye(3, dtype=torch.float64), atol=1e-9, rtol=0)


def test_head_matched_heldout_r2_equals_direct_computation():
    src, tgt = Layout(5, 12), Layout(3, 8)
    x, y, _, _ = planted_heads(n=3000, noise=1.0)
    x = x + 0.3 * torch.randn(x.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    train, test = RegressionStats(x.shape[1], y.shape[1]), RegressionStats(x.shape[1], y.shape[1])
    train.update(x[:2000], y[:2000])
    test.update(x[2000:], y[2000:])
    fit = fit_side_heads(head_stats(train, src, tgt, 2), src, tgt, k=2, lam=0.01, rank=2)
    got = heldout_r2_heads(fit, head_stats(test, src, tgt, 2), src, tgt)
    for l in range(3):
        xs, ys = x[2000:, src.index(fit.sources[l].tolist())], y[2000:, tgt.block(l)]
        pred = xs @ fit.weight[l] + fit.bias[l]
        want = 1 - ((ys - pred) ** 2).sum() / ((ys - ys.mean(0)) ** 2).sum()
        torch.testing.assert_close(got[l], want, atol=1e-10, rtol=0)
    assert 0.3 < got.min() < 0.99


# -- end to end on tiny models ---------------------------------------------------------------

@pytest.fixture()
def pair(pair_dir):
    """(source, target, tokenizer, corpus) of the tiny pair."""
    return (Runner.load(pair_dir / "src"), Runner.load(pair_dir / "tgt"), Tokenizer.from_dir(pair_dir / "src"),
            load_corpus(str(pair_dir / "corpus.txt")))


CFG = CalibrationConfig(tokens=600, heldout_tokens=150, seq_len=48, k=2, rank=4, checkpoint_every=1)


def test_resumed_calibration_equals_uninterrupted(pair, tmp_path):
    source, target, tok, corpus = pair
    whole = Calibration(source, target, tok, corpus, CFG, tmp_path / "a.map").run(progress=False)
    run = Calibration(source, target, tok, corpus, CFG, tmp_path / "b.map")
    assert run.run(progress=False, max_sequences=3) is None  # "killed" after 3 sequences
    assert run.run(progress=False, max_sequences=2) is None  # and again
    resumed = Calibration(source, target, tok, corpus, CFG, tmp_path / "b.map").run(progress=False)
    assert whole.info.tokens == resumed.info.tokens == 600
    assert whole.info.calibration == resumed.info.calibration
    for side in ("k", "v"):
        for name in ("weight", "bias", "basis", "r2", "r2_single", "sources"):
            assert torch.equal(getattr(whole.sides[side], name), getattr(resumed.sides[side], name)), name
    assert whole.info.r2_heldout == resumed.info.r2_heldout and len(whole.info.r2_heldout["k"]) == 4


def test_a_state_resumes_under_other_sharpening_and_from_before_it_was_left_out(pair, tmp_path):
    """Sharpening is chosen after the statistics: a state resumes under any, including a state written
    when the run id still recorded `sharpen` (an interrupted calibration keeps its hours)."""
    import json

    from safetensors import safe_open
    from safetensors.torch import save_file

    source, target, tok, corpus = pair
    Calibration(source, target, tok, corpus, CFG, tmp_path / "m").run(progress=False, max_sequences=2)
    state = tmp_path / "m.state"
    with safe_open(str(state), framework="pt") as f:
        meta, tensors = json.loads(f.metadata()["rarecache.calibration"]), {k: f.get_tensor(k) for k in f.keys()}
    meta["run"]["config"]["sharpen"] = [1.0, 0.5]  # as states written before FIT_ONLY recorded it
    save_file(tensors, str(state), metadata={"rarecache.calibration": json.dumps(meta)})
    again = Calibration(source, target, tok, corpus, replace(CFG, plain_sharpen=(1.0, 0.5)), tmp_path / "m")
    assert again.run(progress=False) is not None and again.sequences_done > 2
    assert again.fit().info.plain_sharpen == {"k": 1.0, "v": 0.5}


def test_state_of_another_run_is_refused(pair, tmp_path):
    source, target, tok, corpus = pair
    Calibration(source, target, tok, corpus, CFG, tmp_path / "m").run(progress=False, max_sequences=1)
    other = CalibrationConfig(tokens=601, heldout_tokens=150, seq_len=48, k=2, rank=4)
    with pytest.raises(RarecacheError, match="different calibration"):
        Calibration(source, target, tok, corpus, other, tmp_path / "m").run(progress=False)


def test_map_file_round_trip_and_pair_check(pair, tmp_path):
    source, target, tok, corpus = pair
    mapper = Calibration(source, target, tok, corpus, CFG, tmp_path / "m").run(progress=False)
    mapper.save(tmp_path / "m.safetensors")
    back = Mapper.load(tmp_path / "m.safetensors")
    assert back.info == mapper.info
    for side in ("k", "v"):
        for name in ("weight", "bias", "mean", "basis", "eigenvalues", "r2", "r2_single", "sources"):
            a, b = getattr(mapper.sides[side], name), getattr(back.sides[side], name)
            assert torch.equal(a.float() if a.is_floating_point() else a, b), name
    back.check_pair(source, target)
    with pytest.raises(RarecacheError, match="runs src -> tgt.*fit a map in that direction"):
        back.check_pair(target, source)
    with pytest.raises(RarecacheError, match="fitted for src -> tgt"):
        back.check_pair(source, source)


def test_bf16_weights_halve_the_file_and_map_the_same_rows_in_bf16(pair, tmp_path):
    """A file that stores its weights in bfloat16: about half the bytes, every tensor read back as float32,
    the weights the float32 file's rounded once and the rest exact; a bfloat16 handoff maps the same rows
    from either file, a float32 one only nearly."""
    source, target, tok, corpus = pair
    mapper = Calibration(source, target, tok, corpus, CFG, tmp_path / "m").run(progress=False)
    mapper.save(tmp_path / "f32.safetensors")
    mapper.save(tmp_path / "bf16.safetensors", weights="bfloat16")
    a, b = Mapper.load(tmp_path / "f32.safetensors"), Mapper.load(tmp_path / "bf16.safetensors")
    weight_bytes = sum(f.weight.numel() for f in a.sides.values()) * 2  # what bf16 saves
    sizes = [(tmp_path / f"{n}.safetensors").stat().st_size for n in ("f32", "bf16")]
    assert abs(sizes[0] - sizes[1] - weight_bytes) < 80  # (the headers differ: dtype names, metadata, padding)
    assert (a.info.weights, b.info.weights) == ("float32", "bfloat16") and b.info == replace(a.info, weights="bfloat16")
    b.save(tmp_path / "again.safetensors")  # a map made from a bf16 file stays bf16 unless told
    assert (tmp_path / "again.safetensors").read_bytes() == (tmp_path / "bf16.safetensors").read_bytes()
    b.save(tmp_path / "back.safetensors", weights="float32")
    assert Mapper.load(tmp_path / "back.safetensors").info == a.info
    for side in ("k", "v"):
        for name in ("weight", "bias", "mean", "basis", "eigenvalues", "r2", "r2_single"):
            x, y = getattr(a.sides[side], name), getattr(b.sides[side], name)
            assert y.dtype == torch.float32, name
            want = x.to(torch.bfloat16).float() if name == "weight" else x
            assert torch.equal(y, want), name
        assert not torch.equal(a.sides[side].weight, b.sides[side].weight)  # (it did round)
    ids = tok.encode(corpus.documents[-1])[:40]
    own, _ = source.prefill([ids])
    pos = torch.arange(40)[None]
    rows = {}
    for name, m in (("f32", a), ("bf16", b)):
        for dtype in (torch.bfloat16, torch.float32):
            cache = target.new_cache(1, 40)
            m.apply(source, own, target, cache, pos, dtype=dtype)
            rows[name, dtype] = (cache.k.clone(), cache.v.clone())
    for i in range(2):
        assert torch.equal(rows["f32", torch.bfloat16][i], rows["bf16", torch.bfloat16][i])
        near, exact = rows["bf16", torch.float32][i], rows["f32", torch.float32][i]
        assert not torch.equal(near, exact)
        torch.testing.assert_close(near, exact, atol=0.05, rtol=0.05)
    with pytest.raises(RarecacheError, match="float32 or bfloat16"):
        mapper.save(tmp_path / "x.safetensors", weights="float16")
    # a file whose metadata and weights disagree is refused
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(tmp_path / "f32.safetensors"), "pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    meta["rarecache.map"] = meta["rarecache.map"][:-1] + ', "weights": "bfloat16"}'
    del meta["rarecache.map.sha256"]
    save_file(tensors, str(tmp_path / "liar.safetensors"), metadata=meta)
    with pytest.raises(RarecacheError, match="stored as bfloat16, and its tensors hold float32"):
        Mapper.load(tmp_path / "liar.safetensors")
    import re  # and one whose lambda is an integer too large for a float: one line, no traceback

    meta["rarecache.map"] = re.sub(r'"lam": [^,]+', '"lam": 1' + "0" * 400, meta["rarecache.map"])
    save_file(tensors, str(tmp_path / "huge.safetensors"), metadata=meta)
    with pytest.raises(RarecacheError, match="no valid rarecache map metadata"):
        Mapper.load(tmp_path / "huge.safetensors")


def test_bf16_weights_reach_plain_transfer_rounded(pair, tmp_path):
    """The plain view is re-sharpened from the stored weights before any cast, so a bf16 file's plain
    transfer differs from a float32 file's even in bf16 (the stored fit's does not): what the docs say."""
    from rarecache.transfer.fitting.calibrate import with_plain

    source, target, tok, corpus = pair
    mapper = with_plain(Calibration(source, target, tok, corpus, CFG, tmp_path / "m").run(progress=False), (1.0, 0.5))
    mapper.save(tmp_path / "f.safetensors")
    mapper.save(tmp_path / "b.safetensors", weights="bfloat16")
    a, b = Mapper.load(tmp_path / "f.safetensors"), Mapper.load(tmp_path / "b.safetensors")
    fit = [m.tensors("k", torch.bfloat16, "cpu")["weight"] for m in (a, b)]
    plain = [m.plain().tensors("k", torch.bfloat16, "cpu")["weight"] for m in (a, b)]
    assert torch.equal(*fit) and not torch.equal(*plain)
    torch.testing.assert_close(plain[0].float(), plain[1].float(), atol=0.02, rtol=0.02)


def test_bf16_weights_round_trip_head_matched_and_mlp_maps(fitted, tmp_path):
    """Head-matched blocks and an MLP's matrices are weights too: stored bf16, read back rounded once, the
    biases exact; a flipped byte is still caught by the checksum."""
    from rarecache.transfer import mapfile
    from rarecache.transfer.sidefit import SideMLP

    _, _, mapper, _ = fitted
    info, k = mapper.info, mapper.info.k
    sides = {s: replace(f, weight=from_head_blocks(head_blocks(f.weight, k, 2), k)) for s, f in mapper.sides.items()}
    mapfile.write(replace(info, heads=2, plain_sharpen=None), sides, None, tmp_path / "h.safetensors", "bfloat16")
    _, back, _ = mapfile.read(tmp_path / "h.safetensors")
    for s in sides:
        assert back[s].weight.dtype == torch.float32 and torch.equal(back[s].weight, sides[s].weight.bfloat16().float())
    g = torch.Generator().manual_seed(0)
    mlp = {}
    for s, f in mapper.sides.items():
        lt, kd, dt = f.weight.shape
        mlp[s] = SideMLP(torch.randn(lt, kd, 8, generator=g), torch.randn(lt, 8, generator=g),
                         torch.randn(lt, 8, dt, generator=g), torch.randn(lt, dt, generator=g))
    mapfile.write(replace(info, mlp_hidden=8, plain_sharpen=None), mapper.sides, mlp, tmp_path / "m.safetensors",
                  "bfloat16")
    _, _, got = mapfile.read(tmp_path / "m.safetensors")
    for s in mlp:
        assert torch.equal(got[s].w1, mlp[s].w1.bfloat16().float()) and torch.equal(got[s].b1, mlp[s].b1)
        assert torch.equal(got[s].w2, mlp[s].w2.bfloat16().float()) and torch.equal(got[s].b2, mlp[s].b2)
    raw = bytearray((tmp_path / "m.safetensors").read_bytes())
    raw[-3] ^= 0x40
    (tmp_path / "bad.safetensors").write_bytes(bytes(raw))
    with pytest.raises(RarecacheError, match="damaged"):
        mapfile.read(tmp_path / "bad.safetensors")


def test_map_file_is_validated(tmp_path):
    (tmp_path / "bad.safetensors").write_bytes(b"not a map")
    with pytest.raises(RarecacheError, match="not a map file"):
        Mapper.load(tmp_path / "bad.safetensors")
    with pytest.raises(RarecacheError, match="no map file"):
        Mapper.load(tmp_path / "missing.safetensors")


def test_self_map_reproduces_own_cache(pair, tmp_path):
    """A model mapped onto itself with every source layer is the identity: the mapped cache is its own."""
    source, _, tok, corpus = pair
    cfg = CalibrationConfig(tokens=1500, heldout_tokens=0, seq_len=48, k=source.num_layers, lam=1e-6, rank=4)
    mapper = Calibration(source, source, tok, corpus, cfg, tmp_path / "self").run(progress=False)
    assert mapper.sides["k"].r2.min() > 0.999 and mapper.sides["v"].r2.min() > 0.999
    ids = tok.encode(corpus.documents[-1])[:40]
    own, _ = source.prefill([ids])
    mapped = source.new_cache(1, 40)
    pos = torch.arange(40)[None]
    mapper.apply(source, own, source, mapped, pos, dtype=torch.float64)
    assert mapped.filled[0, :40].all()
    torch.testing.assert_close(mapped.k, own.k, atol=2e-3, rtol=0)
    torch.testing.assert_close(mapped.v, own.v, atol=2e-3, rtol=0)
    # and the perplexity protocol's mapped arm then scores like the model's own prefix
    from rarecache.eval.perplexity import passage_nll

    nll = passage_nll(source, source, mapper, ids, prefix=20)
    assert abs(nll["mapped"] - nll["target"]) < 1e-3 and nll["source"] == pytest.approx(nll["target"], abs=1e-5)


HEADS = CalibrationConfig(tokens=600, heldout_tokens=150, seq_len=48, k=2, rank=4, checkpoint_every=1,
                          head_matched=True)


def test_head_matched_calibration_resumes_saves_smaller_and_runs(pair, tmp_path):
    """A head-matched run accumulates per head, resumes to the same map, writes only the weight's head
    blocks (the file is smaller than the dense map's), and loads back to the same map."""
    source, target, tok, corpus = pair
    whole = Calibration(source, target, tok, corpus, HEADS, tmp_path / "a.map").run(progress=False)
    run = Calibration(source, target, tok, corpus, HEADS, tmp_path / "b.map")
    assert run.run(progress=False, max_sequences=3) is None
    resumed = Calibration(source, target, tok, corpus, HEADS, tmp_path / "b.map").run(progress=False)
    for side in ("k", "v"):
        assert torch.equal(whole.sides[side].weight, resumed.sides[side].weight)
    assert whole.info.heads == 2 and len(whole.info.r2_heldout["k"]) == 4
    dense = Calibration(source, target, tok, corpus, CFG, tmp_path / "d.map").run(progress=False)
    whole.save(tmp_path / "h.safetensors")
    dense.save(tmp_path / "d.safetensors")
    assert (tmp_path / "h.safetensors").stat().st_size < 0.75 * (tmp_path / "d.safetensors").stat().st_size
    back = Mapper.load(tmp_path / "h.safetensors")
    assert back.info == whole.info
    for side in ("k", "v"):
        torch.testing.assert_close(back.sides[side].weight, whole.sides[side].weight.float(), atol=0, rtol=0)
    back.check_pair(source, target)
    pos = torch.arange(30)[None]
    ids = tok.encode(corpus.documents[-1])[:30]
    own, _ = source.prefill([ids])
    a, b = target.new_cache(1, 30), target.new_cache(1, 30)
    back.apply(source, own, target, a, pos)
    back.apply_reference(source, own, target, b, pos)
    torch.testing.assert_close(a.k, b.k, atol=1e-5, rtol=1e-5)


def test_head_matched_refuses_models_with_other_head_counts(pair, tmp_path):
    source, target, tok, corpus = pair
    import dataclasses
    one = dataclasses.replace(source.config, num_kv_heads=1)
    source.config = one
    with pytest.raises(RarecacheError, match="head-matched maps need as many KV heads"):
        Calibration(source, target, tok, corpus, HEADS, tmp_path / "m")


def test_refit_from_the_kept_state(pair, tmp_path):
    """A dense run's kept statistics refit to the same map, to other choices, and to the head-matched map of
    the very same positions (equal to a head-matched calibration's)."""
    from rarecache.transfer.fitting.refit import refit

    source, target, tok, corpus = pair
    dense = Calibration(source, target, tok, corpus, CFG, tmp_path / "d.map").run(progress=False)
    state = tmp_path / "d.map.state"
    same = refit(dense, state)
    assert same.info == dense.info
    for side in ("k", "v"):
        assert torch.equal(same.sides[side].weight, dense.sides[side].weight)
    heads = refit(dense, state, head_matched=True)
    direct = Calibration(source, target, tok, corpus, HEADS, tmp_path / "h.map").run(progress=False)
    assert heads.info.heads == 2 and heads.info.tokens == direct.info.tokens
    for side in ("k", "v"):
        for name in ("weight", "bias", "mean", "r2"):
            torch.testing.assert_close(getattr(heads.sides[side], name), getattr(direct.sides[side], name),
                                       atol=1e-8, rtol=1e-8)
        torch.testing.assert_close(torch.tensor(heads.info.r2_heldout[side]),
                                   torch.tensor(direct.info.r2_heldout[side]), atol=1e-8, rtol=0)
    one = refit(dense, state, k=1, rank=2)
    assert one.info.k == 1 and one.sides["k"].weight.shape[1] == source.config.kv_dim
    # sharpening from the state equals a sharpened calibration, is recorded, kept by a refit, and undone by 0 0
    sharp = refit(dense, state, powers=(1.0, 0.5))
    direct = Calibration(source, target, tok, corpus, replace(CFG, sharpen=(1.0, 0.5)), tmp_path / "s.map"
                         ).run(progress=False)
    assert sharp.info.sharpen == direct.info.sharpen == {"k": 1.0, "v": 0.5} and "sharpened k:R2^-1 v:R2^-0.5" in (
        sharp.summary())
    for side in ("k", "v"):
        torch.testing.assert_close(sharp.sides[side].weight, direct.sides[side].weight, atol=1e-10, rtol=1e-10)
        assert sum(sharp.info.r2_heldout[side]) < sum(dense.info.r2_heldout[side])  # of the map as served
    assert refit(sharp, state).info.sharpen == sharp.info.sharpen
    back = refit(sharp, state, powers=(0.0, 0.0))
    assert back.info == dense.info and torch.equal(back.sides["v"].bias, dense.sides["v"].bias)
    # without the state: the sharpening is undone and redone exactly from the map alone
    from rarecache.transfer.fitting.refit import resharpen

    for start, powers, want in ((sharp, (0.0, 0.0), dense), (dense, (1.0, 0.5), sharp), (sharp, (1.0, 0.5), sharp)):
        again = resharpen(start, powers)
        assert again.info.sharpen == want.info.sharpen and again.info.r2_heldout == {}  # not measured for it
        for side in ("k", "v"):
            for name in ("weight", "bias", "mean", "eigenvalues", "basis", "r2"):
                torch.testing.assert_close(getattr(again.sides[side], name), getattr(want.sides[side], name),
                                           atol=1e-9, rtol=1e-9)
    with pytest.raises(RarecacheError, match="dense linear maps only"):
        resharpen(heads, (1.0, 0.5))
    # plain transfer's own sharpening: recorded by a calibration, kept by refits and resharpening, not by a
    # head-matched refit (which has one fit for every budget); a head-matched calibration refuses it
    from rarecache.transfer.fitting.calibrate import with_plain

    both = Calibration(source, target, tok, corpus, replace(CFG, plain_sharpen=(1.0, 0.5)), tmp_path / "p.map"
                       ).run(progress=False)
    assert both.info.plain_sharpen == {"k": 1.0, "v": 0.5} and both.info.sharpen == {}
    assert all(torch.equal(both.sides[s].weight, dense.sides[s].weight) for s in ("k", "v"))
    assert refit(both, tmp_path / "p.map.state").info.plain_sharpen == {"k": 1.0, "v": 0.5}
    assert resharpen(both, (0.5, 0.0)).info.plain_sharpen == {"k": 1.0, "v": 0.5}
    assert refit(both, tmp_path / "p.map.state", head_matched=True).info.plain_sharpen is None
    with pytest.raises(RarecacheError, match="no plain_sharpen"):
        CalibrationConfig(head_matched=True, plain_sharpen=(1.0, 0.5))
    with pytest.raises(RarecacheError, match="dense linear maps only"):
        with_plain(heads, (1.0, 0.5))
    assert with_plain(both, None).info.plain_sharpen is None
    assert both.with_mlp({}, 4).info.plain_sharpen is None  # an MLP map has one fit for every budget
    # a file whose r2 and plain sharpening would overflow the view: r2 above 1 is refused on load, and a view
    # that is not finite is refused when made
    big = {s: replace(both.sides[s], r2=both.sides[s].r2 * 0 + 1e20) for s in ("k", "v")}
    Mapper(both.info, big).save(tmp_path / "bad.safetensors")
    with pytest.raises(RarecacheError, match="r2 holds values above 1"):
        Mapper.load(tmp_path / "bad.safetensors")
    huge = {s: replace(both.sides[s], weight=both.sides[s].weight.float() * 0 + 3e37, r2=both.sides[s].r2 * 0)
            for s in ("k", "v")}
    with pytest.raises(RarecacheError, match="plain-transfer view .* is not finite"):
        Mapper(replace(both.info, plain_sharpen={"k": 2.0, "v": 0.0}), huge).plain()
    both.save(tmp_path / "both.safetensors")
    heads.save(tmp_path / "heads.safetensors")
    for base, bad, why in (("both", {"k": 3.0}, "powers in \\[0, 2\\]"), ("both", {"q": 1.0}, "powers in \\[0, 2\\]"),
                           ("both", [1.0, 0.5], "powers in \\[0, 2\\]"),
                           ("heads", {"k": 1.0}, "plain_sharpen needs a dense linear map")):
        _rewrite_meta(tmp_path / f"{base}.safetensors", tmp_path / "bad.safetensors", plain_sharpen=bad)
        with pytest.raises(RarecacheError, match="no valid rarecache map metadata.*" + why):
            Mapper.load(tmp_path / "bad.safetensors")
        with pytest.raises(RarecacheError, match="not writing .*invalid"):  # nor does save write one
            Mapper(replace(both.info, plain_sharpen=bad, heads=heads.info.heads if base == "heads" else 0),
                   both.sides).save(tmp_path / "never.safetensors")
    with pytest.raises(RarecacheError, match=r"two powers \(keys, values\) in \[0, 2\]"):
        refit(dense, state, powers=(3.0, 0.0))
    with pytest.raises(RarecacheError, match="head-matched statistics: it refits head-matched maps only"):
        refit(direct, tmp_path / "h.map.state")
    other = Calibration(source, target, tok, corpus, CalibrationConfig(tokens=300, heldout_tokens=0, seq_len=48,
                                                                       k=2, rank=4), tmp_path / "o.map")
    other.run(progress=False)
    with pytest.raises(RarecacheError, match="holds 300 fit positions, the map 600"):
        refit(dense, tmp_path / "o.map.state")
    (tmp_path / "junk").write_bytes(b"junk")
    with pytest.raises(RarecacheError, match="is not a calibration state"):
        refit(dense, tmp_path / "junk")


def _rewrite_meta(src, dst, **changes):
    """A copy of map file `src` with fields of its metadata changed (tensors and their checksum kept)."""
    import json

    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(src), framework="pt") as f:
        meta, tensors = dict(f.metadata()), {k: f.get_tensor(k) for k in f.keys()}
    meta["rarecache.map"] = json.dumps({**json.loads(meta["rarecache.map"]), **changes})
    save_file(tensors, str(dst), metadata=meta)


def test_a_saved_map_is_the_same_bytes_every_time(pair, tmp_path):
    """safetensors writes metadata from a hash map in a per-process random order; Mapper.save puts it in
    key order, so saving a map again gives the same file (results name their map by its sha256)."""
    import hashlib

    from rarecache.transfer.fitting.calibrate import with_plain
    from rarecache.transfer.mapper import Mapper

    source, target, tok, corpus = pair
    mapper = with_plain(Calibration(source, target, tok, corpus, replace(CFG, heldout_tokens=0), tmp_path / "m"
                                    ).run(progress=False), (1.0, 0.5))
    digests = set()
    for i in range(6):
        mapper.save(tmp_path / f"{i}.safetensors")
        digests.add(hashlib.sha256((tmp_path / f"{i}.safetensors").read_bytes()).hexdigest())
    assert len(digests) == 1
    raw = (tmp_path / "0.safetensors").read_bytes()
    assert raw[8:].startswith(b'{"__metadata__":{"rarecache.map":') and b'"rarecache.map.sha256"' in raw[:20000]
    assert Mapper.load(tmp_path / "0.safetensors").info.plain_sharpen == {"k": 1.0, "v": 0.5}
