"""The general map's summary: the default selector picked by the numbers, the figures by hand."""

from __future__ import annotations

import json

import pytest

from rarecache.cli import main

ITEMS = [f"i{k}" for k in range(10)]


def _write(path, task, metric, values: dict[str, list[float]], sha="abc"):
    rows = [{"task": task, "item": i, "arm": arm, metric: v} for arm, vs in values.items() for i, v in zip(ITEMS, vs)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    path.with_suffix(".meta.json").write_text(json.dumps({"maps": {"general": {"file": "m", "sha256": sha}}}))
    return path


def _arms(target, source, plain, good, bad):
    """Per-item values: `good` and `bad` are what attn-source and rank reach at every rho."""
    vals = {"target": target, "source": source, "rho=0/rank@general": plain}
    for rho in (0.1, 0.2, 0.3):
        vals[f"rho={rho:g}/attn-source@general"] = good
        vals[f"rho={rho:g}/rank@general"] = bad
    return vals


def test_general_summary_picks_the_selector_that_closes_most_of_the_gap(tmp_path, capsys):
    acc = _write(tmp_path / "hs.jsonl", "hellaswag", "correct_norm",
                 _arms([1] * 10, [0] * 4 + [1] * 6, [0] * 5 + [1] * 5, [0] + [1] * 9, [0] * 4 + [1] * 6))
    bpb = _write(tmp_path / "g.jsonl", "gsm8k_bpb", "bpb",
                 _arms([0.5] * 10, [0.6] * 10, [0.7] * 10, [0.52] * 10, [0.65] * 10))
    out = tmp_path / "summary.json"
    assert main(["eval", "report", str(acc), str(bpb), "--general-summary", str(out)]) == 0
    s = json.loads(out.read_text())
    assert s["map"] == "abc" and s["default_selector"] == "attn-source"
    hs, g = s["tasks"]["hellaswag"], s["tasks"]["gsm8k_bpb"]
    # hellaswag: target 100%, plain 50%, attn-source 90%: (0.9 - 0.5) / (1 - 0.5)
    assert hs["gap_closed_default_rho0.2"] == pytest.approx(0.8) and hs["unit"] == "pp"
    assert hs["plain_minus_source"] == pytest.approx(100 * (0.5 - 0.6))  # plain worse than the source: < 0
    # bpb: (0.52 - 0.7) / (0.5 - 0.7) = 0.9; source 0.6 - plain 0.7 = -0.1
    assert g["gap_closed_default_rho0.2"] == pytest.approx(0.9) and g["unit"] == "bpb"
    assert g["plain_minus_source"] == pytest.approx(-0.1)
    assert s["selector_mean_gap_closed"]["rank"] == pytest.approx((0.2 + 0.25) / 2)
    # the rule: share of the source-to-target gap kept, (arm - source) / (target - source), over tasks and rhos
    # rank: hellaswag (0.6 - 0.6) / (1 - 0.6) = 0; gsm8k (0.65 - 0.6) / (0.5 - 0.6) = -0.5
    assert s["selector_mean_model_gap_kept"]["rank"] == pytest.approx((0.0 - 0.5) / 2)
    # attn-source: hellaswag (0.9 - 0.6) / 0.4 = 0.75; gsm8k (0.52 - 0.6) / -0.1 = 0.8
    assert s["selector_mean_model_gap_kept"]["attn-source"] == pytest.approx((0.75 + 0.8) / 2)
    assert s["default_picked"] == "after the fact, on these results: the highest mean of 2 candidates"
    assert ("default selector through map general[abc]: attn-source, picked after the fact on these results (the "
            "best of 2" in capsys.readouterr().out)


def test_a_near_zero_plain_gap_does_not_pick_the_default(tmp_path):
    """Where plain transfer is already near the target, gap closed divides noise by a near-zero gap:
    one item decides between 0% and 100% there, and that task alone would pick the default. The
    rule weighs each task by its source-to-target gap instead."""
    # big gaps: target 0.5, source 0.6, plain 0.7 bpb; attn-source 0.51 (near the target), rank 0.68 (near plain)
    big = _write(tmp_path / "g.jsonl", "gsm8k_bpb", "bpb",
                 _arms([0.5] * 10, [0.6] * 10, [0.7] * 10, [0.51] * 10, [0.68] * 10))
    # plain transfer one item below the target: attn-source at plain (0% closed), rank at the target (100%)
    tiny = _write(tmp_path / "a.jsonl", "arc_challenge", "correct_norm",
                  _arms([1] * 6 + [0] * 4, [1] * 3 + [0] * 7, [1] * 5 + [0] * 5, [1] * 5 + [0] * 5, [1] * 6 + [0] * 4))
    out = tmp_path / "s.json"
    assert main(["eval", "report", str(big), str(tiny), "--general-summary", str(out)]) == 0
    s = json.loads(out.read_text())
    # gap closed would pick rank: (0.1 + 1) / 2 against attn-source's (0.95 + 0) / 2
    assert s["selector_mean_gap_closed"]["rank"] == pytest.approx((0.1 + 1.0) / 2)
    assert s["selector_mean_gap_closed"]["attn-source"] == pytest.approx((0.95 + 0.0) / 2)
    # kept: attn-source (0.9 + 2/3) / 2; rank (-0.8 + 1) / 2, 0.08 bpb from the target on the big task
    assert s["selector_mean_model_gap_kept"]["attn-source"] == pytest.approx((0.9 + 2 / 3) / 2)
    assert s["selector_mean_model_gap_kept"]["rank"] == pytest.approx((-0.8 + 1.0) / 2)
    assert s["default_selector"] == "attn-source"


def test_general_summary_refuses_mixed_maps_missing_budgets_and_no_gap(tmp_path, capsys):
    vals = _arms([1] * 10, [0] * 10, [0] * 5 + [1] * 5, [1] * 10, [0] * 10)
    a = _write(tmp_path / "a.jsonl", "hellaswag", "correct_norm", vals, sha="one")
    b = _write(tmp_path / "b.jsonl", "arc_challenge", "correct_norm", vals, sha="two")
    out = str(tmp_path / "s.json")
    assert main(["eval", "report", str(a), str(b), "--general-summary", out]) == 2
    assert "is not the same file in every results file" in capsys.readouterr().err
    c = _write(tmp_path / "c.jsonl", "mmlu", "correct", {"target": [1] * 10, "source": [0] * 10,
                                                          "rho=0.2/rank@general": [1] * 10})
    assert main(["eval", "report", str(c), "--general-summary", out]) == 2
    assert "no deployable selector was run at rho 0.1, 0.2, 0.3" in capsys.readouterr().err
    d = _write(tmp_path / "d.jsonl", "mmlu", "correct", _arms([0] * 10, [0] * 10, [0] * 10, [1] * 10, [0] * 10))
    assert main(["eval", "report", str(d), "--general-summary", out]) == 2
    assert "mmlu: the target (0) is not better than the source (0)" in capsys.readouterr().err
    e = _write(tmp_path / "e.jsonl", "mmlu", "correct", {k: v for k, v in vals.items() if k != "source"})
    assert main(["eval", "report", str(e), "--general-summary", out]) == 2
    assert "mmlu: no source arm" in capsys.readouterr().err


def test_one_served_map_stands_for_a_ridge_fit_and_a_sharpened_plain_transfer(fitted, tmp_path, capsys):
    """Handoffs measured through the ridge fit (label ridge), plain transfer through its sharpened fit (label
    sharp): --plain-label reads plain transfer from sharp (gap closed too), and --served-map names the one file
    serving both only if its fit is ridge's bit for bit and its plain view sharp's; else a clear error."""
    from rarecache.packages import sha256_file
    from rarecache.transfer.fitting.calibrate import with_plain
    from rarecache.transfer.fitting.refit import resharpen

    _, _, ridge, _ = fitted
    files = {"ridge": tmp_path / "ridge.safetensors", "sharp": tmp_path / "sharp.safetensors",
             "served": tmp_path / "served.safetensors"}
    ridge.save(files["ridge"])
    resharpen(ridge, (1.0, 0.5)).save(files["sharp"])
    with_plain(ridge, (1.0, 0.5)).save(files["served"])
    vals = {"target": [0.5] * 10, "source": [0.6] * 10, "rho=0/rank@ridge": [0.8] * 10,
            "rho=0/rank@sharp": [0.58] * 10}
    for rho in (0.1, 0.2, 0.3):
        vals[f"rho={rho:g}/suffix@ridge"] = [0.52] * 10
    path = _write(tmp_path / "g.jsonl", "gsm8k_bpb", "bpb", vals)
    maps = {k: {"file": str(files[k]), "sha256": sha256_file(files[k])} for k in ("ridge", "sharp")}
    path.with_suffix(".meta.json").write_text(json.dumps({"maps": maps}))
    out = tmp_path / "s.json"
    base = ["eval", "report", str(path), "--general-summary", str(out), "--map-label", "ridge"]
    assert main(base) == 0
    g = json.loads(out.read_text())["tasks"]["gsm8k_bpb"]
    assert g["plain_minus_source"] == pytest.approx(-0.2) and g["gap_closed_default_rho0.2"] == pytest.approx(0.28 / 0.3)
    assert main(base + ["--plain-label", "sharp", "--served-map", str(files["served"])]) == 0
    s = json.loads(out.read_text())
    g = s["tasks"]["gsm8k_bpb"]
    assert g["plain_minus_source"] == pytest.approx(0.02)  # source 0.6 - plain 0.58
    assert g["gap_closed_default_rho0.2"] == pytest.approx(0.06 / 0.08)  # (0.58 - 0.52) / (0.58 - 0.5)
    assert s["map"] == sha256_file(files["served"]) == s["served"]["sha256"] and s["plain_map"] == maps["sharp"]["sha256"]
    assert s["served"]["plain_view_equals"]["max_relative_difference"] < 1e-5
    assert "served as served.safetensors" in capsys.readouterr().out
    # the sharpened file as served: not the ridge fit; the ridge file: its plain view is not the sharp one
    assert main(base + ["--plain-label", "sharp", "--served-map", str(files["sharp"])]) == 2
    assert "tensors are not map 'ridge''s" in capsys.readouterr().err
    assert main(base + ["--plain-label", "sharp", "--served-map", str(files["ridge"])]) == 2
    assert "plain-transfer view is not map 'sharp''s" in capsys.readouterr().err
    ridge.save(files["sharp"])  # the file the results name changed since: refused
    assert main(base + ["--plain-label", "sharp", "--served-map", str(files["served"])]) == 2
    assert "is not the map 'sharp'" in capsys.readouterr().err
    # a per-file report reads gap closed against the plain transfer it is told to
    assert main(["eval", "report", str(path), "--plain-label", "sharp", "--compact"]) == 0
    table = capsys.readouterr().out
    assert "gap closed (of target − plain transfer through sharp)" in table and "| 75% |" in table
    assert main(["eval", "report", str(path), "--served-map", str(files["served"])]) == 2
    assert "belong to --general-summary" in capsys.readouterr().err
    # a plain label no file has is refused, not read as missing figures
    assert main(base + ["--plain-label", "shrap"]) == 2
    assert "no plain-transfer arm rho=0/rank@shrap" in capsys.readouterr().err


def test_arms_run_on_more_items_are_read_paired_and_candidates_on_shared_items(tmp_path):
    """A queue grows the acceptance's arms (target, source, plain transfer, the default at 0.2) past the
    others: each headline figure is read over the items its own arms share and says how many; the
    selectors are compared on the items all of them share."""
    vals = _arms([0.5] * 10, [0.6] * 10, [0.7] * 10, [0.52] * 10, [0.65] * 10)
    rows = [{"task": "gsm8k_bpb", "item": i, "arm": arm, "bpb": v} for arm, vs in vals.items()
            for i, v in zip(ITEMS, vs) if arm in ("target", "source", "rho=0/rank@general",
                                                   "rho=0.2/attn-source@general") or i in ITEMS[:4]]
    # the 6 items past the first 4: the default lands on the target there, plain transfer level with the source
    for r in rows:
        if r["item"] not in ITEMS[:4] and r["arm"] in ("rho=0.2/attn-source@general", "rho=0/rank@general"):
            r["bpb"] = 0.5 if r["arm"].startswith("rho=0.2") else 0.6
    path = tmp_path / "g.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    path.with_suffix(".meta.json").write_text(json.dumps({"maps": {"general": {"file": "m", "sha256": "abc"}}}))
    out = tmp_path / "s.json"
    assert main(["eval", "report", str(path), "--general-summary", str(out)]) == 0
    s = json.loads(out.read_text())
    g = s["tasks"]["gsm8k_bpb"]
    assert g["n"] == 10 and g["n_plain_minus_source"] == 10 and g["pick_n"] == 4
    # paired over all 10: plain (4 x 0.7 + 6 x 0.6) / 10 = 0.64, default (4 x 0.52 + 6 x 0.5) / 10 = 0.508
    assert g["plain_minus_source"] == pytest.approx(0.6 - 0.64)
    assert g["gap_closed_default_rho0.2"] == pytest.approx((0.508 - 0.64) / (0.5 - 0.64))
    # the candidates on the first 4 items alone: attn-source (0.52 - 0.6) / (0.5 - 0.6), rank (0.65 - 0.6) / -0.1
    assert s["selector_mean_model_gap_kept"]["attn-source"] == pytest.approx(0.8)
    assert s["selector_mean_model_gap_kept"]["rank"] == pytest.approx(-0.5)
    assert s["default_selector"] == "attn-source"


def test_a_selector_another_task_lacks_is_no_candidate_and_narrows_no_task(tmp_path):
    """A queue that grows a second selector task by task has it at every budget on a few items of one
    task and on none of another: it is not a candidate, and the first task's candidates are still
    compared on all their items (through v3, suffix+attn on 7 GSM8K items cut suffix's GSM8K cells to 7)."""
    vals = _arms([0.5] * 10, [0.6] * 10, [0.7] * 10, [0.52] * 10, [0.65] * 10)
    vals = {a: v for a, v in vals.items() if "rank@" not in a or a.startswith("rho=0/")}  # attn-source alone
    rows = [{"task": "gsm8k_bpb", "item": i, "arm": a, "bpb": v} for a, vs in vals.items() for i, v in zip(ITEMS, vs)]
    rows += [{"task": "gsm8k_bpb", "item": i, "arm": f"rho={r:g}/suffix@general", "bpb": 0.5}
             for r in (0.1, 0.2, 0.3) for i in ITEMS[:3]]  # suffix: every budget, 3 items, this task only
    path = tmp_path / "g.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    path.with_suffix(".meta.json").write_text(json.dumps({"maps": {"general": {"file": "m", "sha256": "abc"}}}))
    other = _write(tmp_path / "h.jsonl", "hellaswag", "correct_norm",
                   {a: v for a, v in _arms([1] * 10, [0] * 10, [0] * 10, [1] * 5 + [0] * 5, [0] * 10).items()
                    if "rank@" not in a or a.startswith("rho=0/")})
    out = tmp_path / "s.json"
    assert main(["eval", "report", str(path), str(other), "--general-summary", str(out)]) == 0
    s = json.loads(out.read_text())
    assert set(s["selector_mean_model_gap_kept"]) == {"attn-source"} and s["default_selector"] == "attn-source"
    assert s["tasks"]["gsm8k_bpb"]["pick_n"] == 10 and s["tasks"]["hellaswag"]["pick_n"] == 10
    # attn-source over all 10 GSM8K items: (0.52 - 0.6) / (0.5 - 0.6) = 0.8; HellaSwag 0.5
    assert s["selector_mean_model_gap_kept"]["attn-source"] == pytest.approx((0.8 + 0.5) / 2)


def test_general_summary_gives_bits_per_byte_by_bytes_beside_the_mean_of_ratios(tmp_path):
    """On a bits-per-byte task whose records carry bytes, source − plain transfer by bytes: items of 1 byte
    (source 0.6, plain 1.6) and 9 bytes (0.6 and 0.7) give (−1.0·1 − 0.1·9) / 10 = −0.19, the mean of ratios −0.55."""
    acc = _write(tmp_path / "hs.jsonl", "hellaswag", "correct_norm",
                 _arms([1] * 10, [0] * 4 + [1] * 6, [0] * 5 + [1] * 5, [0] + [1] * 9, [0] * 4 + [1] * 6))
    plain = [1.6, 0.7] + [0.7] * 8
    vals = _arms([0.5] * 10, [0.6] * 10, plain, [0.52] * 10, [0.65] * 10)
    rows = [{"task": "gsm8k_bpb", "item": i, "arm": arm, "bpb": v, "bytes": 1 if i == "i0" else 9}
            for arm, vs in vals.items() for i, v in zip(ITEMS[:2], vs)]
    bpb = tmp_path / "g.jsonl"
    bpb.write_text("".join(json.dumps(r) + "\n" for r in rows))
    bpb.with_suffix(".meta.json").write_text(json.dumps({"maps": {"general": {"file": "m", "sha256": "abc"}}}))
    out = tmp_path / "summary.json"
    assert main(["eval", "report", str(acc), str(bpb), "--general-summary", str(out)]) == 0
    g = json.loads(out.read_text())["tasks"]["gsm8k_bpb"]
    assert g["plain_minus_source"] == pytest.approx(-0.55)
    by = g["plain_minus_source_by_bytes"]
    assert by["delta"] == pytest.approx(-0.19) and by["n"] == 2 and by["ci"][0] <= by["delta"] <= by["ci"][1]
    assert "plain_minus_source_by_bytes" not in json.loads(out.read_text())["tasks"]["hellaswag"]
