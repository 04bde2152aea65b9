"""Attention-sensitivity weighting of the calibration ridge (`calibrate --attention-weights`): the weights,
the weighted statistics against repeated rows, the attention received against its definition, and a
weighted calibration that resumes, refits and records itself."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from rarecache.cli import main
from rarecache.engine.runner import Runner
from rarecache.errors import RarecacheError
from rarecache.models.tokenizer import Tokenizer
from rarecache.transfer.fitting.calibrate import Calibration, CalibrationConfig, attention_weights, run_config
from rarecache.transfer.fitting.corpus import load_corpus
from rarecache.transfer.features import SIDES, features, features_received
from rarecache.transfer.mapper import Mapper
from rarecache.transfer.fitting.refit import refit
from rarecache.transfer.fitting.stats import RegressionStats

BASE = CalibrationConfig(tokens=400, heldout_tokens=100, seq_len=48, k=2, rank=4, checkpoint_every=1)


def test_weights_mean_one_capped_and_off_at_power_zero():
    received = torch.tensor([40.0, 1.0, 2.0, 0.5, 0.5])  # a sink, then ordinary positions
    w = attention_weights(received, 1.0, 3.0)
    assert w.mean().item() == pytest.approx(1.0) and w.dtype == torch.float64
    # before scaling: 40/8.8 = 4.5 -> capped at 3; the rest in proportion to what they receive
    raw = torch.tensor([3.0, 1 / 8.8, 2 / 8.8, 0.5 / 8.8, 0.5 / 8.8], dtype=torch.float64)
    torch.testing.assert_close(w, raw * 5 / raw.sum())
    assert torch.equal(attention_weights(received, 0.0, 3.0), torch.ones(5, dtype=torch.float64))
    sq = attention_weights(received, 0.5, 100.0)
    assert sq[0] / sq[1] == pytest.approx(40 ** 0.5)


def test_weighted_statistics_equal_repeated_rows():
    """Integer weights give the sums of the rows repeated that many times (a weighted ridge is one on
    repeated data); n still counts the rows given."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(4, 3, generator=g), torch.randn(4, 2, generator=g)
    w = torch.tensor([2.0, 0.0, 1.0, 1.0])
    weighted, repeated = RegressionStats(3, 2), RegressionStats(3, 2)
    weighted.update(x, y, w)
    idx = torch.tensor([0, 0, 2, 3])
    repeated.update(x[idx], y[idx])
    for name in ("sx", "sy", "syy", "xx", "xy"):
        torch.testing.assert_close(getattr(weighted, name), getattr(repeated, name))
    assert weighted.n == 4
    with pytest.raises(ValueError, match="average 1"):
        RegressionStats(3, 2).update(x, y, torch.tensor([2.0, 2.0, 1.0, 1.0]))
    plain = RegressionStats(3, 2)
    plain.update(x, y, torch.ones(4))
    unweighted = RegressionStats(3, 2)
    unweighted.update(x, y)
    assert torch.equal(plain.xx, unweighted.xx) and torch.equal(plain.xy, unweighted.xy)


def test_attention_received_is_the_sum_of_what_queries_read(pair_dir):
    """Every query's probabilities sum to 1 and read only positions up to its own: with every query read,
    the positions receive T in all and position t at most T - t (the last only what it gives itself);
    sampling every 4th query scales its sum back to T. The rows are calibration's plain prefill's."""
    target = Runner.load(pair_dir / "tgt")
    tok = Tokenizer.from_dir(pair_dir / "src")
    ids = tok.encode(load_corpus(str(pair_dir / "corpus.txt")).documents[0])[:29]
    T = len(ids)
    keep = torch.arange(2, T, 3)
    ys, received = features_received(target, ids, keep, every=1)
    plain = features(target, ids, keep)
    for s in SIDES:
        assert torch.equal(ys[s], plain[s])  # the probabilities are computed on the side
    assert received.shape == (T,) and received.sum().item() == pytest.approx(T, rel=1e-4)
    assert bool((received <= torch.arange(T, 0, -1) + 1e-4).all()) and bool((received > 0).all())
    sampled = features_received(target, ids, keep, every=4)[1]
    assert sampled.sum().item() == pytest.approx(T, rel=1e-4)  # 8 sampled queries (0, 4, ..., 28), scaled by T/8
    assert not torch.allclose(sampled, received)  # an estimate, not the same figure


