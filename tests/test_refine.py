"""Output-aware refinement (transfer/refine.py) on the tiny pair: its differentiable pieces against the
serving path (the suffix pass over the target's own rows is its prefill; the mapped rows are what the map
writes; the suffix pass over mapped rows is a handoff with the suffix selector), that steps lower held-out
KL, the file round trip and the refusals."""

from __future__ import annotations

import json
import random
from dataclasses import replace

import pytest
import torch

from rarecache.cli import main
from rarecache.engine.runner import Runner, pad_batch
from rarecache.errors import RarecacheError
from rarecache.models.tokenizer import Tokenizer
from rarecache.transfer.calibrate import Calibration, CalibrationConfig
from rarecache.transfer.corpus import load_corpus
from rarecache.transfer.handoff import HandoffConfig, budget, handoff
from rarecache.transfer.mapper import SIDES, Mapper
from rarecache.transfer.refine import (Cut, Delta, Example, RefineConfig, cuts, kl, layer_inputs, mapped_rows, refine,
                                      suffix_logits)

BASE = CalibrationConfig(tokens=600, heldout_tokens=0, seq_len=48, k=2, rank=4)


@pytest.fixture(scope="module")
def setup(pair_dir, tmp_path_factory):
    """(source, target unpacked, tokenizer, corpus, {"plain": map, "tokens": token-input map with exact layer 0})."""
    source, target = Runner.load(pair_dir / "src"), Runner.load(pair_dir / "tgt", pack=False)
    tok, corpus = Tokenizer.from_dir(pair_dir / "src"), load_corpus(str(pair_dir / "corpus.txt"))
    root = tmp_path_factory.mktemp("refine")
    maps = {"plain": Calibration(source, target, tok, corpus, BASE, root / "p").run(progress=False),
            "tokens": Calibration(source, target, tok, corpus, replace(BASE, token_inputs=True, exact_layer0=True),
                                  root / "t").run(progress=False)}
    return source, target, tok, corpus, maps


def _ids(tok, corpus, n=40):
    return tok.encode(corpus.documents[-1])[:n]


def test_suffix_pass_over_own_rows_is_the_prefill(setup):
    """suffix_logits after the target's own rows of the first P positions equals its prefill's logits at
    the last n positions (so the teacher is the target itself)."""
    _, target, tok, corpus, _ = setup
    ids = _ids(tok, corpus)
    P = 29
    toks, pos = pad_batch([ids], target.device)
    want = target.forward(toks, pos, target.new_cache(1, len(ids)), logits_at="all").logits[0, P:]
    cache, _ = target.prefill([ids[:P]])
    past = [cache.layer(i, P) for i in range(target.num_layers)]
    got = suffix_logits(target, toks[:, P:], pos[:, P:], [k for k, _ in past], [v for _, v in past])[0]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", ["plain", "tokens"])
