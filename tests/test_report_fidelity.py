"""The fidelity summary (issue 41's schema) and agreement in summary files, on hand-made records."""

from __future__ import annotations

import json

import pytest

from rarecache.cli import main
from rarecache.eval.arms import handoff_arm
from rarecache.errors import RarecacheError

KEYS = {"metric", "n", "target", "source", "handoff", "delta", "ci", "agreement", "kappa", "mcnemar_p", "by_bytes"}


def _write(path, task, rows, maps=(("v4", "new"), ("v3", "old"))):
    path.write_text("".join(json.dumps({"task": task, **r}) + "\n" for r in rows))
    path.with_suffix(".meta.json").write_text(json.dumps({"maps": {k: {"file": "m", "sha256": v} for k, v in maps}}))
    return path


def _mmlu(tmp_path):
    """Five items; the handoff through v4 answers like the target on 4 (items 0-3), through v3 on 2;
    item 5 lacks the v3 arm, so it is compared nowhere."""
    gold = [0, 1, 2, 3, 0, 1]
    answers = {"target": [0, 1, 2, 3, 1, 1], "source": [1, 1, 1, 1, 1, 1],
               "rho=0.2/suffix@v4": [0, 1, 2, 3, 0, 2], "rho=0.2/suffix@v3": [0, 1, 0, 0, 1]}
    rows = [{"item": f"i{k}", "arm": arm, "prediction": p, "correct": p == gold[k]}
            for arm, ps in answers.items() for k, p in enumerate(ps)]
    return _write(tmp_path / "mmlu.jsonl", "mmlu", rows)


def _coqa(tmp_path):
    vals = {"target": [0.5, 0.6], "source": [0.8, 0.9], "rho=0.2/suffix@v4": [0.7, 0.7],
            "rho=0.2/suffix@v3": [1.0, 1.2]}
    rows = [{"item": f"s{k}", "arm": arm, "bpb": v} for arm, vs in vals.items() for k, v in enumerate(vs)]
    return _write(tmp_path / "coqa.jsonl", "coqa_passage", rows)


def test_fidelity_summary_writes_the_issue_schema_with_the_delta_sign_and_agreement(tmp_path, capsys):
    mmlu, coqa = _mmlu(tmp_path), _coqa(tmp_path)
    probe = tmp_path / "probe.summary.json"
    probe.write_text(json.dumps({"arms": {"v4": {"rho=0.2/suffix": {"kl": 0.5, "attn_cos": 0.9}},
                                          "v3": {"rho=0.2/suffix": {"kl": 1.3, "attn_cos": 0.8}}}}))
    out = tmp_path / "fid.json"
    assert main(["eval", "report", str(mmlu), str(coqa), "--fidelity-summary", str(out), "--arm", "0.2:suffix",
                 "--map-label", "v4", "--previous-label", "v3", "--probe", str(probe)]) == 0
    s = json.loads(out.read_text())
    assert set(s) == {"map", "selector", "rho", "tasks", "previous", "probe"}
    assert (s["map"], s["selector"], s["rho"]) == ("new", "suffix", 0.2)
    assert s["previous"]["map"] == "old" and set(s["previous"]) == {"map", "selector", "rho", "tasks"}
    assert s["probe"] == {"kl": 0.5, "attn_cos": 0.9, "previous_kl": 1.3}
    m, pm = s["tasks"]["mmlu"], s["previous"]["tasks"]["mmlu"]
    assert set(m) == KEYS and set(pm) == KEYS
    # items i0-i4 (i5 has no v3 record): target 4/5 correct, source 1/5, v4 5/5, v3 2/5
    assert m["n"] == pm["n"] == 5 and m["metric"] == "correct"
    assert (m["target"], m["source"], m["handoff"], pm["handoff"]) == pytest.approx((80.0, 20.0, 100.0, 40.0))
    assert m["delta"] == pytest.approx(20.0) and pm["delta"] == pytest.approx(-40.0)  # handoff - target, pp
    assert m["ci"][0] <= m["delta"] <= m["ci"][1] and pm["ci"][1] <= 0
    # v4 answers like the target on i0-i3 (i4: 0 vs the target's 1), v3 on i0, i1 and i4
    assert m["agreement"] == pytest.approx(0.8) and pm["agreement"] == pytest.approx(0.6)
    from rarecache.eval.report import kappa
    from rarecache.eval.results import load_results
    rows = load_results(mmlu)
    assert m["kappa"] == pytest.approx(kappa(rows, "rho=0.2/suffix@v4", "correct", {f"i{k}" for k in range(5)}))
    c, pc = s["tasks"]["coqa_passage"], s["previous"]["tasks"]["coqa_passage"]
    assert c["agreement"] is None and c["kappa"] is None and c["metric"] == "bpb"  # bpb: no answer, the delta stands
    assert c["delta"] == pytest.approx(0.15) and pc["delta"] == pytest.approx(0.55)  # worse than the target: > 0
    assert c["target"] == pytest.approx(0.55) and c["source"] == pytest.approx(0.85)
    table = capsys.readouterr().out
    assert "| mmlu | 5 | 80.0 | 20.0 | 100.0 | +20.0 (" in table and "| coqa_passage | 2 |" in table


