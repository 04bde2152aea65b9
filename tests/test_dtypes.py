"""`--dtype auto` (rarecache/dtypes.py): every command's dtype on each kind of machine, with the machine's
capability mocked (torch's own probes patched), and a map stored in bf16 handing off the same rows in
both compute dtypes up to bf16's rounding."""

from __future__ import annotations

import argparse
from argparse import Namespace

import pytest
import torch

from rarecache import dtypes
from rarecache.cli import build_parser, main
from rarecache.commands.common import settle_dtype, with_map_dtype
from rarecache.dtypes import DtypeChoice, resolve_dtype
from rarecache.engine.runner import Runner
from rarecache.errors import RarecacheError
from rarecache.transfer.handoff import HandoffConfig, handoff
from rarecache.transfer.mapper import Mapper

# (avx512_bf16, amx, torch's capability name, a CUDA GPU present)
MACHINES = {
    "avx2": (False, False, "AVX2", False),  # AMD Zen 2/3, Intel before Cooper Lake: bf16 emulated
    "avx512 without bf16": (False, False, "AVX512", False),  # Skylake-X, Ice Lake: still emulated
    "avx512_bf16": (True, False, "AVX512", False),  # Cooper Lake, Zen 4
    "amx": (False, True, "AVX512", False),  # Sapphire Rapids and later (torch probes the tiles)
    "avx2 + cuda": (False, False, "AVX2", True),
}
NATIVE = {"avx2": False, "avx512 without bf16": False, "avx512_bf16": True, "amx": True, "avx2 + cuda": False}

# every command with --dtype, parsed from its own argv, and where it computes: the CPU (our engine), a device
# named by --device, or vLLM's (the GPU where there is one)
COMMANDS = {
    "demo": (["demo"], "cpu"),
    "generate": (["generate", "--model", "M", "hi"], "cpu"),
    "calibrate": (["calibrate", "--source", "S", "--target", "T"], "cpu"),
    "mlp": (["mlp", "m.map", "--source", "S", "--target", "T", "--out", "o"], "cpu"),
    "refine": (["refine", "m.map", "--source", "S", "--target", "T", "--out", "o"], "cpu"),
    "inspect": (["inspect", "m.map"], "cpu"),
    "ppl": (["ppl", "--source", "S", "--target", "T", "--map", "m"], "cpu"),
    "eval run": (["eval", "run", "--task", "arc_challenge", "--source", "S", "--target", "T", "--map", "m",
                  "--out", "o"], "cpu"),
    "eval drift run": (["eval", "drift", "run", "--source", "S", "--target", "T", "--out", "o"], "cpu"),
    "eval probe": (["eval", "probe", "--source", "S", "--target", "T", "--map", "m", "--out", "o"], "cpu"),
    "serve": (["serve"], "cpu"),
    "serve --engine vllm": (["serve", "--engine", "vllm"], "vllm"),
    "bench map": (["bench", "map", "--source", "S", "--target", "T", "--map", "m"], "cpu"),
    "bench handoff": (["bench", "handoff"], "cpu"),
    "bench handoff --device cuda": (["bench", "handoff", "--device", "cuda"], "cuda"),
    "bench serve": (["bench", "serve", "--source", "S", "--target", "T", "--map", "m"], "cpu"),
    "bench serve --engine vllm": (["bench", "serve", "--engine", "vllm", "--source", "S", "--target", "T",
                                   "--map", "m"], "vllm"),
    "bench load": (["bench", "load"], "cpu"),
    "bench load --engine vllm": (["bench", "load", "--engine", "vllm"], "vllm"),
    "bench ablate": (["bench", "ablate"], "cpu"),
    "bench soak": (["bench", "soak"], "cpu"),
    "bench gpu": (["bench", "gpu", "--out", "o"], "cuda"),
    "bench gpu --smoke": (["bench", "gpu", "--smoke", "--out", "o"], "cpu"),
    "bench store-soak": (["bench", "store-soak", "--source", "S", "--target", "T", "--map", "m"], "vllm"),
}


def machine(monkeypatch, kind: str) -> None:
    """Make torch report the `kind` of MACHINES."""
    avx512_bf16, amx, capability, cuda = MACHINES[kind]
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    for var in dtypes.ONEDNN_CAP_VARS:  # the machine's own oneDNN, uncapped
        monkeypatch.delenv(var, raising=False)


def expected(kind: str, where: str) -> str:
    gpu = where == "cuda" or (where == "vllm" and MACHINES[kind][3])
    return "bfloat16" if gpu or NATIVE[kind] else "float32"


