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
    assert "default selector through map general: attn-source" in capsys.readouterr().out


def test_general_summary_refuses_mixed_maps_and_missing_budgets(tmp_path):
    a = _write(tmp_path / "a.jsonl", "hellaswag", "correct_norm", _arms(*[[1] * 10] * 5), sha="one")
    b = _write(tmp_path / "b.jsonl", "arc_challenge", "correct_norm", _arms(*[[1] * 10] * 5), sha="two")
    assert main(["eval", "report", str(a), str(b), "--general-summary", str(tmp_path / "s.json")]) == 2
    c = _write(tmp_path / "c.jsonl", "mmlu", "correct", {"target": [1] * 10, "rho=0.2/rank@general": [1] * 10})
    assert main(["eval", "report", str(c), "--general-summary", str(tmp_path / "s.json")]) == 2