@pytest.fixture(scope="module")
def models(pair_dir):
    source, target = Runner.load(pair_dir / "src"), Runner.load(pair_dir / "tgt")
    return source, target, Tokenizer.from_dir(pair_dir / "src"), load_corpus(str(pair_dir / "corpus.txt"))


def test_weighted_calibration_records_resumes_and_refits(models, tmp_path):
    """A weighted calibration fits another map than the plain one (on the same positions), records its
    weighting, resumes to the same map, refits from its state, and leaves held-out R² unweighted; states of
    the plain and weighted runs do not mix, and a plain run's identity is what it was before the option."""
    source, target, tok, corpus = models
    cfg = replace(BASE, attention_weights=1.0, weight_cap=4.0)
    plain = Calibration(source, target, tok, corpus, BASE, tmp_path / "p.map").run(progress=False)
    run = Calibration(source, target, tok, corpus, cfg, tmp_path / "w.map")
    assert run.run(progress=False, max_sequences=3) is None
    weighted = Calibration(source, target, tok, corpus, cfg, tmp_path / "w.map").run(progress=False)
    whole = Calibration(source, target, tok, corpus, cfg, tmp_path / "w2.map").run(progress=False)
    for s in SIDES:
        assert torch.equal(weighted.sides[s].weight, whole.sides[s].weight)
        assert not torch.allclose(weighted.sides[s].weight, plain.sides[s].weight)
    assert weighted.info.calibration["attention_weights"] == {"power": 1.0, "cap": 4.0, "query_every": 4}
    assert "attention_weights" not in plain.info.calibration
    assert weighted.info.tokens == plain.info.tokens
    again = refit(weighted, tmp_path / "w.map.state")
    assert torch.equal(again.sides["k"].weight, weighted.sides["k"].weight)
    with pytest.raises(RarecacheError, match="disagree on attention weights"):
        refit(plain, tmp_path / "w.map.state")  # (same positions, so only the record tells them apart)
    with pytest.raises(RarecacheError, match="different calibration"):
        Calibration(source, target, tok, corpus, BASE, tmp_path / "w.map").run(progress=False)
    assert "attention_weights" not in run_config(BASE) and "weight_cap" not in run_config(BASE)
    assert run_config(cfg)["attention_weights"] == 1.0
    path = tmp_path / "w.safetensors"
    weighted.save(path)
    assert Mapper.load(path).info.calibration["attention_weights"]["power"] == 1.0
    for bad in (dict(attention_weights=-1.0), dict(attention_weights=5.0), dict(weight_cap=0.5),
                dict(weight_cap=float("nan")), dict(attention_weights=float("nan"))):
        with pytest.raises(RarecacheError, match="attention weights"):
            CalibrationConfig(**bad)


def test_calibrate_cli_takes_attention_weights(pair_dir, tmp_path, capsys):
    out = tmp_path / "a.safetensors"
    args = ["calibrate", "--source", str(pair_dir / "src"), "--target", str(pair_dir / "tgt"), "--corpus",
            str(pair_dir / "corpus.txt"), "--tokens", "200", "--heldout-tokens", "50", "--seq-len", "48",
            "--k", "2", "--rank", "4", "--dtype", "float32", "--attention-weights", "0.5", "--out", str(out)]
    assert main(args) == 0
    assert Mapper.load(out).info.calibration["attention_weights"] == {"power": 0.5, "cap": 8.0, "query_every": 4}
    capsys.readouterr()
    assert main(args[:-2] + ["--weight-cap", "0", "--out", str(tmp_path / "b.safetensors")]) == 2
    assert "attention weights take a power" in capsys.readouterr().err
    plain_args = [a for a in args[:-2] if a not in ("--attention-weights", "0.5")]
    assert main(plain_args + ["--weight-cap", "4", "--out", str(tmp_path / "c.safetensors")]) == 2
    assert "--weight-cap belongs to --attention-weights" in capsys.readouterr().err
