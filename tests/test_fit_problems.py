"""A map that fits badly says so (issue 41, item 3): `Mapper.fit_problems` from the map's own record,
warnings from `calibrate` and `inspect`, and `serve` / the vLLM connector refusing it unless told to
accept it. The poor map is a deliberately tiny calibration (40 positions for 96 inputs per layer)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from rarecache.cli import main
from rarecache.engine.runner import Runner
from rarecache.errors import RarecacheError
from rarecache.models.tokenizer import Tokenizer
from rarecache.transfer.fitting.calibrate import Calibration, CalibrationConfig
from rarecache.transfer.fitting.corpus import load_corpus
from rarecache.transfer.mapcheck import POOR_GAP, POOR_R2
from rarecache.transfer.mapper import Mapper

POOR = CalibrationConfig(tokens=40, heldout_tokens=100, seq_len=48, k=3, rank=4, lam=1e-6)


@pytest.fixture(scope="module")
def maps(pair_dir, tmp_path_factory):
    """{"poor": the tiny calibration saved, "self": a source -> source map that fits (held out too)}."""
    source, target = Runner.load(pair_dir / "src"), Runner.load(pair_dir / "tgt")
    tok, corpus = Tokenizer.from_dir(pair_dir / "src"), load_corpus(str(pair_dir / "corpus.txt"))
    root = tmp_path_factory.mktemp("poor")
    poor = Calibration(source, target, tok, corpus, POOR, root / "poor").run(progress=False)
    good = Calibration(source, source, tok, corpus, replace(POOR, tokens=500, heldout_tokens=150), root / "self"
                       ).run(progress=False)
    poor.save(root / "poor.safetensors")
    return {"poor": poor, "self": good, "root": root}


def test_fit_problems_from_the_maps_own_record(maps):
    poor, good = maps["poor"], maps["self"]
    held = {s: sum(v) / len(v) for s, v in poor.info.r2_heldout.items()}
    assert held["v"] < POOR_R2 and held["k"] < POOR_R2  # the premise: 40 positions fit nothing held out
    problems = poor.fit_problems()
    assert len(problems) == 2 and problems[0].startswith("held-out R2 of the keys is ")
    assert all(f"(below {POOR_R2})" in p for p in problems)
    with pytest.raises(RarecacheError, match="fits badly: held-out R2 of the keys.*--accept-poor-map"):
        poor.check_fit()
    assert poor.check_fit(accept=True) == problems
    # a map that fits, held out too, has none; nor does a map with no held-out R2 (nothing to judge by)
    assert min(min(v) for v in good.info.r2_heldout.values()) > 0.99 and good.fit_problems() == []
    assert replace_info(poor, r2_heldout={}).fit_problems() == []
    # held out well enough but far below in-sample: the gap alone
    r2 = {s: float(poor.sides[s].r2.mean()) for s in "kv"}
    gap = replace_info(poor, r2_heldout={s: [r2[s] - POOR_GAP - 0.01] * 4 for s in "kv"}).fit_problems()
    assert len(gap) == 2 and all(f"more than {POOR_GAP}" in p and "below in-sample" in p for p in gap)
    assert replace_info(poor, r2_heldout={s: [r2[s] - POOR_GAP + 0.01] * 4 for s in "kv"}).fit_problems() == []
    # the values alone
    one = replace_info(poor, r2_heldout={"k": [r2["k"]] * 4, "v": [0.1] * 4}).fit_problems()
    assert one == ["held-out R2 of the values is 0.100 (below 0.2)"]


def replace_info(mapper: Mapper, **changes) -> Mapper:
    return Mapper(replace(mapper.info, **changes), mapper.sides)


def test_calibrate_and_inspect_warn(pair_dir, maps, tmp_path, capsys):
    out = tmp_path / "p.safetensors"
    args = ["calibrate", "--source", str(pair_dir / "src"), "--target", str(pair_dir / "tgt"), "--corpus",
            str(pair_dir / "corpus.txt"), "--tokens", "40", "--heldout-tokens", "100", "--seq-len", "48", "--k", "3",
            "--rank", "4", "--lam", "1e-6", "--dtype", "float32", "--out", str(out)]
    capsys.readouterr()
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "warning: this map fits badly: held-out R2 of the keys" in err and "--accept-poor-map" in err
    assert main(["inspect", str(out)]) == 0
    captured = capsys.readouterr()
    assert "warning: this map fits badly" in captured.err and "warning" not in captured.out
    maps["self"].save(tmp_path / "self.safetensors")
    assert main(["inspect", str(tmp_path / "self.safetensors")]) == 0
    assert "warning" not in capsys.readouterr().err


def test_serve_refuses_a_poor_map_unless_accepted(pair_dir, maps, tmp_path, monkeypatch, capsys):
    pytest.importorskip("fastapi")
    import uvicorn

    started = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: started.update(app=app))
    poor = maps["root"] / "poor.safetensors"
    args = ["serve", "--source", str(pair_dir / "src"), "--target", str(pair_dir / "tgt"), "--dtype", "float32",
            "--map", str(poor)]
    capsys.readouterr()
    assert main(args) == 2 and not started
    err = capsys.readouterr().err
    error = [line for line in err.splitlines() if line.startswith("rarecache: error:")]
    assert len(error) == 1 and error[0].startswith(f"rarecache: error: the map {poor} fits badly: held-out R2")
    assert main([*args, "--reverse-map", str(poor), "--accept-poor-map"]) == 2  # (each map is checked: the
    assert "fits badly" not in capsys.readouterr().err  # reverse map is refused for its pair, not its fit)
    assert main([*args, "--accept-poor-map"]) == 0 and "app" in started


def test_the_vllm_connector_refuses_a_poor_map_unless_accepted(pair_dir, maps, tmp_path):
    from rarecache.adapters.vllm.connector.core import read_settings
    from rarecache.adapters.vllm.server.serving import VllmChatService, VllmServeConfig

    poor = str(maps["root"] / "poor.safetensors")
    extra = {"store": str(tmp_path), "selector": "rank", "maps": {"src": poor}}
    with pytest.raises(RarecacheError, match=r"maps\['src'\] .* fits badly: held-out R2"):
        read_settings(extra, pair_dir / "tgt")
    ok = read_settings({**extra, "accept_poor_map": True}, pair_dir / "tgt")
    assert ok.peers["src"].mapper.fit_problems()
    with pytest.raises(RarecacheError, match="accept_poor_map must be true or false"):
        read_settings({**extra, "accept_poor_map": "yes"}, pair_dir / "tgt")
    # the service refuses it before any engine starts
    models = {"src": pair_dir / "src", "tgt": pair_dir / "tgt"}
    with pytest.raises(RarecacheError, match="the map src -> tgt .* fits badly"):
        VllmChatService(models, {("src", "tgt"): maps["root"] / "poor.safetensors"}, VllmServeConfig(store=tmp_path))