def test_mapped_rows_are_what_the_map_writes(setup, kind):
    """Without a change, mapped_rows equals the rows Mapper.apply_reference writes into a target cache (keys
    rotated, exact layer 0 included); a Delta at zero is the map itself."""
    source, target, tok, corpus, maps = setup
    m = maps[kind]
    ids = _ids(tok, corpus, 31)
    toks, pos = pad_batch([ids], target.device)
    s_cache, _ = source.prefill([ids])
    cache = target.new_cache(1, len(ids))
    m.apply_reference(source, s_cache, target, cache, pos, tokens=toks)
    from rarecache.transfer.features import rows, token_rows
    x = {s: rows(source, s_cache, pos, s) for s in SIDES}
    own = token_rows(target, toks) if m.needs_tokens else None
    for delta in (None, Delta(m, layer_inputs(m, x, own))):
        k, v = mapped_rows(m, delta, x, own, target, pos)
        for i in range(target.num_layers):
            ck, cv = cache.layer(i, len(ids))
            torch.testing.assert_close(k[i], ck, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(v[i], cv, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["plain", "tokens"])
@pytest.mark.parametrize("rho", [0.1, 0.3])
def test_the_objective_is_a_suffix_handoff(setup, kind, rho):
    """The student's last-position logits equal a served handoff's with the suffix selector at the same ρ."""
    source, target, tok, corpus, maps = setup
    m = maps[kind]
    ids = _ids(tok, corpus)
    ex = Example(Cut(tuple(ids), budget(rho, len(ids))), source, target, m)
    k, v = mapped_rows(m, None, ex.x, ex.own, target, ex.prefix)
    got = suffix_logits(target, ex.tokens, ex.suffix, k, v)[0, -1]
    _, want, rec = handoff(source, target, m, [ids], HandoffConfig(rho, "suffix"))
    assert rec.positions[0] == list(range(len(ids) - ex.n, len(ids)))
    torch.testing.assert_close(got, want[0], atol=1e-4, rtol=1e-4)
    # and the teacher is the target alone: KL of the target against itself is zero
    assert kl(ex.teacher, ex.teacher).item() == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("kind", ["plain", "tokens"])
def test_steps_lower_the_objective(setup, pair_dir, kind):
    """Adam steps on one example's loss lower it (the gradient reaches the map through the target's layers).
    The tiny target's final norm is scaled up so its next-token distribution is peaked enough to move."""
    source, _, tok, corpus, maps = setup
    m = maps[kind]
    target = Runner.load(pair_dir / "tgt", pack=False)
    target.model.requires_grad_(False)
    with torch.no_grad():
        target.model.model.norm.weight.mul_(30)
    ex = Example(Cut(tuple(_ids(tok, corpus)), 8), source, target, m)
    delta = Delta(m, layer_inputs(m, ex.x, ex.own))
    opt = torch.optim.Adam(delta.parameters(), lr=1e-3)
    losses = []
    for _ in range(8):
        loss = ex.loss(m, delta, target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] > 0 and all(b < a for a, b in zip(losses, losses[1:])) and losses[-1] < 0.8 * losses[0]
    # the folded weight and bias give the rows the training pass saw
    fitted = Mapper(m.info, delta.fitted(m))
    k1, v1 = mapped_rows(m, delta, ex.x, ex.own, target, ex.prefix)
    k2, v2 = mapped_rows(fitted, None, ex.x, ex.own, target, ex.prefix)
    for a, b in zip(k1 + v1, k2 + v2):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", ["plain", "tokens"])
def test_refinement_keeps_its_best_check_and_round_trips(setup, kind, tmp_path):
    source, target, tok, corpus, maps = setup
    m = maps[kind]
    cfg = RefineConfig(steps=12, lr=1e-3, heldout=3, every=4, seq_len=48, min_len=16)
    out, rec = refine(m, source, target, tok, corpus, cfg, progress=False, log=lambda _: None)
    assert [c["step"] for c in rec["checks"]] == [0, 4, 8, 12]
    best = min(rec["checks"], key=lambda c: c["heldout_kl"])
    assert (rec["kept_step"], rec["heldout_kl"]) == (best["step"], best["heldout_kl"])
    assert rec["heldout_kl_before"] == rec["checks"][0]["heldout_kl"]
    assert rec["heldout_documents"][0] >= rec["documents"][1] > rec["documents"][0]  # held out after training
    assert torch.equal(out.sides["k"].weight, m.sides["k"].weight) == (rec["kept_step"] == 0)
    for s in SIDES:  # the form is unchanged: same shapes, same source layers, same rank basis
        assert out.sides[s].weight.shape == m.sides[s].weight.shape
        assert torch.equal(out.sides[s].sources, m.sides[s].sources)
        assert torch.equal(out.sides[s].basis, m.sides[s].basis)
    out.save(tmp_path / "r.safetensors")
    back = Mapper.load(tmp_path / "r.safetensors")
    assert back.info.refined["heldout_kl"] == rec["heldout_kl"]
    torch.testing.assert_close(back.sides["v"].bias.double(), out.sides["v"].bias.double())  # (files hold float32)
    # the held-out KL the record claims is the written map's, recomputed from the same held-out cuts
    rng = random.Random(cfg.seed)
    _, after = cuts(corpus, tok, cfg, cfg.steps, cfg.first_document, rng)
    kept, _ = cuts(corpus, tok, cfg, cfg.heldout, after, rng)
    exs = [Example(c, source, target, back) for c in kept]
    again = sum(e.loss(back, None, target).item() for e in exs) / len(exs)
    assert again == pytest.approx(rec["heldout_kl"], rel=1e-3, abs=1e-7)


def test_unrefined_maps_keep_their_bytes(setup, tmp_path):
    """A map without the record writes no `refined` key (older files stay byte-identical)."""
    *_, maps = setup
    maps["plain"].save(tmp_path / "m.safetensors")
    from safetensors import safe_open
    with safe_open(str(tmp_path / "m.safetensors"), "pt") as f:
        assert "refined" not in json.loads(f.metadata()["rarecache.map"])


def test_refusals(setup, pair_dir):
    source, _, tok, corpus, maps = setup
    packed = Runner.load(pair_dir / "tgt", pack=True) if Runner.load(pair_dir / "tgt").packed else None
    if packed is not None:
        with pytest.raises(RarecacheError, match="unpacked"):
            refine(maps["plain"], source, packed, tok, corpus, RefineConfig(steps=1, heldout=1), progress=False)
    for bad in (dict(steps=0), dict(lr=0.0), dict(rhos=(0.0,)), dict(rhos=()), dict(min_len=1), dict(heldout=0)):
        with pytest.raises(RarecacheError):
            RefineConfig(**bad)
    with pytest.raises(RarecacheError, match="has 0 sequences"):
        cuts(corpus, tok, RefineConfig(seq_len=48, min_len=16), 3, 10_000, random.Random(0))


def test_cli(setup, pair_dir, tmp_path, capsys):
    *_, maps = setup
    maps["plain"].save(tmp_path / "m.safetensors")
    common = ["--source", str(pair_dir / "src"), "--target", str(pair_dir / "tgt"), "--corpus",
              str(pair_dir / "corpus.txt"), "--seq-len", "48", "--heldout", "1", "--every", "2"]
    assert main(["refine", str(tmp_path / "m.safetensors"), *common, "--steps", "1", "--lr", "0.001",
                 "--out", str(tmp_path / "r.safetensors")]) == 0
    out = capsys.readouterr().out
    assert "held-out KL" in out and Mapper.load(tmp_path / "r.safetensors").info.refined["steps"] == 1
    # a user mistake is one line, not a traceback
    assert main(["refine", str(tmp_path / "m.safetensors"), *common, "--steps", "0", "--out",
                 str(tmp_path / "x.safetensors")]) != 0
    assert "steps >= 1" in capsys.readouterr().err
    (tmp_path / "other.txt").write_text("the lazy dog\n\n\nthe quick fox " * 40)
    other = [a if a != str(pair_dir / "corpus.txt") else str(tmp_path / "other.txt") for a in common]
    assert main(["refine", str(tmp_path / "m.safetensors"), *other, "--steps", "2", "--out",
                 str(tmp_path / "y.safetensors")]) != 0
    assert "calibration text" in capsys.readouterr().err


def test_an_interrupted_run_resumes_to_the_same_map(setup, tmp_path):
    """A run stopped after its first check and resumed from its state ends where an uninterrupted run ends."""
    source, target, tok, corpus, maps = setup
    m = maps["plain"]
    cfg = RefineConfig(steps=8, lr=1e-3, heldout=2, every=4, seq_len=48, min_len=16)
    whole, rec = refine(m, source, target, tok, corpus, cfg, progress=False, log=lambda _: None)
    state = tmp_path / "s"

    class Stop(Exception):
        pass

    def stop_after_first_check(line):
        if line.startswith("step 4"):
            raise Stop
    with pytest.raises(Stop):
        refine(m, source, target, tok, corpus, cfg, progress=False, log=stop_after_first_check, state=state)
    assert state.exists()
    lines = []
    again, rec2 = refine(m, source, target, tok, corpus, cfg, progress=False, log=lines.append, state=state)
    assert any("resumed" in line for line in lines)
    assert [c["step"] for c in rec2["checks"]] == [0, 4, 8]
    assert rec2["heldout_kl"] == pytest.approx(rec["heldout_kl"], rel=1e-5)
    for s in SIDES:
        torch.testing.assert_close(again.sides[s].weight, whole.sides[s].weight, atol=1e-6, rtol=1e-5)
    # a state of other settings is refused, not silently mixed in
    with pytest.raises(RarecacheError, match="other settings"):
        refine(m, source, target, tok, corpus, replace(cfg, lr=0.01), progress=False, log=lambda _: None, state=state)
