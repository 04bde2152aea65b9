"""The handoff's fast paths against the references they replace (fused map and score, fp32
prepacked weights), the memory accounting of `bench handoff` and the summary file it writes."""

from __future__ import annotations

import json
import re

import pytest
import torch

from rarecache.bench.handoffbench import SUMMARY_KEYS
from rarecache.bench.memory import MIB, footprint, formula, measure, memory_kind, nbytes
from rarecache.engine.runner import Runner
from rarecache.models.packed import pack_float32
from rarecache.transfer.handoff import HandoffConfig, handoff
from rarecache.transfer.mapper import SIDES
from rarecache.transfer.selectors import rank_scores


def _caches(target, n, count):
    return [target.new_cache(1, n) for _ in range(count)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fused_map_equals_reference(fitted, dtype):
    """One pass per target layer (gather + de-rotate, K products, rotate into the cache, score) equals
    the plain pipeline: the cache, the centred rows and the rank score."""
    source, target, mapper, prompts = fitted
    src_cache, _ = source.prefill(prompts[:1])
    n = len(prompts[0])
    pos = torch.arange(n)[None]
    fast, slow, scored = _caches(target, n, 3)
    z = mapper.apply(source, src_cache, target, fast, pos, dtype=dtype)
    ref = mapper.apply_reference(source, src_cache, target, slow, pos, dtype=dtype)
    rank = mapper.apply_scored(source, src_cache, target, scored, pos, dtype=dtype)
    tol = dict(atol=1e-5, rtol=1e-5)
    for c in (fast, scored):
        torch.testing.assert_close(c.k, slow.k, **tol)
        torch.testing.assert_close(c.v, slow.v, **tol)
        assert torch.equal(c.filled, slow.filled)
    for side in SIDES:
        torch.testing.assert_close(z[side], ref[side], **tol)
    want = rank_scores(mapper, ref)
    torch.testing.assert_close(rank, want, atol=1e-5 * float(want.abs().max()), rtol=1e-4)
    assert mapper.apply_scored(source, src_cache, target, target.new_cache(1, n), pos, rank=False) is None


def test_fused_map_in_bfloat16_equals_reference(fitted):
    """bf16 maps multiply the gathered blocks once (one rounding, as the reference): close at bf16 precision."""
    source, target, mapper, prompts = fitted
    src_cache, _ = source.prefill(prompts[:1])
    n = len(prompts[0])
    pos = torch.arange(n)[None]
    fast, slow = _caches(target, n, 2)
    z = mapper.apply(source, src_cache, target, fast, pos, dtype=torch.bfloat16)
    ref = mapper.apply_reference(source, src_cache, target, slow, pos, dtype=torch.bfloat16)
    for side in SIDES:
        scale = float(ref[side].float().abs().max())
        torch.testing.assert_close(z[side].float(), ref[side].float(), atol=2e-2 * scale, rtol=0)
    torch.testing.assert_close(fast.k, slow.k, atol=2e-2 * float(slow.k.abs().max()), rtol=0)


def test_map_computing_in_bfloat16_next_to_float32_models(fitted):
    """`computing_in(bf16)`: a float32 handoff maps in bf16 (the bf16 reference's rows, not float32's), the
    recomputed rows stay the target's own (ρ = 1 is its prefill), and the original map is untouched."""
    source, target, mapper, prompts = fitted
    fast = mapper.computing_in(torch.bfloat16)
    assert fast.dtype_for(target) == torch.bfloat16 and mapper.dtype_for(target) == torch.float32
    src_cache, _ = source.prefill(prompts[:1])
    n = len(prompts[0])
    pos = torch.arange(n)[None]
    ref, full = _caches(target, n, 2)
    fast.apply_reference(source, src_cache, target, ref, pos)  # in bf16: the map's default dtype now
    mapper.apply_reference(source, src_cache, target, full, pos)
    plain, _, _ = handoff(source, target, fast, prompts[:1], HandoffConfig(rho=0.0, selector="rank"))
    mapped = slice(0, n - 1)  # the last position is always recomputed
    got, want, f32 = (c.k[:, :, :, mapped] for c in (plain, ref, full))
    scale = float(want.abs().max())
    torch.testing.assert_close(got, want, atol=2e-2 * scale, rtol=0)
    assert (got - f32).abs().max() > 1e-4 * scale  # it did not map in float32
    own, _ = target.prefill(prompts[:1])
    exact, _, _ = handoff(source, target, fast, prompts[:1], HandoffConfig(rho=1.0))
    torch.testing.assert_close(exact.k[:, :, :, :n], own.k[:, :, :, :n], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(exact.v[:, :, :, :n], own.v[:, :, :, :n], atol=1e-5, rtol=1e-5)


def test_fused_map_scattered_and_batched_positions(fitted):
    """Positions that are not one run (a batch with padding, a later span, scattered) take the gather
    path and still equal the reference."""
    source, target, mapper, prompts = fitted
    src_cache, _ = source.prefill(prompts)  # (2, 37), second row 23 long
    n = 37
    cases = [torch.tensor([[*range(37)], [*range(23)] + [-1] * 14]),  # padded batch
             torch.tensor([[*range(10, 37)], [*range(5, 23)] + [-1] * 9]),  # handoff after kept prefixes
             torch.tensor([[3, 7, 8, 20, 36], [0, 1, 2, 22, -1]])]  # scattered
    for pos in cases:
        fast, slow = target.new_cache(2, n), target.new_cache(2, n)
        z = mapper.apply(source, src_cache, target, fast, pos)
        ref = mapper.apply_reference(source, src_cache, target, slow, pos)
        valid = pos >= 0
        for side in SIDES:
            torch.testing.assert_close(z[side][:, valid], ref[side][:, valid], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(fast.k[:, :, :, :n], slow.k[:, :, :, :n], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(fast.v[:, :, :, :n], slow.v[:, :, :, :n], atol=1e-5, rtol=1e-5)
        assert torch.equal(fast.filled, slow.filled)
        one = torch.tensor([[*range(4, 30)]]) if pos is cases[0] else torch.tensor([[2, 5, 6, 30]])  # slice, gather
        a, b = target.new_cache(1, n), target.new_cache(1, n)
        row = source.new_cache(1, n)
        row.copy_prefix(src_cache.row(0), n)
        mapper.apply(source, row, target, a, one)
        mapper.apply_reference(source, row, target, b, one)
        torch.testing.assert_close(a.k, b.k, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(a.v, b.v, atol=1e-5, rtol=1e-5)


def test_fused_map_with_residual_mlp_equals_reference(fitted):
    from rarecache.transfer.sidefit import SideMLP

    source, target, mapper, prompts = fitted
    g = torch.Generator().manual_seed(0)
    lt, kd, dt = mapper.sides["k"].weight.shape
    mlp = {s: SideMLP(torch.randn(lt, kd, 8, generator=g) * 0.1, torch.randn(lt, 8, generator=g),
                      torch.randn(lt, 8, dt, generator=g) * 0.1, torch.randn(lt, dt, generator=g)) for s in SIDES}
    both = mapper.with_mlp(mlp, 8)
    src_cache, _ = source.prefill(prompts[:1])
    pos = torch.arange(len(prompts[0]))[None]
    fast, slow = _caches(target, pos.shape[1], 2)
    z, ref = both.apply(source, src_cache, target, fast, pos), both.apply_reference(source, src_cache, target, slow, pos)
    torch.testing.assert_close(fast.k, slow.k, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(z["v"], ref["v"], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(fast.v, target.new_cache(1, pos.shape[1]).v)


@pytest.mark.parametrize("name", ["rank", "random", "attn-rank", "suffix"])
def test_handoff_with_fused_map_equals_reference_pipeline(fitted, name, monkeypatch):
    """The whole handoff with the map's score fused in equals the handoff through the reference map
    (selected positions, logits, cache); selectors that do not read the map get no score."""
    source, target, mapper, prompts = fitted
    cfg = HandoffConfig.named(0.3, name)
    cache, logits, res = handoff(source, target, mapper, prompts, cfg)

    def reference(self, source, source_cache, target, target_cache, positions, dtype=None, rank=True, tokens=None):
        centred = self.apply_reference(source, source_cache, target, target_cache, positions, dtype, tokens)
        return rank_scores(self, centred) if rank else None

    monkeypatch.setattr(type(mapper), "apply_scored", reference)
    ref_cache, ref_logits, ref_res = handoff(source, target, mapper, prompts, cfg)
    assert res.positions == ref_res.positions
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cache.k, ref_cache.k, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cache.v, ref_cache.v, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not pack_float32(torch.float32, "cpu"), reason="no oneDNN float32 packing here")
def test_packed_float32_runner_equals_plain(fitted, pair_dir):
    """float32 weights prepacked for oneDNN (opt-in) against F.linear: prefill, a scattered recompute
    inside a handoff, and ρ = 1 against the packed runner's own prefill."""
    source, plain, mapper, prompts = fitted
    packed = Runner.load(pair_dir / "tgt", pack=True)
    assert packed.packed and not plain.packed and not Runner.load(pair_dir / "tgt").packed  # opt-in only
    (c1, o1), (c2, o2) = packed.prefill(prompts), plain.prefill(prompts)
    torch.testing.assert_close(o1.logits, o2.logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(c1.k, c2.k, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(c1.v, c2.v, atol=1e-5, rtol=1e-4)
    for rho in (0.1, 0.3):
        a = handoff(source, packed, mapper, prompts, HandoffConfig(rho, "rank"))
        b = handoff(source, plain, mapper, prompts, HandoffConfig(rho, "rank"))
        assert a[2].positions == b[2].positions
        torch.testing.assert_close(a[1], b[1], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(a[0].k, b[0].k, atol=1e-5, rtol=1e-4)
    cache, logits, _ = handoff(source, packed, mapper, prompts, HandoffConfig(1.0))
    own, out = packed.prefill(prompts, max_len=37)
    torch.testing.assert_close(logits, out.logits, atol=1e-5, rtol=0)
    for b, n in enumerate(len(p) for p in prompts):
        torch.testing.assert_close(cache.k[:, b, :, :n], own.k[:, b, :, :n], atol=1e-5, rtol=0)


def test_memory_measure_sees_a_tensor_and_footprint_matches_the_caches(fitted):
    source, target, mapper, _ = fitted
    if memory_kind("cpu").startswith("not measured"):
        pytest.skip("no /proc/self/clear_refs")
    with measure() as held:
        x = torch.ones(48 * 2**20 // 4)  # 48 MiB, touched
    with measure() as idle:
        torch.empty(48 * 2**20 // 4)  # never touched: costs no memory
    assert held.mib >= 44 and idle.mib < 24
    del x
    T, batch = 30, 2
    sizes = footprint(source, target, mapper, T, batch)
    assert sizes["source_cache_mib"] * MIB == nbytes(*(lambda c: (c.k, c.v))(source.new_cache(batch, T)))
    assert sizes["target_cache_mib"] * MIB == nbytes(*(lambda c: (c.k, c.v))(target.new_cache(batch, T)))
    f = mapper.sides["k"]
    per_side = (f.weight.numel() + f.bias.numel() + f.mean.numel() + f.basis.numel()) * 4
    assert sizes["map_mib"] * MIB == 2 * per_side  # float32 map, float32 target: no cast copies
    assert "2·4·B·(T+1)·48" in formula(source, target, mapper)  # tiny target: 4 layers, rows 2 x 24 wide


def test_bench_handoff_writes_its_summary(fitted, pair_dir, tmp_path, capsys):
    from rarecache.cli import main

    _, _, mapper, _ = fitted
    mapper.save(tmp_path / "m.safetensors")
    out = tmp_path / "artifacts" / "summary.json"
    assert main(["bench", "handoff", "--source", str(pair_dir / "src"), "--target", str(pair_dir / "tgt"), "--map",
                 str(tmp_path / "m.safetensors"), "--lengths", "32", "--rhos", "0.1", "0.3", "--batches", "1",
                 "--repeats", "1", "--dtype", "float32", "--map-dtype", "bfloat16", "--summary", str(out)]) == 0
    seen = capsys.readouterr()
    printed = json.loads(seen.out.strip().splitlines()[-1])
    got = json.loads(out.read_text())
    assert [(r["T"], r["rho"]) for r in got["rows"]] == [(32, 0.1), (32, 0.3)]
    rounds = [line.strip() for line in seen.err.splitlines() if ", round " in line]  # progress: a line per round
    assert [r.split(":")[0] for r in rounds] == [f"T 32 rho {rho} B 1, round {i}/1{' (warm-up)' if not i else ''}"
                                                 for rho in (0.1, 0.3) for i in (0, 1)]
    assert all(re.search(r"prefill \d+\.\d\d s \(\d+ tok/s\), handoff \d+\.\d\d s$", r) for r in rounds), rounds
    for row, full in zip(got["rows"], printed["rows"]):
        assert set(row) == set(SUMMARY_KEYS) and all(row[k] == full[k] for k in row)
        assert row["of_sparse_ceiling"] > 0 and 0 < row["map_score_share_of_prefill"]
        if row["peak_mem_handoff_mib"] is not None:  # it holds the source cache and the map besides its own peak
            assert row["peak_mem_handoff_mib"] >= full["source_cache_mib"] + full["map_mib"]
    assert got["dtype"] == "float32" and got["map_dtype"] == "bfloat16" and got["memory"] == printed["memory"]


def test_summary_keeps_earlier_cells_of_the_same_setup():
    """A table run in parts: cells another run of the same setup measured stay, this run's replace theirs,
    another setup's file is replaced whole."""
    from rarecache.bench.handoffbench import summary

    def cell(T, rho, share):
        return {"T": T, "rho": rho, "batch": 1, "of_sparse_ceiling": share, "map_score_share_of_prefill": 0.01,
                "peak_mem_handoff_mib": 1.0, "peak_mem_prefill_mib": 2.0}

    head = {"pair": "a -> b", "dtype": "float32", "threads": 2}
    first = summary([cell(512, 0.1, 0.7), cell(512, 0.3, 0.9)], None, **head)
    second = summary([cell(4096, 0.1, 0.8), cell(512, 0.3, 0.95)], first, **head)
    assert [(c["T"], c["rho"], c["of_sparse_ceiling"]) for c in second["rows"]] == [
        (512, 0.1, 0.7), (512, 0.3, 0.95), (4096, 0.1, 0.8)]
    other = summary([cell(4096, 0.1, 0.8)], first, **{**head, "threads": 1})
    assert [(c["T"], c["rho"]) for c in other["rows"]] == [(4096, 0.1)]
    broken = summary([cell(4096, 0.1, 0.8)], {**head, "rows": [{"T": 1}]}, **head)  # a malformed cell is dropped
    assert [(c["T"], c["rho"]) for c in broken["rows"]] == [(4096, 0.1)]


def test_bench_handoff_times_the_selector_it_names_and_refuses_bad_ones(fitted, pair_dir, tmp_path, capsys,
                                                                          monkeypatch):
    """--selector reaches the handoff it times (the recorded header says which), and a wrong selector or a GPU
    this machine lacks is a clear error, not a traceback."""
    import rarecache.bench.handoffbench as bench_handoff
    from rarecache.cli import main

    _, _, mapper, _ = fitted
    mapper.save(tmp_path / "m.safetensors")
    pair = ["--source", str(pair_dir / "src"), "--target", str(pair_dir / "tgt"),
            "--map", str(tmp_path / "m.safetensors")]
    seen = []
    real = bench_handoff.handoff
    monkeypatch.setattr(bench_handoff, "handoff", lambda *a, **kw: seen.append(a[4].selector) or real(*a, **kw))
    out = tmp_path / "summary.json"
    assert main(["bench", "handoff", *pair, "--lengths", "24", "--rhos", "0.3", "--batches", "1", "--repeats", "1",
                 "--dtype", "float32", "--selector", "suffix", "--summary", str(out)]) == 0
    assert seen and set(seen) == {"suffix"}
    assert json.loads(out.read_text())["selector"] == "suffix"
    capsys.readouterr()
    assert main(["bench", "handoff", *pair, "--selector", "newest", "--no-summary"]) == 2
    assert "unknown selector 'newest'" in capsys.readouterr().err
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    for bench in ("handoff", "ablate"):
        assert main(["bench", bench, *pair, "--device", "cuda"]) == 2
        assert "no CUDA GPU" in capsys.readouterr().err


@pytest.mark.parametrize("selector", ["query", "query-refine"])
def test_bench_handoff_reports_both_passes_of_a_two_pass_selector(fitted, pair_dir, tmp_path, capsys, selector):
    """--selector query: the recompute phase is both passes, each also reported; the handoff's time counts both
    (and a refining variant's refining pass)."""
    from rarecache.cli import main

    _, _, mapper, _ = fitted
    mapper.save(tmp_path / "m.safetensors")
    assert main(["bench", "handoff", "--source", str(pair_dir / "src"), "--target", str(pair_dir / "tgt"), "--map",
                 str(tmp_path / "m.safetensors"), "--lengths", "48", "--rhos", "0.5", "1.0", "--batches", "2",
                 "--repeats", "1", "--dtype", "float32", "--selector", selector, "--no-summary"]) == 0
    out = capsys.readouterr().out
    row, whole = json.loads(out.strip().splitlines()[-1])["rows"]
    refined = row.get("refine_ms", 0.0)
    assert row["pass1_ms"] > 0 and row["pass2_ms"] > 0 and (refined > 0) == (selector == "query-refine")
    assert abs(row["recompute_ms"] - (row["pass1_ms"] + refined + row["pass2_ms"])) < 1e-6
    assert whole["rho"] == 1.0 and whole["pass1_ms"] == whole.get("refine_ms", 0.0) == 0.0  # one pass: the prefill
    assert abs(row["handoff_ms"] - (row["map_ms"] + row["score_ms"] + row["recompute_ms"])) < 1e-6
    assert "recompute = pass 1" in out and ("+ refining pass" in out) == (selector == "query-refine")


@pytest.mark.parametrize("selector", ["attn-source", "attn-source-span"])
def test_bench_handoff_times_a_selector_reading_the_source_attention(fitted, pair_dir, tmp_path, selector,
                                                                     monkeypatch):
    """The source's uncounted prefill captures the attention a source-attention selector reads, and the timed
    handoff is handed it (it used to stop: 'attn-source needs the source to prefill ...'); its picks equal a
    handoff that prefills the source itself."""
    import rarecache.bench.handoffbench as bench_handoff
    from rarecache.transfer.handoff import HandoffConfig, handoff

    source, target, mapper, _ = fitted
    seen = []
    real = bench_handoff.handoff
    monkeypatch.setattr(bench_handoff, "handoff", lambda *a, **kw: seen.append(real(*a, **kw)) or seen[-1])
    cell = bench_handoff.time_cell(source, target, mapper, 40, 0.3, 1, 1, selector=selector)
    assert len(cell.prefill) == 1 and cell.phases["recompute"][0] > 0
    prompts = torch.randint(0, min(source.config.vocab_size, target.config.vocab_size), (1, 40),
                            generator=torch.Generator().manual_seed(0)).tolist()
    _, _, direct = handoff(source, target, mapper, prompts, HandoffConfig(0.3, selector))
    assert seen[-1][2].positions == direct.positions