def test_fidelity_summary_compares_the_previous_map_at_its_own_served_arm(tmp_path, capsys):
    """A map adopted with a new default arm (rank 0.3 here) is set beside the old map as it was served
    (suffix 0.2): --previous-arm picks the old map's arm, in the tasks and in the probe."""
    mmlu = _mmlu(tmp_path)
    rows = [json.loads(line) for line in mmlu.read_text().splitlines()]
    rows += [{**r, "arm": "rho=0.3/rank@v4"} for r in rows if r["arm"] == "target"]  # answers as the target
    _write(mmlu, "mmlu", [{k: v for k, v in r.items() if k != "task"} for r in rows])
    probe = tmp_path / "probe.summary.json"
    probe.write_text(json.dumps({"arms": {"v4": {"rho=0.3/rank": {"kl": 0.2, "attn_cos": 0.95}},
                                          "v3": {"rho=0.2/suffix": {"kl": 1.3, "attn_cos": 0.8}}}}))
    out = tmp_path / "fid.json"
    base = ["eval", "report", str(mmlu), "--fidelity-summary", str(out), "--arm", "0.3:rank", "--map-label", "v4",
            "--previous-label", "v3", "--probe", str(probe)]
    assert main(base) == 2 and "no rho=0.3/rank@v3 arm" in capsys.readouterr().err  # default: the same arm
    assert main([*base, "--previous-arm", "0.2:suffix"]) == 0
    s = json.loads(out.read_text())
    assert (s["selector"], s["rho"], s["previous"]["selector"], s["previous"]["rho"]) == ("rank", 0.3, "suffix", 0.2)
    assert s["tasks"]["mmlu"]["agreement"] == pytest.approx(1.0) and s["tasks"]["mmlu"]["delta"] == 0
    assert s["previous"]["tasks"]["mmlu"]["agreement"] == pytest.approx(0.6)
    assert s["probe"] == {"kl": 0.2, "attn_cos": 0.95, "previous_kl": 1.3}
    assert "v3[old] (suffix 0.2): handoff" in capsys.readouterr().out  # the previous map with its sha256 prefix
    assert main(["eval", "report", str(mmlu), "--fidelity-summary", str(out), "--arm", "0.3:rank",
                 "--map-label", "v4", "--previous-arm", "0.2:suffix"]) == 2
    assert "--previous-arm needs --previous-label" in capsys.readouterr().err


def test_fidelity_summary_refuses_what_it_cannot_compare(tmp_path, capsys):
    mmlu = _mmlu(tmp_path)
    out = tmp_path / "fid.json"
    base = ["eval", "report", str(mmlu), "--fidelity-summary", str(out), "--map-label", "v4"]
    for extra, message in ((["--arm", "0.3:suffix"], "no rho=0.3/suffix@v4 arm"),
                           (["--arm", "target"], "name a handoff as RHO:SELECTOR"),
                           (["--arm", "0.2:suffix@v3"], "name a handoff as RHO:SELECTOR"),
                           (["--arm", "0.2:magic"], "unknown selector 'magic'"),
                           ([], "needs --arm RHO:SELECTOR and --map-label"),
                           (["--arm", "0.2:suffix", "--previous-label", "v2"], "no rho=0.2/suffix@v2 arm")):
        assert main(base + extra) == 2, extra
        assert message in capsys.readouterr().err
    assert not out.exists()
    assert main(["eval", "report", str(mmlu), "--arm", "0.2:suffix"]) == 2
    assert "belong to --fidelity-summary" in capsys.readouterr().err


