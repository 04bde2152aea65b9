"""Output-aware refinement (transfer/fitting/refine.py) on the tiny pair: its differentiable pieces against the
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
from rarecache.models.packed import pack_float32
from rarecache.errors import RarecacheError
from rarecache.models.tokenizer import Tokenizer
from rarecache.transfer.fitting.calibrate import Calibration, CalibrationConfig
from rarecache.transfer.fitting.refit import resharpen
from rarecache.transfer.fitting.corpus import load_corpus, token_sequences
from rarecache.transfer.handoff import HandoffConfig, budget, handoff
from rarecache.transfer.mapper import SIDES, Mapper
from rarecache.transfer.fitting.refine import (Cut, Delta, Example, RefineConfig, cuts, kl, layer_inputs, mapped_rows,
                                               refine, suffix_logits)

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
    # every suffix position, not only the last, is the target's pass over the handed-off cache
    toks, pos = pad_batch([ids], target.device)
    s_cache, _ = source.prefill([ids])
    cache = target.new_cache(1, len(ids))
    m.apply_reference(source, s_cache, target, cache, pos, tokens=toks)
    ref = target.forward(toks[:, -ex.n:], pos[:, -ex.n:], cache, logits_at="all").logits[0]
    torch.testing.assert_close(suffix_logits(target, ex.tokens, ex.suffix, k, v)[0], ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", ["plain", "tokens"])
def test_steps_lower_the_objective(setup, pair_dir, kind, tmp_path):
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
    fitted.save(tmp_path / "f.safetensors")
    k1, v1 = mapped_rows(m, delta, ex.x, ex.own, target, ex.prefix)
    for mm in (fitted, Mapper.load(tmp_path / "f.safetensors")):
        k2, v2 = mapped_rows(mm, None, ex.x, ex.own, target, ex.prefix)
        for a, b in zip(k1 + v1, k2 + v2):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    # the mean prediction (what rank disagreement centres on) moved with the change, over the measured inputs
    for s in SIDES:
        y = torch.stack([xl @ fitted.sides[s].weight[l].float() + fitted.sides[s].bias[l].float()
                         for l, xl in enumerate(layer_inputs(m, ex.x, ex.own)[s])]).mean(1)  # (Lt, dt)
        y0 = torch.stack([xl @ m.sides[s].weight[l].float() + m.sides[s].bias[l].float()
                          for l, xl in enumerate(layer_inputs(m, ex.x, ex.own)[s])]).mean(1)
        torch.testing.assert_close((fitted.sides[s].mean - m.sides[s].mean).float(), y - y0, atol=1e-4, rtol=1e-3)


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
    seqs = {tuple(ids): doc for doc, ids in token_sequences(corpus, tok, cfg.seq_len)}
    doc_of = lambda c: next(d for full, d in seqs.items() if full[: len(c.ids)] == c.ids)  # noqa: E731
    rng = random.Random(cfg.seed)
    train, after = cuts(corpus, tok, cfg, cfg.steps, cfg.first_document, rng)
    held, _ = cuts(corpus, tok, cfg, cfg.heldout, after, rng)
    assert max(map(doc_of, train)) < rec["documents"][1] == after <= min(map(doc_of, held))
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
    exs = [Example(c, source, target, back) for c in held]
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
    if pack_float32(torch.float32, "cpu"):
        packed = Runner.load(pair_dir / "tgt", pack=True)
        assert packed.packed
        with pytest.raises(RarecacheError, match="unpacked"):
            refine(maps["plain"], source, packed, tok, corpus, RefineConfig(steps=1, heldout=1), progress=False)
    refined = Mapper(replace(maps["plain"].info, refined={"steps": 1}), maps["plain"].sides)
    with pytest.raises(RarecacheError, match="already refined"):
        refine(refined, source, setup[1], tok, corpus, RefineConfig(steps=1, heldout=1), progress=False)
    # what changes the weights again drops the record: it would no longer describe them
    assert resharpen(refined, (0.5, 0.5)).info.refined is None
    for bad in (dict(lr=float("inf")), dict(lr=float("nan"))):
        with pytest.raises(RarecacheError):
            RefineConfig(**bad)
    for bad in (dict(steps=0), dict(lr=0.0), dict(rhos=(0.0,)), dict(rhos=()), dict(min_len=1), dict(heldout=0)):
        with pytest.raises(RarecacheError):
            RefineConfig(**bad)
    with pytest.raises(RarecacheError, match="has 0 sequences"):
        cuts(corpus, tok, RefineConfig(seq_len=48, min_len=16), 3, 10_000, random.Random(0))


def test_cli_defaults_are_the_library_s():
    import argparse
    from rarecache.commands.train import REFINE_LR, _add_refine
    from rarecache.transfer.fitting.refine import WEIGHTINGS
    assert REFINE_LR == RefineConfig().lr
    sub = argparse.ArgumentParser().add_subparsers()
    _add_refine(sub)
    weighting = next(a for a in sub.choices["refine"]._actions if a.dest == "weighting")
    assert tuple(weighting.choices) == WEIGHTINGS and weighting.default == RefineConfig().weighting
    temperature = next(a for a in sub.choices["refine"]._actions if a.dest == "temperature")
    assert temperature.default == RefineConfig().temperature == 1.0


def test_a_sharpened_kl_pays_for_a_flipped_argmax(setup):
    """Temperature scales both distributions before the KL: over a flat teacher a flipped argmax costs far
    more sharpened than at 1, a student equal to the teacher still costs nothing, and an Example's loss at
    a temperature is the KL of its logits divided by it."""
    from rarecache.transfer.fitting.refine import kl_each
    teacher = torch.tensor([[[0.3, 0.0, -4.0, -4.0]]])  # a 0.3-nat margin between the top two
    flipped = torch.tensor([[[0.0, 0.3, -4.0, -4.0]]])
    at1, sharp = float(kl(teacher, flipped)), float(kl(teacher, flipped, temperature=0.25))
    assert at1 < 0.05 and sharp > 5 * at1
    assert float(kl(teacher, teacher, temperature=0.25)) < 1e-7
    source, target, tok, corpus, maps = setup
    m = maps["plain"]
    ids = _ids(tok, corpus)
    e = Example(Cut(tuple(ids), 8), source, target, m, "uniform", temperature=0.5)
    k, v = mapped_rows(m, None, e.x, e.own, target, e.prefix)
    student = suffix_logits(target, e.tokens, e.suffix, k, v)
    torch.testing.assert_close(e.loss(m, None, target), kl_each(e.teacher / 0.5, student / 0.5).mean())
    for bad in (0.0, -1.0, 1.5, float("nan")):
        with pytest.raises(RarecacheError, match="temperature"):
            RefineConfig(temperature=bad)


def test_context_weights_read_beyond_the_local_window(setup):
    """Under weighting="context" a position weighs KL(target's own ‖ target seeing only the last LOCAL tokens
    before the suffix): nothing when the prefix fits in that window, and the loss is the weighted mean."""
    from rarecache.transfer.fitting.refine import LOCAL, kl_each
    source, target, tok, corpus, maps = setup
    m = maps["plain"]
    ids = _ids(tok, corpus)
    long = Example(Cut(tuple(ids), 8), source, target, m, "context")
    P = len(ids) - 8
    assert P > LOCAL and long.weight.shape == (1, 8) and bool((long.weight >= 0).all())
    cache, _ = target.prefill([ids[:P]])
    past = [cache.layer(i, P) for i in range(target.num_layers)]
    near = suffix_logits(target, long.tokens, long.suffix, [k[:, :, P - LOCAL:] for k, _ in past],
                         [v[:, :, P - LOCAL:] for _, v in past])
    torch.testing.assert_close(long.weight, kl_each(long.teacher, near))
    assert float(long.weight.sum()) > 0
    short = Example(Cut(tuple(ids[: LOCAL + 4]), 4), source, target, m, "context")
    assert float(short.weight.abs().max()) < 1e-6  # the whole prefix is in the window
    k, v = mapped_rows(m, None, long.x, long.own, target, long.prefix)
    each = kl_each(long.teacher, suffix_logits(target, long.tokens, long.suffix, k, v))
    torch.testing.assert_close(long.loss(m, None, target), (each * long.weight).sum() / long.weight.sum())
    with pytest.raises(RarecacheError, match="unknown weighting"):
        RefineConfig(weighting="x")


def test_cli(setup, pair_dir, tmp_path, capsys):
    *_, maps = setup
    maps["plain"].save(tmp_path / "m.safetensors")
    common = ["--source", str(pair_dir / "src"), "--target", str(pair_dir / "tgt"), "--corpus",
              str(pair_dir / "corpus.txt"), "--seq-len", "48", "--heldout", "1", "--every", "2"]
    assert main(["refine", str(tmp_path / "m.safetensors"), *common, "--steps", "1", "--lr", "0.001",
                 "--out", str(tmp_path / "new" / "r.safetensors")]) == 0  # (a folder that does not exist yet)
    out = capsys.readouterr().out
    assert "held-out KL" in out and not (tmp_path / "new" / "r.safetensors.refine-state").exists() and Mapper.load(tmp_path / "new" / "r.safetensors").info.refined["steps"] == 1
    # a user mistake is one line, not a traceback
    assert main(["refine", str(tmp_path / "m.safetensors"), *common, "--steps", "0", "--out",
                 str(tmp_path / "x.safetensors")]) != 0
    assert "steps >= 1" in capsys.readouterr().err
    assert main(["refine", str(tmp_path / "m.safetensors"), *common, "--rhos", "0.2", "1.5", "--out",
                 str(tmp_path / "x.safetensors")]) != 0
    assert "--rhos must lie strictly between 0 and 1, got 0.2 1.5" in capsys.readouterr().err
    (tmp_path / "other.txt").write_text("the lazy dog\n\n\nthe quick fox " * 40)
    other = [a if a != str(pair_dir / "corpus.txt") else str(tmp_path / "other.txt") for a in common]
    assert main(["refine", str(tmp_path / "m.safetensors"), *other, "--steps", "2", "--out",
                 str(tmp_path / "y.safetensors")]) != 0
    assert "calibration text" in capsys.readouterr().err


@pytest.fixture(scope="module")
def peaked(pair_dir):
    """The tiny target, unpacked, its final norm scaled so its next-token distribution is peaked enough for
    steps to move the held-out KL (the K/V rows, what the maps predict, are unchanged)."""
    target = Runner.load(pair_dir / "tgt", pack=False)
    with torch.no_grad():
        target.model.model.norm.weight.mul_(30)
    return target


def _interrupted(m, source, target, tok, corpus, cfg, state):
    class Stop(Exception):
        pass

    def stop_after_first_check(line):
        if line.startswith(f"step {cfg.every}:"):
            raise Stop
    with pytest.raises(Stop):
        refine(m, source, target, tok, corpus, cfg, progress=False, log=stop_after_first_check, state=state)
    assert state.exists()


def test_an_interrupted_run_resumes_to_the_same_map(setup, peaked, tmp_path):
    """A run stopped after its first check and resumed from its state makes the same checks (the held-out KL
    after the resumed steps reads Adam's restored moments) and the same map as an uninterrupted run."""
    source, _, tok, corpus, maps = setup
    m = maps["plain"]
    cfg = RefineConfig(steps=8, lr=1e-3, heldout=2, every=4, seq_len=48, min_len=16)
    whole, rec = refine(m, source, peaked, tok, corpus, cfg, progress=False, log=lambda _: None)
    state = tmp_path / "s"
    _interrupted(m, source, peaked, tok, corpus, cfg, state)
    lines = []
    again, rec2 = refine(m, source, peaked, tok, corpus, cfg, progress=False, log=lines.append, state=state)
    assert any("resumed" in line for line in lines)
    assert [c["step"] for c in rec2["checks"]] == [0, 4, 8]
    for c1, c2 in zip(rec["checks"], rec2["checks"]):
        assert c2["heldout_kl"] == pytest.approx(c1["heldout_kl"], rel=1e-6)
    assert len({c["heldout_kl"] for c in rec["checks"]}) == 3  # (the steps moved the map: the checks differ)
    for s in SIDES:
        torch.testing.assert_close(again.sides[s].weight, whole.sides[s].weight, atol=1e-6, rtol=1e-5)
    # a state of other settings is refused, not silently mixed in
    with pytest.raises(RarecacheError, match="other settings"):
        refine(m, source, peaked, tok, corpus, replace(cfg, lr=1e-4), progress=False, log=lambda _: None,
               state=state)


def _edit_state(path, tensors=None, meta=None, keep_sum=False):
    from safetensors import safe_open
    from safetensors.torch import save_file
    with safe_open(str(path), "pt") as f:
        header, t = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    m = json.loads(header["refine"])
    (tensors or (lambda t: None))(t)
    (meta or (lambda m: None))(m)
    from rarecache.transfer.mapfile import tensors_sha256
    save_file(t, str(path), metadata={"refine": json.dumps(m),
                                      "sha256": header["sha256"] if keep_sum else tensors_sha256(t)})


@pytest.mark.parametrize("damage", ["flipped", "shape", "nan", "missing", "step", "best", "checks", "text"])
def test_a_damaged_state_is_refused(setup, peaked, tmp_path, damage):
    """The state file is untrusted input: each damage is one clear error, never a traceback or a wrong record."""
    source, _, tok, corpus, maps = setup
    m = maps["plain"]
    cfg = RefineConfig(steps=8, lr=1e-3, heldout=2, every=4, seq_len=48, min_len=16)
    state = tmp_path / "s"
    _interrupted(m, source, peaked, tok, corpus, cfg, state)

    def nan(t):
        t["delta.k_w"][0, 0, 0] = float("nan")

    edits = {
        "flipped": dict(tensors=lambda t: t["best.v_b"].add_(1.0), keep_sum=True),
        "shape": dict(tensors=lambda t: t.update({"delta.k_w": t["delta.k_w"][0].contiguous()})),
        "nan": dict(tensors=nan),
        "missing": dict(tensors=lambda t: t.pop("adam.v_b.exp_avg")),
        "step": dict(meta=lambda mm: mm.update(step=99, adam_step=99)),
        "best": dict(meta=lambda mm: mm.update(best=[0.0, 4])),
        "checks": dict(meta=lambda mm: mm.update(checks=["x"])),
    }
    if damage == "text":
        state.write_bytes(b"not a state")
    else:
        _edit_state(state, **edits[damage])
    with pytest.raises(RarecacheError, match="refinement state"):
        refine(m, source, peaked, tok, corpus, cfg, progress=False, log=lambda _: None, state=state)


def _prompt_pool(n=6, animal="fox"):
    from rarecache.transfer.fitting.corpus import Corpus
    docs = tuple(f"the quick {animal} {' '.join(['jumps'] * (i % 3))} over the lazy dog" for i in range(n))
    return Corpus("task:quiz", docs, chat=True, ids=tuple(f"quiz-{i}" for i in range(n)))


def test_task_prompts_are_whole_spread_and_recorded(setup, peaked):
    """--prompts: whole prompts (ending where the answer is read) make the asked share of training and held-out
    cuts, spread among the general ones; the record lists exactly the prompts read, and a state is tied to them."""
    from rarecache.transfer.fitting.refine import interleave, prompt_cuts
    source, _, tok, corpus, maps = setup
    pool = _prompt_pool()
    cfg = RefineConfig(steps=6, lr=1e-3, heldout=2, every=3, seq_len=64, min_len=16, prompt_share=0.34)
    whole = [tuple(ids) for _, ids in token_sequences(pool, tok, 10_000)]
    assert max(map(len, whole)) <= cfg.seq_len and len(set(whole)) == 3  # (what the checks below assume)
    got, read = prompt_cuts({"quiz": pool}, tok, cfg, 3, {"quiz": 0}, random.Random(0))
    assert [c.ids for c in got] == whole[:3] and read == {"quiz": 3}
    assert all(1 <= c.n < len(c.ids) for c in got)
    more, read = prompt_cuts({"quiz": pool}, tok, cfg, 2, read, random.Random(0))
    assert [c.ids for c in more] == whole[3:5] and read == {"quiz": 5}
    with pytest.raises(RarecacheError, match="ran out"):
        prompt_cuts({"quiz": pool}, tok, cfg, 2, read, random.Random(0))
    short = replace(cfg, seq_len=min(map(len, whole)) - 1)  # every prompt too long: passed over, never cut short
    with pytest.raises(RarecacheError, match="ran out"):
        prompt_cuts({"quiz": pool}, tok, short, 1, {"quiz": 0}, random.Random(0))
    g = [Cut((i,), 0) for i in range(7)]
    p = [Cut((100 + i,), 0) for i in range(3)]
    mixed = interleave(g, p)
    assert sorted(mixed, key=lambda c: c.ids) == g + p and [c for c in mixed if c.ids[0] < 100] == g
    at = [i for i, c in enumerate(mixed) if c.ids[0] >= 100]
    assert len(at) == 3 and min(b - a for a, b in zip(at, at[1:])) >= 3  # spread, not bunched
    assert interleave(g, []) == g

    out, rec = refine(maps["plain"], source, peaked, tok, corpus, cfg, progress=False, log=lambda _: None,
                      prompts={"quiz": pool})
    # 2 of 6 training steps and max(1 task, round(2 * 0.34 / 0.66)) = 1 held-out cut are prompts: 3 read
    assert rec["prompts"] == {"quiz": {"corpus": "task:quiz", "fingerprint": pool.fingerprint,
                                       "ids": ["quiz-0", "quiz-1", "quiz-2"]}}
    assert rec["prompt_share"] == 0.34 and out.refined_ids() == {"quiz-0", "quiz-1", "quiz-2"}
    with pytest.raises(RarecacheError, match="go together"):
        refine(maps["plain"], source, peaked, tok, corpus, replace(cfg, prompt_share=0.0), progress=False,
               log=lambda _: None, prompts={"quiz": pool})
    with pytest.raises(RarecacheError, match="go together"):
        refine(maps["plain"], source, peaked, tok, corpus, cfg, progress=False, log=lambda _: None)
    for bad in (-0.1, 1.0):
        with pytest.raises(RarecacheError, match="share of task prompts"):
            RefineConfig(prompt_share=bad)


def test_a_state_is_tied_to_its_prompts(setup, peaked, tmp_path):
    source, _, tok, corpus, maps = setup
    cfg = RefineConfig(steps=8, lr=1e-3, heldout=2, every=4, seq_len=64, min_len=16, prompt_share=0.25)
    state = tmp_path / "s"

    class Stop(Exception):
        pass

    def stop(line):
        if line.startswith("step 4:"):
            raise Stop
    with pytest.raises(Stop):
        refine(maps["plain"], source, peaked, tok, corpus, cfg, progress=False, log=stop, state=state,
               prompts={"quiz": _prompt_pool(8)})
    with pytest.raises(RarecacheError, match="other settings"):
        refine(maps["plain"], source, peaked, tok, corpus, cfg, progress=False, log=lambda _: None, state=state,
               prompts={"quiz": _prompt_pool(8, animal="dog")})


def test_an_evaluation_refuses_a_map_refined_on_its_items(setup, tmp_path):
    """The prompts a refinement read count as calibration data: an evaluation on any of them is refused, for a
    registered task (by item id) and for a task file (by prompt hash); a malformed record is refused on loading."""
    from rarecache.eval.tasks.base import Item, Task
    *_, maps = setup
    m = maps["plain"]
    refined = Mapper(replace(m.info, refined={"steps": 1, "prompts": {"quiz": {"ids": ["quiz-1"]}}}), m.sides)
    task = Task()
    task.name = "quiz"
    items = [Item(f"quiz-{i}", ({"role": "user", "content": "q"},), 0) for i in range(3)]
    with pytest.raises(RarecacheError, match="1 evaluated item"):
        task.check_map(refined, items)
    task.check_map(refined, [items[0], items[2]])  # (the others are fine)
    task.check_map(m, items)
    refined.save(tmp_path / "r.safetensors")
    assert Mapper.load(tmp_path / "r.safetensors").refined_ids() == {"quiz-1"}
    from safetensors import safe_open
    from safetensors.torch import save_file
    with safe_open(str(tmp_path / "r.safetensors"), "pt") as f:
        header, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    for bad in ({"quiz": ["quiz-1"]}, {"quiz": {"ids": [1]}}, ["quiz-1"]):
        with pytest.raises(RarecacheError, match="prompts"):  # never written ...
            Mapper(replace(m.info, refined={"steps": 1, "prompts": bad}), m.sides).save(tmp_path / "b.safetensors")
        info = json.loads(header["rarecache.map"])
        info["refined"]["prompts"] = bad
        save_file(tensors, str(tmp_path / "b.safetensors"), metadata={**header, "rarecache.map": json.dumps(info)})
        with pytest.raises(RarecacheError, match="prompts"):  # ... nor read from another writer
            Mapper.load(tmp_path / "b.safetensors")


def test_cli_prompt_refusals(setup, pair_dir, tmp_path, capsys):
    *_, maps = setup
    maps["plain"].save(tmp_path / "m.safetensors")
    common = ["refine", str(tmp_path / "m.safetensors"), "--source", str(pair_dir / "src"), "--target",
              str(pair_dir / "tgt"), "--corpus", str(pair_dir / "corpus.txt"), "--out", str(tmp_path / "x.safetensors")]
    for extra, said in ((["--prompts", "nosuch"], "unknown task(s) nosuch"),
                        (["--prompts", "mmlu", "mmlu"], "names a task twice"),
                        (["--prompts", "mmlu", "--prompt-share", "1"], "--prompt-share must lie strictly")):
        assert main([*common, *extra]) == 2
        err = capsys.readouterr().err
        assert said in err and "Traceback" not in err
