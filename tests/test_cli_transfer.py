"""calibrate / inspect / generate --map / ppl / bench map, end to end on a tiny pair."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest
import torch

from rarecache.cli import main
from rarecache.transfer.mapper import Mapper


@pytest.fixture(scope="module")
def mapped(pair_dir, tmp_path_factory):
    """The tiny pair's directory with a map m.safetensors fitted by the CLI."""
    root = tmp_path_factory.mktemp("mapped")
    for name in ("src", "tgt", "corpus.txt"):
        (root / name).symlink_to(pair_dir / name)
    args = ["calibrate", "--source", str(root / "src"), "--target", str(root / "tgt"), "--corpus",
            str(root / "corpus.txt"), "--tokens", "400", "--heldout-tokens", "100", "--seq-len", "48",
            "--k", "2", "--rank", "4", "--dtype", "float32", "--out", str(root / "m.safetensors")]
    assert main(args) == 0
    return root


def test_calibrate_writes_a_map_and_inspect_reads_it(mapped, capsys):
    assert (mapped / "m.safetensors").is_file() and not (mapped / "m.safetensors.state").exists()
    from rarecache.transfer.mapper import Mapper

    capsys.readouterr()
    assert main(["inspect", str(mapped / "m.safetensors")]) == 0
    out = capsys.readouterr().out
    summary = Mapper.load(mapped / "m.safetensors").summary()
    assert out.startswith(summary + "\n") and summary.startswith("map src -> tgt: ridge, k=2 lambda=0.01 rank=4 tokens=400")
    assert [line.split()[:2] for line in summary.splitlines()[1:]] == [["R2", "keys"], ["R2", "values"]]
    assert "held-out mean" in summary and len(out.splitlines()) == 3 + 3 + 1 + 4  # one row per target layer
    assert main(["inspect", str(mapped / "m.safetensors"), "--json", "--plot", str(mapped / "r2.png")]) == 0
    info = json.loads(capsys.readouterr().out)
    assert len(info["r2"]["k"]) == 4 and info["info"]["k"] == 2 and info["info"]["tokens"] == 400
    assert len(info["info"]["r2_heldout"]["v"]) == 4
    assert (mapped / "r2.png").read_bytes()[:4] == b"\x89PNG"