def test_handoff_arm_reads_arms_as_eval_run_does():
    arm = handoff_arm("0.2:suffix+rank", "v4")
    assert (arm.kind, arm.rho, arm.method, arm.map, arm.name) == ("handoff", 0.2, "suffix+rank", "v4",
                                                                  "rho=0.2/suffix+rank@v4")
    for bad in ("source", "ladder:rank", "x:rank"):
        with pytest.raises(RarecacheError):
            handoff_arm(bad, "v4")


def test_general_summary_carries_agreement(tmp_path):
    """The general map's summary records the default's and plain transfer's agreement per task."""
    rows = []
    for k in range(6):
        rows += [{"item": f"i{k}", "arm": "target", "prediction": 0, "correct": True},
                 {"item": f"i{k}", "arm": "source", "prediction": 1, "correct": False},
                 {"item": f"i{k}", "arm": "rho=0/rank@general", "prediction": int(k < 3), "correct": k >= 3}]
        rows += [{"item": f"i{k}", "arm": f"rho={r:g}/rank@general", "prediction": int(k == 0), "correct": k > 0}
                 for r in (0.1, 0.2, 0.3)]
    path = _write(tmp_path / "mmlu.jsonl", "mmlu", rows, (("general", "abc"),))
    out = tmp_path / "g.json"
    assert main(["eval", "report", str(path), "--general-summary", str(out)]) == 0
    t = json.loads(out.read_text())["tasks"]["mmlu"]
    assert t["agreement_default_rho0.2"] == pytest.approx(5 / 6) and t["agreement_plain"] == pytest.approx(0.5)


def _drift(tmp_path, sha="new", name="drift.jsonl.gz"):
    """Two stories, target turns 2 and 4: alone (both models every turn) and the switching arm at 0.2."""
    import gzip

    rows = []
    for s, (own, small, handed) in enumerate(((0.4, 0.9, 0.6), (0.6, 1.1, 0.6))):
        for turn in (1, 2, 3, 4):
            for model in ("source", "target"):
                bpb = (small if model == "source" else own) + 0.01 * turn * (turn % 2)  # odd turns: the source's
                rows.append({"story": f"s{s}", "turn": turn, "arm": "alone", "model": model, "bpb": bpb})
            if turn % 2 == 0:  # the target answers after a handoff
                rows.append({"story": f"s{s}", "turn": turn, "arm": "switch/0.2:suffix", "model": "target",
                             "bpb": handed, "handed_off": 50, "recomputed": 10,
                             "seconds": {"prefill_or_handoff": 0.1}})
            else:
                rows.append({"story": f"s{s}", "turn": turn, "arm": "switch/0.2:suffix", "model": "source",
                             "bpb": small, "seconds": {"prefill_or_handoff": 0.1}})
    path = tmp_path / name
    path.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in rows).encode()))
    meta = tmp_path / name.replace(".jsonl.gz", ".meta.json")
    meta.write_text(json.dumps({"maps": {"source->target": {"sha256": sha}}}))
    return path


