"""`rarecache bench gpu` and scripts/gpu.sh off a GPU: the smoke run end to end (the fast tier's check that the
GPU run will go), transformers' twin sharing our weights, and the errors a user gets."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rarecache.bench import gpu
from rarecache.bench.shapes import random_model
from rarecache.cli import main
from rarecache.engine.runner import Runner

from .conftest import error_of

ROOT = Path(__file__).resolve().parents[1]


def test_smoke_run_of_the_gpu_script(tmp_path):
    """SMOKE=1 bash scripts/gpu.sh: the CUDA tests' CPU subset and the bench's toy grid, summary written."""
    env = {**os.environ, "SMOKE": "1", "OUT": str(tmp_path), "PYTHON": sys.executable}
    run = subprocess.run(["bash", str(ROOT / "scripts" / "gpu.sh")], env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "passed" in (tmp_path / "test_cuda.txt").read_text()
    summary = json.loads((tmp_path / "handoff-summary.json").read_text())
    assert summary["device"].startswith("cpu") and summary["attention"] == "blocks"
    assert summary["failures"] == [] and summary["skipped"] == []
    grid = gpu.SMOKE
    cells = {(r["T"], r["batch"], r["rho"], r["selector"]) for r in summary["rows"]}
    assert cells == {(T, B, rho, s) for T in grid.lengths for B in grid.batches for rho in grid.rhos
                     for s in grid.selectors}
    for r in summary["rows"]:
        assert tuple(r) == gpu.ROW_KEYS
        assert all(math.isfinite(r[k]) and r[k] > 0 for k in gpu.ROW_KEYS[4:])
    detail = json.loads((tmp_path / "handoff-detail.json").read_text())["rows"]
    for d, r in zip(detail, summary["rows"]):  # the summary's figures are the stronger prefill's
        best = min(d["ours_prefill_ms"], d["transformers_prefill_ms"])
        assert d["baseline"] == ("ours" if d["ours_prefill_ms"] <= d["transformers_prefill_ms"] else "transformers")
        assert r["speedup_vs_best_prefill"] == pytest.approx(best / d["handoff_ms"])
        assert r["map_score_share_of_prefill"] == pytest.approx((d["map_ms"] + d["score_ms"]) / best)
        assert r["of_sparse_ceiling"] == pytest.approx(r["speedup_vs_best_prefill"] / d["ceiling_sparse"])


@torch.inference_mode()
def test_transformers_twin_runs_our_weights():
    """The baseline's model is ours: the same logits from the same tensors (float32, toy shapes, both ties)."""
    torch.manual_seed(0)
    for name in ("toy-source", "toy-target"):
        model = random_model(name, torch.float32, "cpu")
        hf = gpu.hf_twin(model, name)
        for ours, theirs in zip(model.state_dict().values(), hf.state_dict().values()):  # one copy in memory
            assert theirs.data_ptr() == ours.data_ptr()
        runner = Runner(model)
        tokens = torch.randint(0, 512, (2, 30), generator=torch.Generator().manual_seed(1))
        ours = runner.forward(tokens, torch.arange(30).expand(2, 30), runner.new_cache(2, 30), logits_at="all")
        torch.testing.assert_close(ours.logits, hf(input_ids=tokens).logits.float(), atol=1e-4, rtol=0)


def test_card_names_make_folder_names():
    assert gpu.card_slug("NVIDIA H100 80GB HBM3") == "h100-80gb-hbm3"
    assert gpu.card_slug("NVIDIA H200") == "h200"


@pytest.mark.parametrize("argv,says", [
    (["--device", "cuda"], "no CUDA GPU"),
    (["--smoke", "--selectors", "nope"], "unknown selector 'nope'"),
    (["--smoke", "--rhos", "1.5"], "--rhos must be a number in [0, 1]"),
    (["--smoke", "--lengths", "0"], "at least 1"),
])
def test_user_mistakes_are_one_line(argv, says, tmp_path, capsys):
    if "cuda" in argv and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert main(["bench", "gpu", "--out", str(tmp_path), *argv]) == 2
    err = error_of(capsys.readouterr().err.strip())
    assert says in err and "\n" not in err and not list(tmp_path.iterdir())


@torch.inference_mode()
def test_a_compile_failure_is_recorded_and_the_layer_runs_eagerly(monkeypatch):
    """--compile: a layer whose compiled form fails runs its eager form (same output) and says so."""
    def broken(fn, **_):
        def call(*a):
            raise RuntimeError("inductor says no")
        return call

    runner = Runner(random_model("toy-target", torch.float32, "cpu"))
    tokens = torch.randint(0, 512, (1, 20), generator=torch.Generator().manual_seed(4))
    pos = torch.arange(20)[None]
    before = runner.forward(tokens, pos, runner.new_cache(1, 20)).logits
    monkeypatch.setattr(torch, "compile", broken)
    failures: list[str] = []
    gpu.compile_layers(runner, failures)
    after = runner.forward(tokens, pos, runner.new_cache(1, 20)).logits
    torch.testing.assert_close(after, before, atol=0, rtol=0)
    assert len(failures) == 2 * runner.num_layers and all("inductor says no" in f for f in failures)
    runner.forward(tokens, pos, runner.new_cache(1, 20))
    assert len(failures) == 2 * runner.num_layers  # tried once per function, not at every call
