"""The served defaults (rarecache/defaults.py): one map, selector and budget for every command, held to
the committed summary that measured them and to the file the package ships."""

from __future__ import annotations

import dataclasses
import json
import shlex
from pathlib import Path

import pytest

from rarecache import defaults
from rarecache.defaults import SERVED, default_selector, general_map_path, pair_map
from rarecache.registry import SELECTORS as SELECTOR_NAMES
from rarecache.errors import RarecacheError
from rarecache.packages import sha256_file

ROOT = Path(__file__).resolve().parents[1]
SUMMARY = ROOT / "docs" / "artifacts" / "fidelity-summary.json"  # (tests may read docs/; the package never does)
LONGCTX = ROOT / "docs" / "artifacts" / "longctx-summary.json"


def test_served_file_is_what_the_committed_adoption_summary_measured():
    """The summary `eval report --fidelity-summary` wrote from the adoption runs (issue #41's schema)."""
    summary = json.loads(SUMMARY.read_text())
    assert SERVED.sha256 == summary["map"] != summary["previous"]["map"]
    assert {"mmlu", "arc_challenge", "hellaswag", "gsm8k", "coqa_bpb"} <= set(summary["tasks"])


def test_served_selector_and_budget_are_the_long_context_summary_served_arm():
    """`eval longctx-summary` writes the served arm it summarised, through the served file (rule 9, issue #54)."""
    served = json.loads(LONGCTX.read_text())["served"]
    assert (SERVED.selector, SERVED.rho, SERVED.sha256) == (served["selector"], served["rho"], served["map_sha256"])


def test_the_fallback_is_what_the_vllm_adapter_runs_by_default():
    from rarecache.adapters.vllm.connector.core import ENGINE_DEFAULT, ENGINE_SELECTORS
    from rarecache.adapters.vllm.server.serve_config import VllmServeConfig

    assert SERVED.fallback in ENGINE_SELECTORS and SERVED.fallback != SERVED.selector
    assert ENGINE_DEFAULT == VllmServeConfig(store="/nowhere").selector == SERVED.fallback
    assert SERVED.selector not in ENGINE_SELECTORS  # else the adapter should run the served default itself


def test_the_served_map_ships_in_the_package_and_is_the_recorded_file():
    assert SERVED.path == ROOT / "rarecache" / SERVED.file  # the package's own directory, not docs/
    assert SERVED.path.is_file() and sha256_file(SERVED.path) == SERVED.sha256
    assert defaults.served_map_file() == SERVED.path


def test_the_recorded_commands_are_what_the_map_itself_records():
    from rarecache.cli import build_parser
    from rarecache.eval.mix import preset_of
    from rarecache.transfer.mapper import Mapper

    info = Mapper.load(SERVED.path).info
    words = shlex.split(SERVED.calibrate)
    assert words[:2] == ["rarecache", "calibrate"]
    args = build_parser().parse_args([*words[1:], "--out", "fit.safetensors"])
    assert (args.source, args.target) == (SERVED.source, SERVED.target)
    assert (info.source["name"], info.target["name"]) == (SERVED.source, SERVED.target)
    assert args.preset == preset_of(info.corpus["name"])
    assert args.tokens == info.tokens and args.heldout_tokens == info.calibration["heldout_tokens"]
    assert args.dtype == info.calibration["dtype"]
    assert (args.token_inputs, args.exact_layer0) == (info.token_inputs, info.exact_layer0)
    store = build_parser().parse_args([*shlex.split(SERVED.store.format(fit="fit.safetensors"))[1:], "--out", "x"])
    assert store.map == Path("fit.safetensors") and store.weights_dtype == info.weights
    assert defaults.remake("F").count("--out") == 2


def test_the_served_selector_is_a_registered_one_and_no_oracle():
    from rarecache.transfer.selectors import SELECTORS

    assert SERVED.selector in SELECTOR_NAMES and SERVED.selector not in SELECTOR_NAMES.oracles
    assert not SELECTORS[SERVED.selector].oracle