def test_keep_state_then_refit_head_matched(mapped, tmp_path, capsys):
    """calibrate --keep-state leaves the statistics; refit turns them into the head-matched map of the same
    positions, which inspect reads and names; refit without a state says how to get one."""
    out = tmp_path / "d.safetensors"
    args = ["calibrate", "--source", str(mapped / "src"), "--target", str(mapped / "tgt"), "--corpus",
            str(mapped / "corpus.txt"), "--tokens", "300", "--heldout-tokens", "0", "--seq-len", "48",
            "--k", "2", "--rank", "4", "--dtype", "float32", "--keep-state", "--out", str(out)]
    assert main(args) == 0 and (tmp_path / "d.safetensors.state").is_file()
    assert main(["refit", "--map", str(out), "--head-matched", "--out", str(tmp_path / "h.safetensors")]) == 0
    assert "head-matched ridge, k=2" in capsys.readouterr().out
    assert main(["inspect", str(tmp_path / "h.safetensors")]) == 0
    assert "head-matched ridge" in capsys.readouterr().out
    assert main(["refit", "--map", str(out), "--sharpen", "1", "0.5", "--out", str(tmp_path / "s.safetensors")]) == 0
    assert "ridge, sharpened k:R2^-1 v:R2^-0.5, k=2" in capsys.readouterr().out
    assert Mapper.load(tmp_path / "s.safetensors").info.sharpen == {"k": 1.0, "v": 0.5}
    assert main(["refit", "--map", str(out), "--sharpen", "3", "0", "--out", str(tmp_path / "b.safetensors")]) == 2
    assert "two powers (keys, values) in [0, 2]" in capsys.readouterr().err
    assert main(["refit", "--map", str(mapped / "m.safetensors"), "--out", str(tmp_path / "x")]) == 2
    assert "calibrate with --keep-state" in capsys.readouterr().err
    # --weights-dtype alone needs no state: the same map, its weights stored in bfloat16
    assert main(["refit", "--map", str(mapped / "m.safetensors"), "--weights-dtype", "bfloat16",
                 "--out", str(tmp_path / "half.safetensors")]) == 0
    whole, half = Mapper.load(mapped / "m.safetensors"), Mapper.load(tmp_path / "half.safetensors")
    assert half.info.weights == "bfloat16" and torch.equal(half.sides["v"].bias, whole.sides["v"].bias)
    assert half.info == replace(whole.info, weights="bfloat16")
    assert torch.equal(half.sides["k"].weight, whole.sides["k"].weight.bfloat16().float())
    assert (tmp_path / "half.safetensors").stat().st_size < 0.75 * (mapped / "m.safetensors").stat().st_size
    # a map made from it stays bf16 unless told: --plain-sharpen changes only the metadata
    assert main(["refit", "--map", str(tmp_path / "half.safetensors"), "--plain-sharpen", "1", "0.5",
                 "--out", str(tmp_path / "half2.safetensors")]) == 0
    half2 = Mapper.load(tmp_path / "half2.safetensors")
    assert half2.info.weights == "bfloat16" and torch.equal(half2.sides["k"].weight, half.sides["k"].weight)
    # --sharpen alone needs no state: the sharpened map, its state gone, back to plain ridge
    (tmp_path / "s.safetensors.state").unlink(missing_ok=True)
    assert main(["refit", "--map", str(tmp_path / "s.safetensors"), "--sharpen", "0", "0",
                 "--out", str(tmp_path / "u.safetensors")]) == 0
    plain, back = Mapper.load(out), Mapper.load(tmp_path / "u.safetensors")
    assert back.info.sharpen == {} and back.info.r2_heldout == {}
    torch.testing.assert_close(back.sides["k"].weight, plain.sides["k"].weight, atol=1e-6, rtol=1e-6)
    assert main(["refit", "--map", str(tmp_path / "s.safetensors"), "--sharpen", "0", "0", "--k", "1",
                 "--out", str(tmp_path / "x")]) == 2
    assert "only --sharpen and --plain-sharpen can change without it" in capsys.readouterr().err
    # --plain-sharpen alone: the same tensors, plain transfer's sharpening recorded beside them
    assert main(["refit", "--map", str(tmp_path / "u.safetensors"), "--plain-sharpen", "1", "0.5",
                 "--out", str(tmp_path / "p.safetensors")]) == 0
    assert "ridge; plain transfer (rho 0) k:R2^-1 v:R2^-0.5" in capsys.readouterr().out
    both = Mapper.load(tmp_path / "p.safetensors")
    assert both.info.plain_sharpen == {"k": 1.0, "v": 0.5} and both.info.sharpen == {}
    assert all(torch.equal(both.sides[s].weight, back.sides[s].weight) for s in ("k", "v"))
    assert main(["refit", "--map", str(tmp_path / "p.safetensors"), "--plain-sharpen", "0", "3",
                 "--out", str(tmp_path / "x")]) == 2
    # with a state beside the map, --plain-sharpen alone still changes only the metadata
    assert main(["refit", "--map", str(out), "--plain-sharpen", "1", "0.5", "--out", str(tmp_path / "q.safetensors")]) == 0
    q, d = Mapper.load(tmp_path / "q.safetensors"), Mapper.load(out)
    assert q.info.r2_heldout == d.info.r2_heldout and all(torch.equal(q.sides[s].bias, d.sides[s].bias) for s in "kv")