def _commands_with_dtype(parser, path=()):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _commands_with_dtype(sub, (*path, name))
    if any(a.dest == "dtype" for a in parser._actions):
        yield " ".join(path), parser


def test_every_command_with_dtype_defaults_to_auto_and_is_listed_here():
    found = dict(_commands_with_dtype(build_parser()))
    assert set(found) == {name.split(" --")[0] for name in COMMANDS}  # a new command is added to COMMANDS
    for name, parser in found.items():
        action = next(a for a in parser._actions if a.dest == "dtype")
        assert action.default == "auto" and tuple(action.choices) == dtypes.DTYPE_CHOICES, name


@pytest.mark.parametrize("kind", sorted(MACHINES))
def test_each_command_resolves_auto_by_what_the_machine_runs_natively(monkeypatch, capsys, kind):
    machine(monkeypatch, kind)
    for name, (argv, where) in COMMANDS.items():
        args = build_parser().parse_args(argv)
        assert args.dtype == "auto", name
        choice = settle_dtype(args)
        assert args.dtype == choice.dtype == expected(kind, where), (name, kind)
        assert choice.capability == MACHINES[kind][2]
        assert capsys.readouterr().err == choice.line() + "\n"  # said once, on stderr
    lines = {"avx2": "dtype float32: this CPU has no native bf16 (AVX2)",
             "avx512 without bf16": "dtype float32: this CPU has no native bf16 (AVX512)",
             "avx512_bf16": "dtype bfloat16: this CPU runs bf16 natively (AVX512, avx512_bf16)",
             "amx": "dtype bfloat16: this CPU runs bf16 natively (AVX512, amx)",
             "avx2 + cuda": "dtype float32: this CPU has no native bf16 (AVX2)"}
    assert resolve_dtype().line() == lines[kind]
    assert resolve_dtype("auto", "cuda:1").line() == "dtype bfloat16: CUDA runs bf16 natively"


@pytest.mark.parametrize("kind", sorted(MACHINES))
@pytest.mark.parametrize("asked", ["bfloat16", "float32"])
def test_a_dtype_the_user_names_is_obeyed(monkeypatch, capsys, kind, asked):
    machine(monkeypatch, kind)
    for name, (argv, where) in COMMANDS.items():
        args = build_parser().parse_args([*argv, "--dtype", asked])
        choice = settle_dtype(args)
        assert args.dtype == choice.dtype == asked, (name, kind)
        slow = asked == "bfloat16" and expected(kind, where) == "float32"
        err = capsys.readouterr().err
        assert err == (f"{choice.line()}\n" if slow else ""), (name, kind)  # only bf16 where it is emulated
        if slow:
            assert "float32 runs faster here (--dtype auto)" in err


def test_main_settles_the_dtype_before_the_command_runs(monkeypatch, capsys):
    machine(monkeypatch, "avx2")
    assert main(["generate", "--model", "/no/such/model", "hi"]) == 2
    first, error = capsys.readouterr().err.splitlines()
    assert first == "dtype float32: this CPU has no native bf16 (AVX2)" and error.startswith("rarecache: error:")
    assert main(["models"]) == 0 and "dtype" not in capsys.readouterr().err  # no --dtype, nothing said


def test_without_torchs_probes_the_cpu_flags_decide(monkeypatch, tmp_path):
    monkeypatch.delattr(torch.cpu, "_is_avx512_bf16_supported")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    info = tmp_path / "cpuinfo"
    monkeypatch.setattr(dtypes, "CPUINFO", info)
    for flags, want in (("fpu avx2 avx512f", "float32"), ("fpu avx2 avx512f avx512_bf16", "bfloat16"),
                        ("fpu avx2 amx_tile amx_bf16", "bfloat16"), ("fpu avx2 amx_tile", "float32")):
        info.write_text(f"processor\t: 0\nmodel name\t: x\nflags\t\t: {flags}\n\nprocessor\t: 1\nflags\t\t: fpu\n")
        assert resolve_dtype().dtype == want, flags
    info.unlink()  # no /proc/cpuinfo (not Linux) and no probes: nothing is known native
    assert resolve_dtype() == DtypeChoice("float32", "this CPU has no native bf16 (AVX512)", "AVX512", "auto",
                                          "float32")


