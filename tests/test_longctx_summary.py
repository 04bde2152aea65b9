"""`rarecache eval longctx-summary` (issue 54's long-context summary schema) on hand-made record files."""

from __future__ import annotations

import json

import pytest

from rarecache.cli import main
from rarecache.errors import RarecacheError
from rarecache.eval.longctx_summary import REQUIRED, bench_speedup, longctx_summary

ARM = "rho=0.3/suffix@srv"
CELL = {"n", "metric", "target", "source", "served", "agreement", "delta", "ci"}


def _records(path, task: str, length: int, metric: str, table: dict, sha: str = "abc123"):
    """`table`: arm -> [(score, prediction) per item]."""
    rows = [{"task": task, "item": f"{task}-T{length}-{k:04d}", "arm": arm, metric: score, "prediction": pred,
             "length": length} for arm, cells in table.items() for k, (score, pred) in enumerate(cells)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    path.with_suffix(".meta.json").write_text(json.dumps({"maps": {"srv": {"file": "m", "sha256": sha}}}))
    return path


def _bench(path, rows=None, selector="suffix"):
    rows = rows or [{"T": 512, "rho": 0.3, "batch": 1, "speedup": 4.0}, {"T": 2048, "rho": 0.3, "batch": 1,
                                                                          "speedup": 2.75},
                    {"T": 2048, "rho": 0.2, "batch": 1, "speedup": 3.5}, {"T": 2048, "rho": 0.3, "batch": 4,
                                                                          "speedup": 2.0}]
    path.write_text(json.dumps({"bench": "handoff", "selector": selector, "dtype": "float32", "cpu": "AVX2",
                                "rows": rows}))
    return path


def _suite(tmp_path, skip=()):
    """Every required task@T; retrieval@2048 by hand: target right on 3 of 4, source on 1, served on 2; the served
    answer equals the target's on items 0, 1 and 3 (3 of 4, one of them a shared wrong answer)."""
    paths = []
    for key in REQUIRED:
        if key in skip:
            continue
        task, length = key.split("@")
        if task in ("retrieval", "multiturn"):
            table = {"target": [(True, "1"), (True, "2"), (True, "3"), (False, "9")],
                     "source": [(True, "1"), (False, "5"), (False, "6"), (False, "7")],
                     ARM: [(True, "1"), (True, "2"), (False, "4"), (False, "9")]}
            metric = "correct"
        else:  # F1 tasks: target 1.0, 0.5; served 0.5, 0.5 with the same answer on item 1
            table = {"target": [(1.0, "uncle john"), (0.5, "john")], "source": [(0.0, "x"), (0.0, "y")],
                     ARM: [(0.5, "john smith"), (0.5, "john")]}
            metric = "f1"
        paths.append(_records(tmp_path / f"{task}-{length}.jsonl", task, int(length), metric, table))
    return paths


def test_the_summary_by_hand_through_the_command(tmp_path, capsys):
    out = tmp_path / "docs" / "longctx-summary.json"
    bench = _bench(tmp_path / "bench.json")
    assert main(["eval", "longctx-summary", *map(str, _suite(tmp_path)), "--bench", str(bench), "--arm", "0.3:suffix",
                 "--out", str(out)]) == 0
    s = json.loads(out.read_text())
    assert s["served"] == {"selector": "suffix", "rho": 0.3, "map_sha256": "abc123"}
    assert s["speedup_T2048"] == 2.75 and s["bench"] == {"file": "bench.json", "dtype": "float32", "cpu": "AVX2",
                                                         "selector": "suffix"}
    assert list(s["tasks"]) == ["retrieval@2048", "retrieval@4096", "multidoc_qa@2048", "multidoc_qa@4096",
                                "code_qa@2048", "multiturn@2048", "passage_qa_gen@2048"]
    r = s["tasks"]["retrieval@2048"]
    assert set(r) == CELL and (r["n"], r["metric"]) == (4, "correct")
    assert (r["target"], r["source"], r["served"], r["agreement"]) == pytest.approx((0.75, 0.25, 0.5, 0.75))
    assert r["delta"] == pytest.approx(-0.25) and r["ci"][1] == 0.0 and -1.0 <= r["ci"][0] < -0.25  # d: 0 0 -1 0
    m = s["tasks"]["multidoc_qa@4096"]
    assert (m["metric"], m["target"], m["served"], m["delta"], m["agreement"]) == pytest.approx(
        ("f1", 0.75, 0.5, -0.25, 0.5))
    assert "retrieval@2048" in capsys.readouterr().out


def test_missing_records_arms_and_bench_rows_are_refused(tmp_path):
    bench = _bench(tmp_path / "bench.json")
    paths = _suite(tmp_path, skip=("code_qa@2048",))
    with pytest.raises(RarecacheError, match="no records for code_qa@2048"):
        longctx_summary(paths, "0.3:suffix", "srv", bench)
    s = longctx_summary(paths, "0.3:suffix", None, bench, partial=True)  # (the one map the files record)
    assert s["missing"] == ["code_qa@2048"] and len(s["tasks"]) == len(REQUIRED) - 1
    with pytest.raises(RarecacheError, match=r"no rho=0.2/suffix@srv arm"):
        longctx_summary(paths, "0.2:suffix", "srv", bench, partial=True)
    with pytest.raises(RarecacheError, match="given twice"):
        longctx_summary(paths + paths[:1], "0.3:suffix", "srv", bench, partial=True)
    with pytest.raises(RarecacheError, match="0 rows time the suffix handoff at rho 0.3, T 2048"):
        longctx_summary(paths, "0.3:suffix", "srv", _bench(tmp_path / "b2.json", selector="rank"), partial=True)
    other = _records(tmp_path / "other.jsonl", "code_qa", 2048, "f1", {"target": [(1.0, "a")], "source": [(0.0, "b")],
                                                                       ARM: [(1.0, "a")]}, sha="def456")
    with pytest.raises(RarecacheError, match="not the same file"):
        longctx_summary(paths + [other], "0.3:suffix", "srv", bench)
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text((tmp_path / "retrieval-2048.jsonl").read_text() + (tmp_path / "retrieval-4096.jsonl").read_text())
    mixed.with_suffix(".meta.json").write_text(paths[0].with_suffix(".meta.json").read_text())
    with pytest.raises(RarecacheError, match="not of one length"):
        longctx_summary([mixed], "0.3:suffix", "srv", bench, partial=True)
    gsm = tmp_path / "gsm.jsonl"
    gsm.write_text(json.dumps({"task": "gsm8k", "item": "g", "arm": "target", "correct": True}) + "\n")
    with pytest.raises(RarecacheError, match="not a long-context task"):
        longctx_summary([gsm], "0.3:suffix", "srv", bench, partial=True)


def test_bench_rows_as_json_lines(tmp_path):
    lines = tmp_path / "bench.jsonl"
    lines.write_text(json.dumps({"T": 2048, "rho": 0.3, "speedup": 2.6, "selector": "query", "dtype": "bfloat16"})
                     + "\n" + json.dumps({"T": 2048, "rho": 0.3, "speedup": 9.0, "selector": "suffix"}) + "\n")
    assert bench_speedup(lines, 0.3, "query") == (2.6, {"dtype": "bfloat16", "selector": "query"})
    lines.write_text("not json\n")
    with pytest.raises(RarecacheError, match="not a bench file"):
        bench_speedup(lines, 0.3, "query")