def test_every_selector_flag_lists_the_registry_and_names_the_default(capsys, monkeypatch):
    from rarecache.cli import main

    monkeypatch.setenv("COLUMNS", "1000")  # no wrapping inside a name (argparse breaks lines at hyphens)
    for words in (["generate"], ["serve"], ["demo"], ["bench", "handoff"], ["bench", "serve"], ["bench", "load"],
                  ["bench", "store-soak"]):
        with pytest.raises(SystemExit):
            main([*words, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        vllm_only = words in (["bench", "load"], ["bench", "store-soak"])  # their one --selector feeds vLLM too
        default = f"{SERVED.fallback}, the served fallback" if vllm_only else f"{SERVED.selector}, the served default"
        assert f"(default: {default}" in text, words
        assert all(n in text for n in SELECTOR_NAMES), words


def test_the_default_selector_is_the_served_one_where_the_engine_runs_it():
    assert default_selector() == (SERVED.selector, "the served default (measured best through the served general map)")
    assert default_selector(("rank", SERVED.selector))[0] == SERVED.selector
    name, why = default_selector(("rank", "random"))
    assert name == "rank" and f"{SERVED.selector}, does not run" in why
    name, why = default_selector(("rank", SERVED.fallback))
    assert name == SERVED.fallback and "served fallback" in why


def test_the_librarys_config_dataclasses_default_to_the_served_budget():
    """Issue #42: one default selector and budget everywhere, the library's own objects included, not
    only the commands (HandoffConfig once defaulted to rank at 0, ServiceConfig and Conversation to 0.3)."""
    import inspect

    from rarecache.bench.handoffbench import time_cell
    from rarecache.bench.load import PoissonConfig
    from rarecache.bench.serve import SwitchBenchConfig
    from rarecache.serve.settings import ServiceConfig
    from rarecache.transfer.conversation import Conversation
    from rarecache.transfer.diagnostics import diagnose
    from rarecache.transfer.handoff import HandoffConfig, handoff
    from rarecache.transfer.pipeline import Pipeline

    served = HandoffConfig()
    assert (served.rho, served.selector) == (SERVED.rho, SERVED.selector)
    assert HandoffConfig(0.5).selector == SERVED.selector
    assert ServiceConfig().handoff == SwitchBenchConfig().handoff == served
    for fn in (handoff, Pipeline.generate, Conversation.__init__):
        assert inspect.signature(fn).parameters["cfg"].default == served, fn
    assert PoissonConfig().rho == inspect.signature(diagnose).parameters["rho"].default == SERVED.rho
    assert inspect.signature(time_cell).parameters["selector"].default == SERVED.selector


def test_the_vllm_adapters_defaults_are_the_served_ones():
    import inspect

    from rarecache.adapters.vllm.connector.core import Settings
    from rarecache.adapters.vllm.server.launch import bench_service
    from rarecache.adapters.vllm.server.serving import VllmServeConfig

    cfg = VllmServeConfig(store="/nowhere")  # the served fallback: the adapter cannot run the served selector
    assert (cfg.rho, cfg.selector) == (SERVED.rho, SERVED.fallback)
    fields = {f.name: f.default for f in dataclasses.fields(Settings)}
    assert (fields["rho"], fields["selector"]) == (SERVED.rho, SERVED.fallback)
    assert inspect.signature(bench_service).parameters["selector"].default == SERVED.fallback


def test_a_pairs_map_is_the_one_calibrate_made_else_the_shipped_one(tmp_path, monkeypatch):
    assert general_map_path("qwen2.5-coder-0.5b-instruct", str(tmp_path / "m" / "big.gguf"), tmp_path) == (
        tmp_path / "maps" / "general-qwen2.5-coder-0.5b-instruct-to-big.safetensors")
    assert pair_map(SERVED.source, SERVED.target, tmp_path) == SERVED.path  # nothing made: the shipped one
    assert pair_map(SERVED.source, "other-model", tmp_path) is None  # another pair: none
    made = general_map_path(SERVED.source, SERVED.target, tmp_path)
    made.parent.mkdir(parents=True)
    made.write_bytes(b"made here")
    assert pair_map(SERVED.source, SERVED.target, tmp_path) == made  # what calibrate made comes first
    made.unlink()
    monkeypatch.setattr(defaults, "SERVED", dataclasses.replace(SERVED, sha256="0" * 64))
    with pytest.raises(RarecacheError, match="not the recorded one"):
        pair_map(SERVED.source, SERVED.target, tmp_path)  # a damaged install is refused, not served
    monkeypatch.setattr(defaults, "SERVED", dataclasses.replace(SERVED, file="data/none.safetensors"))
    with pytest.raises(RarecacheError, match="missing from this install"):
        pair_map(SERVED.source, SERVED.target, tmp_path)


def test_calibrate_writes_the_general_map_to_its_place_and_other_maps_need_out(tmp_path, pair_dir, capsys):
    from rarecache.cli import main

    src, tgt = str(pair_dir / "src"), str(pair_dir / "tgt")
    assert main(["calibrate", "--source", src, "--target", tgt, "--corpus", str(pair_dir / "corpus.txt")]) == 2
    assert "give --out FILE" in capsys.readouterr().err


def test_serve_and_generate_resolve_the_served_defaults(tmp_path, monkeypatch):
    """What `rarecache serve` and `generate` hand off with when no flag names it (tests/test_install.py
    checks a regular install resolves the same)."""
    from rarecache.cli import build_parser
    from rarecache.commands.common import fill_served_defaults

    monkeypatch.setenv("RARECACHE_HOME", str(tmp_path))
    parser = build_parser()
    serve = parser.parse_args(["serve"])
    fill_served_defaults(serve, serve.source, serve.target)
    generate = parser.parse_args(["generate", "--source", SERVED.source, "--target", SERVED.target, "hi"])
    fill_served_defaults(generate, generate.source, generate.model)
    for args in (serve, generate):
        assert (args.map, args.selector, float(args.rho)) == (SERVED.path, SERVED.selector, SERVED.rho)
    other = parser.parse_args(["generate", "--source", "a", "--target", "b", "--selector", "rank", "--rho", "0.5"])
    fill_served_defaults(other, other.source, other.model)
    assert (other.map, other.selector, other.rho) == (None, "rank", 0.5)  # named flags stay; no map for another pair


def test_the_package_exports_the_public_objects_lazily():
    import subprocess
    import sys

    import rarecache
    from rarecache.transfer.conversation import Conversation
    from rarecache.transfer.gate.policy import GatePolicy
    from rarecache.transfer.handoff import HandoffConfig
    from rarecache.transfer.mapper import Mapper
    from rarecache.transfer.pipeline import Pipeline

    assert (rarecache.Pipeline, rarecache.HandoffConfig, rarecache.Mapper, rarecache.Conversation,
            rarecache.GatePolicy, rarecache.SERVED) == (Pipeline, HandoffConfig, Mapper, Conversation, GatePolicy,
                                                        SERVED)
    assert all(getattr(rarecache, name) is not None for name in rarecache.__all__)
    code = ("import sys, rarecache; rarecache.SERVED; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert out.strip() == "[]"  # the package and its defaults import no torch


def test_a_bench_writes_under_the_cache_folder_unless_told_where(fitted, pair_dir, tmp_path, monkeypatch, capsys):
    """Nothing is written where the user did not ask: with no --summary, `bench handoff` writes its summary
    under $RARECACHE_HOME/results, not into the current folder (a checkout's committed artifacts)."""
    from rarecache.cli import main

    _, _, mapper, _ = fitted
    mapper.save(tmp_path / "m.safetensors")
    here, home = tmp_path / "here", tmp_path / "home"
    here.mkdir()
    monkeypatch.chdir(here)
    monkeypatch.setenv("RARECACHE_HOME", str(home))
    assert main(["bench", "handoff", "--source", str(pair_dir / "src"), "--target", str(pair_dir / "tgt"), "--map",
                 str(tmp_path / "m.safetensors"), "--lengths", "24", "--rhos", "0.3", "--batches", "1",
                 "--repeats", "1", "--dtype", "float32"]) == 0
    assert list(here.iterdir()) == []
    written = json.loads((home / "results" / "bench-handoff-summary.json").read_text())
    assert written["selector"] == SERVED.selector  # the served default
    assert f"summary written to {home / 'results'}" in capsys.readouterr().out


def test_the_demo_hands_off_through_the_served_map_and_calibrates_nothing(fitted, pair_dir, tmp_path, monkeypatch,
                                                                           capsys):
    """`rarecache demo` on the tiny pair standing in for the bundled one (its map as the shipped file): the
    table has ρ 0, the served budget and 1, nothing is calibrated, and ρ = 1 answers as the target alone."""
    from rarecache import demo

    _, _, mapper, _ = fitted
    mapper.save(tmp_path / "served.safetensors")
    monkeypatch.setattr(demo, "SOURCE", str(pair_dir / "src"))
    monkeypatch.setattr(demo, "TARGET", str(pair_dir / "tgt"))
    monkeypatch.setattr(demo, "pull", lambda name, cache_dir=None: None)
    monkeypatch.setattr(demo, "served_map_file", lambda: tmp_path / "served.safetensors")
    monkeypatch.setattr(demo, "Calibration", None)  # calibrating would fail
    monkeypatch.setattr(demo, "PROMPTS", ["the quick brown fox", "def add return tokens"])
    monkeypatch.setattr(demo, "long_prompt", lambda cfg, mapper: "the lazy dog jumps over the quick brown fox " * 3)
    cfg = demo.DemoConfig(dtype="float32", max_new_tokens=4, cache_dir=tmp_path)
    assert (cfg.rhos, cfg.selector) == ((0.0, SERVED.rho, 1.0), SERVED.selector)
    assert demo.run_demo(cfg) == 0
    out = capsys.readouterr().out
    table = [line.split() for line in out.splitlines() if line.strip().startswith(("0 ", f"{SERVED.rho:g}*", "1 "))]
    rows = {words[0]: words for words in table}
    assert set(rows) == {"0", f"{SERVED.rho:g}*", "1"}
    assert rows["1"][-1] == "100%" and all(r[-2].endswith("x") for r in rows.values())
    assert f"handoff rho={SERVED.rho:g} (served)" in out


def test_the_demo_decodes_its_arms_together_as_each_arm_alone_would(fitted, pair_dir, monkeypatch):
    """The demo decodes every arm's rows in one batch (decoding is most of its time on a CPU): each row starts
    from exactly the cache, logits and position that arm's own call makes (the target's prefill,
    `Pipeline.hand_off`), so each arm answers as the public calls do for it alone (`LLM.generate`,
    `Pipeline.generate`), with the same positions recomputed."""
    import torch

    from rarecache import LLM, HandoffConfig, SamplingConfig, demo
    from rarecache.engine.generate import decode
    from rarecache.transfer.pipeline import Pipeline

    _, _, mapper, _ = fitted
    pipe = Pipeline(LLM(pair_dir / "src"), LLM(pair_dir / "tgt"), mapper)
    texts = ("the quick brown fox", "def add return tokens", "the lazy dog jumps over the quick brown fox " * 3)
    prompts = [[{"role": "user", "content": t}] for t in texts]
    ids = [pipe.target.encode(p) for p in prompts]
    cfg = demo.DemoConfig(dtype="float32", max_new_tokens=6)
    seen = {}

    def decode_seen(runner, cache, logits, pos, *args, **kw):  # what the one decode starts from
        seen.update(cache=cache, logits=logits.clone(), pos=pos.clone())
        return decode(runner, cache, logits, pos, *args, **kw)

    monkeypatch.setattr(demo, "decode", decode_seen)
    arms = demo.run_arms(cfg, pipe, ids, demo._Progress())
    n, width = len(ids), max(map(len, ids))
    assert seen["pos"].tolist() == [len(i) for i in ids] * (1 + len(cfg.rhos))
    own, first = pipe.target.runner.prefill(ids)
    want_logits = [first.logits]
    for a, rho in enumerate(cfg.rhos, 1):
        cache = pipe.target.runner.new_cache(n, width)
        logits, _ = pipe.hand_off(ids, HandoffConfig.named(rho, cfg.selector), [cache.row(b) for b in range(n)])
        want_logits.append(logits)
        for b, T in enumerate(map(len, ids)):  # (the decode wrote its own rows after each prompt's T)
            for side in ("k", "v"):
                assert torch.equal(getattr(seen["cache"], side)[:, a * n + b, :, :T],
                                   getattr(cache, side)[:, b, :, :T]), (rho, b, side)
    for b, T in enumerate(map(len, ids)):
        assert torch.equal(seen["cache"].k[:, b, :, :T], own.k[:, b, :, :T])
    assert torch.equal(seen["logits"], torch.cat(want_logits))
    sampling = SamplingConfig(max_new_tokens=6)
    want = {"target alone": (pipe.target.generate(prompts, sampling), None)}
    for rho in cfg.rhos:
        want[f"handoff rho={rho:g}{' (served)' if rho == SERVED.rho else ''}"] = pipe.generate(
            prompts, HandoffConfig.named(rho, cfg.selector), sampling)
    assert list(arms.answers) == list(want)
    for arm, (outs, _) in want.items():
        assert [g.tokens for g in arms.answers[arm]] == [o.tokens for o in outs], arm
    assert [r[1] for r in arms.rows] == [sum(map(len, res.positions)) for _, res in list(want.values())[1:]]