def test_the_library_defaults_resolve_by_the_same_rule(monkeypatch, tmp_path):
    from rarecache.adapters.vllm.server.serve_config import VllmServeConfig
    from rarecache.demo import DemoConfig

    for kind, want in (("avx2", "float32"), ("amx", "bfloat16"), ("avx2 + cuda", "bfloat16")):
        machine(monkeypatch, kind)
        assert VllmServeConfig(store=tmp_path).dtype == want, kind  # vLLM takes the GPU where there is one
        assert DemoConfig().dtype == ("float32" if kind == "avx2 + cuda" else want), kind  # ours: the CPU
        assert VllmServeConfig(store=tmp_path, dtype="float32").dtype == DemoConfig(dtype="float32").dtype == "float32"
    with pytest.raises(RarecacheError, match="dtype must be one of auto, bfloat16, float32"):
        DemoConfig(dtype="float16")


def test_a_bf16_stored_map_hands_off_the_same_rows_in_both_compute_dtypes(monkeypatch, pair_dir, fitted, tmp_path):
    """The map's bf16 weights are widened on load (exactly: bf16 -> float32 loses nothing); a float32 run maps
    with them as stored, a bf16 run with them as stored too, so the handed-off rows differ only by the
    rounding of a bf16 run (the models' own and the map's products), and the map computes in the run's dtype."""
    _, _, mapper, prompts = fitted
    mapper.save(tmp_path / "bf16.safetensors", weights="bfloat16")
    stored = Mapper.load(tmp_path / "bf16.safetensors")
    for side in ("k", "v"):
        w = stored.sides[side].weight
        assert w.dtype == torch.float32 and torch.equal(w, mapper.sides[side].weight.bfloat16().float())
    rows, recomputed = {}, {}
    for kind in ("avx2", "amx"):
        machine(monkeypatch, kind)
        args = build_parser().parse_args(["ppl", "--source", "S", "--target", "T", "--map", "m"])
        settle_dtype(args)
        dt = getattr(torch, args.dtype)
        source, target = (Runner.load(pair_dir / n, dtype=dt) for n in ("src", "tgt"))
        run = with_map_dtype(stored, args)  # --map-dtype unset: the map follows the compute dtype
        assert run.dtype_for(target) == target.dtype == dt
        cache, _, res = handoff(source, target, run, prompts, HandoffConfig(rho=0.25, selector="suffix"))
        n = min(len(p) for p in prompts)
        recomputed[args.dtype] = res.positions
        kept = [[p for p in range(n) if p not in res.positions[b]] for b in range(len(prompts))]
        rows[args.dtype] = [torch.stack([getattr(cache, s)[:, b, :, kept[b]] for s in ("k", "v")]).float()
                            for b in range(len(prompts))]  # (2, L, H, kept, D) per prompt
    assert recomputed["float32"] == recomputed["bfloat16"]  # suffix: the same positions in both
    for f32, bf16 in zip(rows["float32"], rows["bfloat16"]):
        assert f32.shape[3] > 10 and not torch.equal(f32, bf16)
        err = (bf16 - f32).norm() / f32.norm()
        assert err < 0.02, err  # bf16 keeps 8 mantissa bits (0.4% per rounding), over 3 source layers and the map


def test_a_onednn_cap_below_bf16_makes_auto_pick_float32(monkeypatch):
    """oneDNN capped at AVX2 multiplies bf16 at 0.3 GFLOP/s on one AMX core (1028 uncapped, float32 169 either
    way; research/scripts/isa_caps.py on the AMX Xeon of 2026-12-07): on a CPU with native bf16 the cap decides. oneDNN
    lower-cases the value and ignores a name it does not know, so those are no cap here either."""
    machine(monkeypatch, "amx")
    assert resolve_dtype().dtype == "bfloat16"
    for cap, want in (("AVX2", "float32"), ("avx512_core", "float32"), ("AVX2_VNNI_2", "float32"),
                      ("AVX512_CORE_BF16", "bfloat16"), ("AVX512_CORE_AMX", "bfloat16"), ("AVX10_2", "bfloat16"),
                      ("ALL", "bfloat16"), ("", "bfloat16"), ("AVX512", "bfloat16"), (" AVX2", "bfloat16")):
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
        choice = resolve_dtype()
        assert choice.dtype == want, cap
        assert ("caps oneDNN below" in choice.reason) == (want == "float32"), cap
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    monkeypatch.setenv("DNNL_MAX_CPU_ISA", "avx2")  # oneDNN's older name for the same cap, named as read
    assert resolve_dtype() == DtypeChoice("float32", "DNNL_MAX_CPU_ISA=avx2 caps oneDNN below this CPU's native "
                                          "bf16 (AVX512)", "AVX512", "auto", "float32")
    assert resolve_dtype("bfloat16").worth_saying  # asked for anyway: obeyed, with the warning
    machine(monkeypatch, "avx2")  # a CPU without native bf16 says so, cap or not
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert resolve_dtype().reason == "this CPU has no native bf16 (AVX2)"