def test_generate_with_handoff(mapped, capsys):
    base = ["generate", "--model", str(mapped / "tgt"), "--source", str(mapped / "src"), "--map",
            str(mapped / "m.safetensors"), "--dtype", "float32", "--max-new-tokens", "6", "--json", "the quick fox"]
    capsys.readouterr()
    assert main(base + ["--rho", "1", "--compare"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["text"] == out["target_alone"] and out["agreement_with_target"] == 1.0
    assert out["recomputed"] == out["prompt_tokens"]
    assert set(out["timings"]) == {"source_prefill", "map", "score", "recompute", "decode"}
    assert main(base + ["--rho", "0.3", "--selector", "random"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["recomputed"] == -(-3 * out["prompt_tokens"] // 10)


def test_wrong_direction_is_refused(mapped, capsys):
    code = main(["generate", "--model", str(mapped / "src"), "--source", str(mapped / "tgt"), "--map",
                 str(mapped / "m.safetensors"), "hi"])
    assert code == 2 and "fit a map in that direction" in capsys.readouterr().err


def test_mlp_adds_the_nonlinear_option_on_the_maps_own_text_only(mapped, tmp_path, capsys):
    from rarecache.transfer.mapper import Mapper

    base = ["mlp", str(mapped / "m.safetensors"), "--source", str(mapped / "src"), "--target", str(mapped / "tgt"),
            "--tokens", "96", "--heldout-tokens", "48", "--seq-len", "48", "--hidden", "8", "--epochs", "2",
            "--dtype", "float32", "--out", str(tmp_path / "mlp.safetensors")]
    assert main([*base, "--corpus", str(mapped / "corpus.txt")]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["hidden"] == 8 and set(res["heldout_r2"]) == {"k", "v"}
    assert Mapper.load(tmp_path / "mlp.safetensors").info.corpus == Mapper.load(mapped / "m.safetensors").info.corpus
    other = tmp_path / "other.txt"
    other.write_text((mapped / "corpus.txt").read_text()[::-1])
    assert main([*base, "--corpus", str(other)]) == 2  # not the map's calibration text
    assert "m.safetensors was calibrated on" in capsys.readouterr().err


def test_ppl_and_its_disjointness_check(mapped, capsys):
    base = ["ppl", "--source", str(mapped / "src"), "--target", str(mapped / "tgt"), "--map",
            str(mapped / "m.safetensors"), "--corpus", str(mapped / "corpus.txt"), "--passages", "2",
            "--prefix", "16", "--continuation", "16", "--dtype", "float32"]
    assert main(base + ["--out", str(mapped / "ppl.json")]) == 0
    res = json.loads((mapped / "ppl.json").read_text())
    assert set(res["ppl"]) == {"target", "mapped", "source"} and res["first_document"] > 0
    assert all(v > 1 for v in res["ppl"].values())
    capsys.readouterr()
    assert main(base + ["--first-document", "0"]) == 2
    assert "were used to fit the map" in capsys.readouterr().err


def test_bench_map_prints_table_then_json(mapped, capsys):
    capsys.readouterr()
    assert main(["bench", "map", "--source", str(mapped / "src"), "--target", str(mapped / "tgt"), "--map",
                 str(mapped / "m.safetensors"), "--lengths", "32", "48", "--repeats", "2", "--dtype", "float32"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == "map vs target prefill, src -> tgt, float32, batch 1, median of 2 after a warm-up"
    assert lines[1].split() == ["T", "prefill", "ms", "map", "ms", "score", "ms", "map/prefill", "(map+score)/prefill"]
    last = json.loads(lines[-1])
    assert {k: last[k] for k in ("bench", "source", "target", "dtype")} == {
        "bench": "map", "source": "src", "target": "tgt", "dtype": "float32"}
    assert [r["T"] for r in last["rows"]] == [32, 48] and len(lines) == 2 + 2 + 1
    for r, line in zip(last["rows"], lines[2:-1]):
        assert all(r[k] > 0 for k in ("prefill_ms", "map_ms", "score_ms"))
        assert r["prefill_spread_ms"] >= 0 and r["map_spread_ms"] >= 0
        assert r["map_over_prefill"] == pytest.approx(r["map_ms"] / r["prefill_ms"])
        assert r["map_score_over_prefill"] == pytest.approx((r["map_ms"] + r["score_ms"]) / r["prefill_ms"])
        cells = line.split()  # the table row shows the JSON row's figures, rounded
        assert int(cells[0]) == r["T"]
        for cell, key, digits in zip(cells[1:], ("prefill_ms", "map_ms", "score_ms", "map_over_prefill",
                                                 "map_score_over_prefill"), (1, 1, 1, 3, 3)):
            assert cell == f"{r[key]:.{digits}f}"


def test_inspect_strip(mapped, capsys):
    out = mapped / "strip.png"
    assert main(["inspect", str(mapped / "m.safetensors"), "--strip", str(out), "--source", str(mapped / "src"),
                 "--target", str(mapped / "tgt"), "--prompt", "the quick brown fox jumps over the lazy dog",
                 "--chat", "--rho", "0.3", "--dtype", "float32", "--selectors", "rank", "random", "l2-oracle"]) == 0
    data = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    n = len(data["tokens"])
    assert set(data["picks"]) == {"rank", "random", "l2-oracle (oracle)"} and len(data["rank_scores"]) == n
    assert all(len(p) == -(-3 * n // 10) and p[-1] == n - 1 for p in data["picks"].values())
    assert out.read_bytes()[:4] == b"\x89PNG"


def test_bench_handoff_table_and_ceilings(mapped, capsys):
    assert main(["bench", "handoff", "--source", str(mapped / "src"), "--target", str(mapped / "tgt"), "--map",
                 str(mapped / "m.safetensors"), "--lengths", "40", "--rhos", "0.3", "1", "--batches", "1", "2",
                 "--repeats", "1", "--dtype", "float32", "--out", str(mapped / "bench" / "handoff.json"),
                 "--no-summary"]) == 0  # the summary file: tests/test_bench_handoff.py
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert json.loads((mapped / "bench" / "handoff.json").read_text()) == res  # --out holds what was printed
    assert [(r["batch"], r["rho"]) for r in res["rows"]] == [(1, 0.3), (1, 1.0), (2, 0.3), (2, 1.0)]
    assert all(r["handoff_ms"] > 0 and r["ceiling_sparse"] >= r["ceiling_dense"] for r in res["rows"])


def test_eq11_ceilings_limits(mapped):
    from rarecache.bench.handoffbench import ceilings
    from rarecache.engine.runner import Runner
    from rarecache.transfer.mapper import Mapper

    target, mapper = Runner.load(mapped / "tgt"), Mapper.load(mapped / "m.safetensors")
    dense, sparse = ceilings(target, mapper, 10**9, 0.3)  # attention dominates: 1/(2ρ) and 1/ρ
    assert dense == pytest.approx(1 / 0.6, rel=1e-3) and sparse == pytest.approx(1 / 0.3, rel=1e-3)
    dense, sparse = ceilings(target, mapper, 1, 1.0)  # ρ = 1 costs more than a prefill: below 1
    assert dense < 1 and sparse < 1


def test_bench_ablate_and_its_references(mapped, capsys):
    import torch

    from rarecache.bench.ablate import map_unshared
    from rarecache.engine.runner import Runner
    from rarecache.transfer.mapper import Mapper

    source, target = Runner.load(mapped / "src"), Runner.load(mapped / "tgt")
    mapper = Mapper.load(mapped / "m.safetensors")
    src_cache, _ = source.prefill([list(range(5, 45))])
    pos = torch.arange(40)[None]
    a, b = target.new_cache(1, 40), target.new_cache(1, 40)
    mapper.apply(source, src_cache, target, a, pos)
    map_unshared(source, src_cache, target, b, pos, mapper, torch.float32)
    torch.testing.assert_close(a.k, b.k, atol=1e-5, rtol=0)
    torch.testing.assert_close(a.v, b.v, atol=1e-5, rtol=0)
    from rarecache.bench.ablate import map_rows_flat
    from rarecache.transfer.features import rows

    x = rows(source, src_cache, pos, "v")
    torch.testing.assert_close(mapper.map_rows("v", x)[0], map_rows_flat(mapper, "v", x), atol=1e-5, rtol=0)
    assert main(["bench", "ablate", "--source", str(mapped / "src"), "--target", str(mapped / "tgt"), "--map",
                 str(mapped / "m.safetensors"), "--length", "300", "--batch", "2", "--repeats", "1",
                 "--dtype", "float32"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(res["rows"]) == 10 and all(r["before_ms"] > 0 and r["after_ms"] > 0 for r in res["rows"])
    from rarecache.models.packed import can_pack

    if can_pack(torch.bfloat16, "cpu"):  # bf16: the packed target against a plain copy of it, three more rows
        assert main(["bench", "ablate", "--source", str(mapped / "src"), "--target", str(mapped / "tgt"), "--map",
                     str(mapped / "m.safetensors"), "--length", "100", "--batch", "2", "--repeats", "1",
                     "--dtype", "bfloat16"]) == 0
        res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert sum(r["optimisation"].startswith("prepacked weights") for r in res["rows"]) == 3


def test_pipeline_batch_equals_single_requests(mapped):
    from rarecache import LLM, SamplingConfig
    from rarecache.transfer.handoff import HandoffConfig
    from rarecache.transfer.pipeline import Pipeline

    pipe = Pipeline(LLM(mapped / "src"), LLM(mapped / "tgt"), mapped / "m.safetensors")
    prompts = ["the quick brown fox jumps over the lazy dog", "def add", "tokens and spaces and tabs"]
    sampling = SamplingConfig(max_new_tokens=5, ignore_eos=True)
    for cfg in (HandoffConfig(rho=0.3, selector="rank"), HandoffConfig(rho=0.5, selector="attn-source")):
        outs, res = pipe.generate(prompts, cfg, sampling)
        for i, p in enumerate(prompts):
            one, one_res = pipe.generate([p], cfg, sampling)
            assert outs[i].tokens == one[0].tokens and res.positions[i] == one_res.positions[0]


def test_eval_run_and_report_with_two_maps(mapped, capsys, monkeypatch, tmp_path):
    from rarecache.eval.results import load_results
    from rarecache.eval.tasks import TASKS

    from .test_eval import ToyChoice

    monkeypatch.setitem(TASKS, "toychoice", ToyChoice)
    m = str(mapped / "m.safetensors")
    out = tmp_path / "r.jsonl"
    base = ["eval", "run", "--task", "toychoice", "--source", str(mapped / "src"), "--target", str(mapped / "tgt"),
            "--dtype", "float32", "--limit", "2", "--out", str(out)]
    capsys.readouterr()
    assert main(base + ["--map", f"a={m}", f"b={m}", "--rhos", "0", "0.5", "--selectors", "random", "l2-oracle"]) == 0
    table = capsys.readouterr().out
    rows = load_results(out)
    arms = {r["arm"] for r in rows}
    assert arms == {"target", "source"} | {f"rho={r}/{s}@{m}" for m in "ab" for r, s in
                                           (("0", "rank"), ("0.5", "rank"), ("0.3", "random"), ("0.3", "l2-oracle"))}
    assert re.search(r"rho=0\.3/l2-oracle@a\[[0-9a-f]{8}\] \(oracle\)", table) and out.with_suffix(".md").read_text().strip() == table.strip()
    meta = json.loads(out.with_suffix(".meta.json").read_text())
    assert set(meta["maps"]) == {"a", "b"} and meta["dtype"] == "float32"
    assert main(["eval", "report", str(out), "--plots", str(tmp_path / "plots")]) == 0
    assert (tmp_path / "plots" / "r-vs-rho.png").is_file() and (tmp_path / "plots" / "r-selectors.png").is_file()
    for bad, msg in ((["--map", m, f"b={m}"], "need labels"), (["--map", f"a={m}", "--arms", "0.3:rank@z"], "names map"),
                     (["--map", str(tmp_path / "none.safetensors")], "no map file"),
                     (["--map", f"a={m}", "--start", "99"], "past them")):
        capsys.readouterr()
        assert main(base + bad) == 2, bad
        assert msg in capsys.readouterr().err


# -- a map is untrusted input (#18): checked against both models, every tensor finite, data unchanged


def _edited(mapper, **per_tensor):
    """A copy of `mapper` whose named tensors (both sides) are replaced by fn(tensor), its held-out R2
    cut to as many target layers as the new weights have (self-consistent, as a bad fit would be)."""
    import dataclasses

    from rarecache.transfer.mapper import Mapper

    sides = {s: dataclasses.replace(f, **{n: fn(getattr(f, n).clone()) for n, fn in per_tensor.items()})
             for s, f in mapper.sides.items()}
    lt = sides["k"].weight.shape[0]
    info = dataclasses.replace(mapper.info, r2_heldout={s: v[:lt] for s, v in mapper.info.r2_heldout.items()})
    return Mapper(info, sides)


def _set(index, value):
    def fn(t):
        t[index] = value
        return t
    return fn


def _wider(t):  # rows 2x as wide as the target's, shapes kept consistent across tensors
    import torch

    return torch.cat([t, t], dim=-1)


BAD_MAPS = {  # edit -> what the one-line error says
    "fewer target layers": (dict(sources=lambda t: t[:3], weight=lambda t: t[:3], bias=lambda t: t[:3],
                                 mean=lambda t: t[:3], basis=lambda t: t[:3], eigenvalues=lambda t: t[:3],
                                 r2=lambda t: t[:3], r2_single=lambda t: t[:3]), "does not fit"),
    "weight rows too narrow": (dict(weight=lambda t: t[:, : t.shape[1] // 2]), "does not fit"),
    "target rows too wide": (dict(weight=_wider, bias=_wider, mean=_wider, eigenvalues=_wider,
                                  basis=lambda t: __import__("torch").cat([t, t], dim=1)), "does not fit"),
    "source layer 99": (dict(sources=_set((0, 0), 99)), "source layer"),
    "negative source layer": (dict(sources=_set((0, 0), -1)), "source layer"),
    "nan in a bias": (dict(bias=_set((1, 3), float("nan"))), "not finite"),
    "nan in the basis": (dict(basis=_set((0, 2, 1), float("nan"))), "not finite"),
    "inf in r2": (dict(r2=_set(0, float("inf"))), "not finite"),
    "float sources": (dict(sources=lambda t: t.float()), "dtype"),
}


@pytest.mark.parametrize("edit", sorted(BAD_MAPS))
def test_a_map_that_does_not_fit_is_refused(mapped, tmp_path, capsys, edit):
    """Maps with the right identity but tensors that do not fit the models (or hold NaN) are refused with
    one line and exit 2, by generate and by the server at startup, instead of answering garbage."""
    from rarecache.transfer.mapper import Mapper

    change, message = BAD_MAPS[edit]
    bad = tmp_path / "bad.safetensors"
    _edited(Mapper.load(mapped / "m.safetensors"), **change).save(bad)
    capsys.readouterr()
    assert main(["generate", "--model", str(mapped / "tgt"), "--source", str(mapped / "src"), "--map", str(bad),
                 "--dtype", "float32", "--max-new-tokens", "2", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rarecache: error:") and message in err and len(err.strip().splitlines()) == 1, err


def test_the_server_refuses_a_map_that_does_not_fit(mapped, tmp_path, capsys, monkeypatch):
    import uvicorn

    from rarecache.transfer.mapper import Mapper

    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: pytest.fail("the server started"))
    bad = tmp_path / "bad.safetensors"
    _edited(Mapper.load(mapped / "m.safetensors"), **BAD_MAPS["fewer target layers"][0]).save(bad)
    capsys.readouterr()
    assert main(["serve", "--source", str(mapped / "src"), "--target", str(mapped / "tgt"), "--map", str(bad),
                 "--dtype", "float32", "--accept-poor-map"]) == 2  # (a tiny calibration fits badly: item 3)
    assert "does not fit" in capsys.readouterr().err


def test_a_flipped_bit_in_a_map_is_refused(mapped, tmp_path, capsys):
    data = bytearray((mapped / "m.safetensors").read_bytes())
    header = int.from_bytes(data[:8], "little")
    bad = tmp_path / "flipped.safetensors"
    for at in (8 + header + 5, len(data) - 3):  # the first tensor's data, the last one's
        flipped = bytearray(data)
        flipped[at] ^= 0x10
        bad.write_bytes(flipped)
        capsys.readouterr()
        assert main(["inspect", str(bad)]) == 2
        assert "checksum" in capsys.readouterr().err


def test_a_rerun_removes_what_a_killed_calibration_left(mapped, tmp_path, capsys):
    """kill -9 during a checkpoint leaves `OUT.state.partial` (1 GB for the bundled pair), during the map
    write `OUT.partial`: the next run over OUT removes both before anything else, even one stopped early
    or refused."""
    from rarecache.engine.runner import Runner
    from rarecache.models.tokenizer import Tokenizer
    from rarecache.transfer.fitting.calibrate import Calibration, CalibrationConfig
    from rarecache.transfer.fitting.corpus import load_corpus

    out = tmp_path / "m.safetensors"
    left = [tmp_path / "m.safetensors.partial", tmp_path / "m.safetensors.state.partial"]
    other = tmp_path / "other.safetensors.partial"  # another output's: not ours to touch
    for p in (*left, other):
        p.write_bytes(b"\0" * 4096)
    source, target = Runner.load(mapped / "src"), Runner.load(mapped / "tgt")
    cfg = CalibrationConfig(tokens=400, heldout_tokens=0, seq_len=48, k=2, rank=4)
    calib = Calibration(source, target, Tokenizer.from_dir(mapped / "src"), load_corpus(str(mapped / "corpus.txt")),
                        cfg, out)
    assert calib.run(progress=False, max_sequences=1) is None  # stopped early: the state is saved
    assert not any(p.exists() for p in left) and other.exists() and (tmp_path / "m.safetensors.state").is_file()
    for p in left:
        p.write_bytes(b"\0" * 4096)
    (tmp_path / "m.safetensors.state").write_bytes(b"not a state")  # a refused rerun cleans up too
    args = ["calibrate", "--source", str(mapped / "src"), "--target", str(mapped / "tgt"), "--corpus",
            str(mapped / "corpus.txt"), "--tokens", "400", "--heldout-tokens", "0", "--seq-len", "48", "--k", "2",
            "--rank", "4", "--dtype", "float32", "--out", str(out)]
    assert main(args) == 2 and "not a calibration state" in capsys.readouterr().err
    assert not any(p.exists() for p in left) and other.exists()


def test_generate_with_a_two_pass_selector(mapped, capsys):
    """--selector query: both passes counted (recomputed, first_pass, the cost line), timed apart; at rho 1
    the target's own answer."""
    base = ["generate", "--model", str(mapped / "tgt"), "--source", str(mapped / "src"), "--map",
            str(mapped / "m.safetensors"), "--dtype", "float32", "--max-new-tokens", "6", "--selector", "query",
            "--json", "the quick brown fox jumps over the lazy dog " * 4]
    capsys.readouterr()
    assert main(base + ["--rho", "0.5"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["recomputed"] == -(-out["prompt_tokens"] // 2) and out["first_pass"] > 0
    assert out["cost"].startswith(f"recomputed 2 passes, {out['first_pass']} + ")
    assert {"pass1", "pass2"} <= set(out["timings"])
    assert main(base + ["--rho", "1", "--compare"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["text"] == out["target_alone"] and out["recomputed"] == out["prompt_tokens"] and out["first_pass"] == 0