def test_fidelity_summary_takes_coqa_from_a_drift_file(tmp_path, capsys):
    """coqa_bpb: the switching arm against the target alone on the target's turns, the source alone on
    those same turns; a drift file through another map is refused."""
    mmlu, out = _mmlu(tmp_path), tmp_path / "fid.json"
    base = ["eval", "report", str(mmlu), "--fidelity-summary", str(out), "--arm", "0.2:suffix", "--map-label", "v4"]
    assert main(base + ["--drift", str(_drift(tmp_path))]) == 0
    c = json.loads(out.read_text())["tasks"]["coqa_bpb"]
    assert set(c) == KEYS | {"stories"} and c["metric"] == "bpb" and c["agreement"] is None
    # story 0: target 0.4, handoff 0.6 (+0.2); story 1: 0.6, 0.6 (0); the 0.5B 0.9 and 1.1 on those turns
    assert (c["n"], c["stories"]) == (4, 2)
    assert (c["target"], c["handoff"], c["source"], c["delta"]) == pytest.approx((0.5, 0.6, 1.0, 0.1))
    assert "| coqa_bpb | 4 | 0.5000 | 1.0000 | 0.6000 | +0.1000 (" in capsys.readouterr().out
    other = _drift(tmp_path, sha="else", name="other.jsonl.gz")
    assert main(base + ["--drift", str(other)]) == 2
    assert "handed off through map else" in capsys.readouterr().err
    assert main(base + ["--previous-drift", str(other)]) == 2
    assert "--previous-drift needs --previous-label" in capsys.readouterr().err
    # both maps' CoQA side by side; without --previous-drift the previous map's column says "—"
    old = _drift(tmp_path, sha="old", name="old.jsonl.gz")
    assert main(base + ["--previous-label", "v3", "--drift", str(_drift(tmp_path)), "--previous-drift", str(old)]) == 0
    s = json.loads(out.read_text())
    assert s["previous"]["tasks"]["coqa_bpb"]["delta"] == pytest.approx(0.1)
    assert "| coqa_bpb | 4 | 0.5000 | 1.0000 | 0.6000 | +0.1000 (" in capsys.readouterr().out
    assert main(base + ["--previous-label", "v3", "--drift", str(_drift(tmp_path))]) == 0
    assert "coqa_bpb" not in json.loads(out.read_text())["previous"]["tasks"]
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| coqa_bpb |"))
    assert row.endswith("| — | — | — |") and "+0.1000 (" in row
    assert main(base + ["--previous-label", "v3", "--previous-drift", str(old)]) == 2
    assert "--previous-drift needs --drift" in capsys.readouterr().err


def test_fidelity_summary_adds_mcnemar_and_bits_per_byte_by_bytes(tmp_path, capsys):
    """MMLU (from _mmlu, items i0-i4): v4 is right where the target is wrong on i4 and never the reverse, so
    McNemar's p is 1.0 (one discordant item); v3 is wrong where the target is right on i2 and i3: p 0.5.
    Passage QA with bytes: s0 (1 byte) and s1 (9 bytes); v4 0.7 on both against the target's 0.5 and 0.6:
    by bytes (0.2·1 + 0.1·9) / 10 = +0.11, the mean of ratios +0.15."""
    mmlu = _mmlu(tmp_path)
    vals = {"target": [0.5, 0.6], "source": [0.8, 0.9], "rho=0.2/suffix@v4": [0.7, 0.7], "rho=0.2/suffix@v3": [1.0, 1.2]}
    rows = [{"item": f"s{k}", "arm": arm, "bpb": v, "bytes": (1, 9)[k]} for arm, vs in vals.items() for k, v in enumerate(vs)]
    coqa = _write(tmp_path / "coqa.jsonl", "coqa_passage", rows)
    out = tmp_path / "fid.json"
    assert main(["eval", "report", str(mmlu), str(coqa), "--fidelity-summary", str(out), "--arm", "0.2:suffix",
                 "--map-label", "v4", "--previous-label", "v3"]) == 0
    s = json.loads(out.read_text())
    m, pm, c = s["tasks"]["mmlu"], s["previous"]["tasks"]["mmlu"], s["tasks"]["coqa_passage"]
    assert m["mcnemar_p"] == 1.0 and pm["mcnemar_p"] == 0.5 and m["by_bytes"] is None
    assert c["mcnemar_p"] is None and c["delta"] == pytest.approx(0.15)
    b = c["by_bytes"]
    assert b["delta"] == pytest.approx(0.11) and b["ci"][0] <= b["delta"] <= b["ci"][1]
    assert (b["target"], b["source"], b["handoff"]) == pytest.approx((0.59, 0.89, 0.7))
    table = capsys.readouterr().out
    assert "fidelity through map v4[new]" in table and "| v3[old]: handoff |" in table
    assert "; McNemar p 0.500)" in table and "; by bytes +0.1100 (" in table
