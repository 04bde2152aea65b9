"""Maps that read the tokens (`calibrate --token-inputs`, `--exact-layer0`): the target's own layer-0 rows
of each token as extra input and as layer 0 itself, on the tiny pair. The fused path against the reference,
layer 0 against the target's own prefill, rho = 1 against the target's prefill, the file format (older maps
unchanged, bad metadata refused), resumable calibration, the CLI and the vLLM adapter's row handoff."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from rarecache.cli import main
from rarecache.engine.runner import Runner, pad_batch
from rarecache.errors import RarecacheError
from rarecache.models.tokenizer import Tokenizer
from rarecache.transfer.fitting.calibrate import Calibration, CalibrationConfig
from rarecache.transfer.fitting.refit import refit
from rarecache.transfer.fitting.corpus import load_corpus
from rarecache.transfer.features import token_rows
from rarecache.transfer.handoff import HandoffConfig, handoff, handoff_variants
from rarecache.transfer.mapper import SIDES, Mapper
from rarecache.transfer.selectors import rank_scores

BASE = CalibrationConfig(tokens=600, heldout_tokens=150, seq_len=48, k=2, rank=4, checkpoint_every=1)
KINDS = {"tokens": dict(token_inputs=True), "exact0": dict(exact_layer0=True),
         "both": dict(token_inputs=True, exact_layer0=True)}


@pytest.fixture(scope="module")
def tok_pair(pair_dir, tmp_path_factory):
    """(source, target, tokenizer, corpus, {kind: map}, plain map, two prompts of 37 and 23 tokens)."""
    source, target = Runner.load(pair_dir / "src"), Runner.load(pair_dir / "tgt")
    tok, corpus = Tokenizer.from_dir(pair_dir / "src"), load_corpus(str(pair_dir / "corpus.txt"))
    root = tmp_path_factory.mktemp("tok")
    maps = {kind: Calibration(source, target, tok, corpus, replace(BASE, **kw), root / kind).run(progress=False)
            for kind, kw in KINDS.items()}
    plain = Calibration(source, target, tok, corpus, BASE, root / "plain").run(progress=False)
    prompts = [tok.encode(corpus.documents[-1])[:37], tok.encode(corpus.documents[-2])[:23]]
    return source, target, tok, corpus, maps, plain, prompts


def test_token_inputs_widen_the_fit_and_help_held_out(tok_pair):
    """The token block is K·ds + 2·dt rows of weight; it reads the target's own layer 0, so that layer fits
    (nearly) exactly, held out too; with the same source layers chosen, no layer fits worse in-sample."""
    source, target, _, _, maps, plain, _ = tok_pair
    m = maps["tokens"]
    dt, ds = target.config.kv_dim, source.config.kv_dim
    assert m.sides["k"].weight.shape == (target.num_layers, 2 * ds + 2 * dt, dt) and m.extra_width == 2 * dt
    assert plain.sides["k"].weight.shape[1] == 2 * ds and plain.extra_width == 0
    for s in SIDES:
        assert m.info.r2_heldout[s][0] > 0.98 > plain.info.r2_heldout[s][0]
        assert torch.equal(m.sides[s].sources, plain.sides[s].sources)
        assert bool((m.sides[s].r2 >= plain.sides[s].r2 - 1e-9).all()) and m.sides[s].r2[0] > 0.999
    assert maps["exact0"].sides["k"].weight.shape == plain.sides["k"].weight.shape  # the fit itself is plain
    assert "ridge + token inputs, layer 0 exact, k=2" in maps["both"].summary()
    assert m.needs_tokens and maps["exact0"].needs_tokens and not plain.needs_tokens


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fused_map_with_tokens_equals_reference(tok_pair, kind, dtype):
    """One pass per target layer (the token block as one more product, layer 0 written from the tokens)
    equals the plain pipeline: cache, centred rows and rank score, on one run, a padded batch, a span after
    kept rows and scattered positions."""
    source, target, _, _, maps, _, prompts = tok_pair
    mapper = maps[kind]
    src_cache, _ = source.prefill(prompts)  # (2, 37), second row 23 long
    whole = pad_batch(prompts)[0]  # (2, 37)
    cases = [torch.tensor([[*range(37)]]), torch.tensor([[*range(37)], [*range(23)] + [-1] * 14]),
             torch.tensor([[*range(10, 37)], [*range(5, 23)] + [-1] * 9]),
             torch.tensor([[3, 7, 8, 20, 36], [0, 1, 2, 22, -1]])]
    for pos in cases:
        B = pos.shape[0]
        cache = src_cache if B == 2 else src_cache.row(0)
        toks = whole[:B].gather(1, pos.clamp(min=0))  # (B, T)
        fast, slow, scored = (target.new_cache(B, 37) for _ in range(3))
        z = mapper.apply(source, cache, target, fast, pos, dtype=dtype, tokens=toks)
        ref = mapper.apply_reference(source, cache, target, slow, pos, dtype=dtype, tokens=toks)
        rank = mapper.apply_scored(source, cache, target, scored, pos, dtype=dtype, tokens=toks)
        valid = pos >= 0
        for c in (fast, scored):
            torch.testing.assert_close(c.k[:, :, :, :37], slow.k[:, :, :, :37], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(c.v[:, :, :, :37], slow.v[:, :, :, :37], atol=1e-5, rtol=1e-5)
            assert torch.equal(c.filled, slow.filled)
        for s in SIDES:
            torch.testing.assert_close(z[s][:, valid], ref[s][:, valid], atol=1e-5, rtol=1e-5)
        want = rank_scores(mapper, ref)
        torch.testing.assert_close(rank[valid], want[valid], atol=1e-5 * float(want.abs().max()), rtol=1e-4)
    # the tokens matter: other tokens, other rows (a check that could fail if they were ignored)
    pos = cases[0]
    a, b = target.new_cache(1, 37), target.new_cache(1, 37)
    mapper.apply(source, src_cache.row(0), target, a, pos, tokens=whole[:1])
    mapper.apply(source, src_cache.row(0), target, b, pos, tokens=(whole[:1] + 1) % 400)
    assert not torch.allclose(a.k, b.k)
    with pytest.raises(RarecacheError, match="reads the tokens it maps"):
        mapper.apply(source, src_cache.row(0), target, a, pos)


def test_exact_layer0_is_the_targets_own_prefill(tok_pair):
    """Layer 0 of an exact-layer-0 map equals the target's own prefill rows (fused, reference, a span after
    kept rows, and a map computing in bf16 next to float32 models: layer 0 keeps the target's precision);
    the other layers are mapped (not the target's)."""
    source, target, _, _, maps, plain, prompts = tok_pair
    own, _ = target.prefill(prompts)  # (2, 37)
    src_cache, _ = source.prefill(prompts)
    toks, pos = pad_batch(prompts)
    valid = pos >= 0
    for mapper in (maps["exact0"], maps["both"], maps["both"].computing_in(torch.bfloat16)):
        for apply in (mapper.apply, mapper.apply_reference):
            got = target.new_cache(2, 37)
            apply(source, src_cache, target, got, pos, tokens=toks)
            for name in ("k", "v"):
                want, mine = getattr(own, name)[0][:, :, :37], getattr(got, name)[0][:, :, :37]
                for b in range(2):
                    n = int(valid[b].sum())
                    torch.testing.assert_close(mine[b, :, :n], want[b, :, :n], atol=2e-6, rtol=2e-6)
                assert not torch.allclose(getattr(got, name)[1][0, :, :37], getattr(own, name)[1][0, :, :37],
                                          atol=1e-3)
    span = torch.tensor([[*range(10, 37)]])
    got = target.new_cache(1, 37)
    maps["exact0"].apply(source, src_cache.row(0), target, got, span, tokens=toks[:1, 10:])
    torch.testing.assert_close(got.k[0, 0, :, 10:37], own.k[0, 0, :, 10:37], atol=2e-6, rtol=2e-6)
    # the map without the option predicts layer 0
    got = target.new_cache(2, 37)
    plain.apply(source, src_cache, target, got, pos)
    assert not torch.allclose(got.k[0, 0, :, :23], own.k[0, 0, :, :23], atol=1e-3)
    # token_rows are the layer-0 rows of the prefill with RoPE taken off
    rows = token_rows(target, toks[:1])["k"][0].view(37, 2, -1).transpose(0, 1)[None]  # (1, Hkv, T, D)
    torch.testing.assert_close(target.rope.apply(rows, torch.arange(37)[None]), own.k[0, :1, :, :37],
                               atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_handoffs_through_a_token_map(tok_pair, kind, monkeypatch):
    """rho = 1 is the target's own prefill; rho = 0.3 with the fused map equals the reference pipeline; the
    evaluation's variants equal one handoff each."""
    source, target, _, _, maps, _, prompts = tok_pair
    mapper = maps[kind]
    cache, logits, _ = handoff(source, target, mapper, prompts, HandoffConfig(rho=1.0))
    own, out = target.prefill(prompts, max_len=37)
    torch.testing.assert_close(logits, out.logits, atol=1e-5, rtol=1e-5)
    for b, n in enumerate(len(p) for p in prompts):
        torch.testing.assert_close(cache.k[:, b, :, :n], own.k[:, b, :, :n], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(cache.v[:, b, :, :n], own.v[:, b, :, :n], atol=1e-5, rtol=1e-5)
    cfg = HandoffConfig(0.3, "rank")
    fast = handoff(source, target, mapper, prompts, cfg)
    variants = handoff_variants(source, target, {"m": mapper}, prompts[0],
                                [("m", cfg), ("m", HandoffConfig(0.0, "rank"))], source.prefill(prompts[:1])[0])

    def reference(self, source, source_cache, target, target_cache, positions, dtype=None, rank=True, tokens=None):
        centred = self.apply_reference(source, source_cache, target, target_cache, positions, dtype, tokens)
        return rank_scores(self, centred) if rank else None

    monkeypatch.setattr(type(mapper), "apply_scored", reference)
    slow = handoff(source, target, mapper, prompts, cfg)
    assert fast[2].positions == slow[2].positions
    torch.testing.assert_close(fast[1], slow[1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fast[0].k, slow[0].k, atol=1e-5, rtol=1e-5)
    one = handoff(source, target, mapper, prompts[:1], cfg)
    plain = handoff(source, target, mapper, prompts[:1], HandoffConfig(0.0, "rank"))
    assert variants[2][0].positions == one[2].positions
    torch.testing.assert_close(variants[1][0], one[1][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(variants[1][1], plain[1][0], atol=1e-5, rtol=1e-5)


def test_perplexity_and_diagnostics_read_the_tokens(tok_pair):
    """The other paths that map rows pass the tokens: perplexity's mapped arm equals a handoff's plain
    transfer, and the diagnostics see layer 0 exact (attention-output cosine 1 there)."""
    from rarecache.eval.perplexity import passage_nll
    from rarecache.transfer.diagnostics import diagnose

    source, target, _, _, maps, _, prompts = tok_pair
    mapper = maps["both"]
    nll = passage_nll(source, target, mapper, prompts[0], prefix=20)
    assert all(torch.isfinite(torch.tensor(v)) for v in nll.values())
    d = diagnose(source, target, mapper, prompts, rho=0.2)
    assert d.cosine[0] == pytest.approx(1.0, abs=1e-5) and min(d.cosine[1:]) < 0.9999


def test_map_files_with_and_without_the_options(tok_pair, tmp_path):
    """Both options round-trip; a map without them writes neither key (older files stay byte-identical and
    load as before); bad metadata is refused on load and never written."""
    from .test_transfer import _rewrite_meta

    source, target, _, _, maps, plain, _ = tok_pair
    for kind, m in maps.items():
        m.save(tmp_path / f"{kind}.safetensors")
        back = Mapper.load(tmp_path / f"{kind}.safetensors")
        assert back.info == m.info and back.needs_tokens
        back.check_pair(source, target)
    meta = Mapper.load(tmp_path / "both.safetensors").info
    assert meta.token_inputs and meta.exact_layer0
    plain.save(tmp_path / "plain.safetensors")
    raw = (tmp_path / "plain.safetensors").read_bytes()
    assert b"token_inputs" not in raw and b"exact_layer0" not in raw
    old = Mapper.load(tmp_path / "plain.safetensors")
    assert not (old.info.token_inputs or old.info.exact_layer0 or old.needs_tokens)
    old.save(tmp_path / "again.safetensors")
    assert (tmp_path / "again.safetensors").read_bytes() == raw
    header = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])["__metadata__"]["rarecache.map"]
    assert "token_inputs" not in json.loads(header)
    for base, change, why in (("both", {"token_inputs": "yes"}, "must be true or false"),
                              ("both", {"exact_layer0": 1}, "must be true or false"),
                              ("both", {"heads": 2}, "token_inputs needs a dense linear map"),
                              ("both", {"mlp_hidden": 4}, "token_inputs needs a dense linear map"),
                              ("plain", {"token_inputs": True}, "does not fit"),
                              ("both", {"token_inputs": False}, "does not fit|does not have|expected"),
                              ("both", {"token_rows": True}, "unexpected keyword")):
        _rewrite_meta(tmp_path / f"{base}.safetensors", tmp_path / "bad.safetensors", **change)
        with pytest.raises(RarecacheError) as e:
            Mapper.load(tmp_path / "bad.safetensors").check_pair(source, target)
        assert any(w in str(e.value) for w in why.split("|")), (change, str(e.value))
    with pytest.raises(RarecacheError, match="not writing .*invalid"):
        Mapper(replace(maps["both"].info, heads=2), maps["both"].sides).save(tmp_path / "never.safetensors")
    with pytest.raises(RarecacheError, match="takes no residual MLP"):
        maps["tokens"].with_mlp({}, 4)


def test_token_calibration_resumes_refits_and_keeps_older_states(tok_pair, tmp_path):
    """A token-input calibration streams and resumes to the same map; exact layer 0 is chosen after the
    statistics (a state resumes under either); a plain state is refused by a token-input run and the other
    way round; `refit` from its state gives the same map."""
    source, target, tok, corpus, maps, _, _ = tok_pair
    cfg = replace(BASE, token_inputs=True)
    run = Calibration(source, target, tok, corpus, cfg, tmp_path / "t.map")
    assert run.run(progress=False, max_sequences=3) is None
    resumed = Calibration(source, target, tok, corpus, replace(cfg, exact_layer0=True), tmp_path / "t.map"
                          ).run(progress=False)
    for s in SIDES:
        assert torch.equal(resumed.sides[s].weight, maps["both"].sides[s].weight)
    assert resumed.info == maps["both"].info
    again = refit(resumed, tmp_path / "t.map.state")
    assert again.info == resumed.info and torch.equal(again.sides["v"].bias, resumed.sides["v"].bias)
    with pytest.raises(RarecacheError, match="no head-matched refit"):
        refit(resumed, tmp_path / "t.map.state", head_matched=True)
    with pytest.raises(RarecacheError, match="different calibration"):
        Calibration(source, target, tok, corpus, BASE, tmp_path / "t.map").run(progress=False)
    Calibration(source, target, tok, corpus, BASE, tmp_path / "p.map").run(progress=False, max_sequences=1)
    with pytest.raises(RarecacheError, match="different calibration"):
        Calibration(source, target, tok, corpus, cfg, tmp_path / "p.map").run(progress=False)
    plain = Calibration(source, target, tok, corpus, BASE, tmp_path / "p.map").run(progress=False)  # resumes
    with pytest.raises(RarecacheError, match="disagree on token inputs"):
        refit(maps["tokens"], tmp_path / "p.map.state")
    assert not plain.info.token_inputs
    with pytest.raises(RarecacheError, match="token inputs need a dense map"):
        CalibrationConfig(token_inputs=True, head_matched=True)


def test_costs_count_the_token_block_and_the_exact_layer0(tok_pair, tmp_path):
    """transfer/costs.py against what calibration allocates, the fitted maps' weights and the FLOPs the fused
    map runs (torch's counter over its products): the token block widens the statistics and every layer's
    weight by 2·dt, and a map reading the tokens runs the target's layer-0 q/k/v once per token, in place of
    layer 0's product when that layer is exact."""
    from torch.utils.flop_counter import FlopCounterMode

    from rarecache.transfer.costs import F64, PairShape, describe, map_bytes, map_flops, statistics_bytes

    source, target, tok, corpus, maps, plain, prompts = tok_pair
    p = PairShape.of(source.config, target.config)
    for token_inputs in (False, True):
        cal = Calibration(source, target, tok, corpus, replace(BASE, token_inputs=token_inputs), tmp_path / "c")
        held = sum(F64 * sum(t.numel() for t in (s.sx, s.sy, s.syy, s.xx, s.xy)) for s in cal.stats.values())
        assert statistics_bytes(p, heldout=True, token_inputs=token_inputs) == held
    k, rank = BASE.k, BASE.rank
    for kind, m in {**maps, "plain": plain}.items():
        ti = m.info.token_inputs
        weights = sum(m.sides[s].weight.numel() - plain.sides[s].weight.numel() for s in SIDES)
        assert map_bytes(p, k, rank, 4, token_inputs=ti) - map_bytes(p, k, rank, 4) == 4 * weights, kind
        src_cache, _ = source.prefill(prompts[:1])
        n = len(prompts[0])
        pos, toks = torch.arange(n)[None], torch.tensor(prompts[:1])
        with FlopCounterMode(display=False) as count:  # bf16: one product per layer (float32 adds in place)
            m.apply_scored(source, src_cache, target, target.new_cache(1, n), pos, dtype=torch.bfloat16, rank=False,
                           tokens=toks)
        assert count.get_total_flops() == n * map_flops(p, k, token_inputs=ti, exact_layer0=m.info.exact_layer0), kind
    line = describe(p, k, rank, token_inputs=True, exact_layer0=True)
    assert f"XᵀX {p.dx + 2 * p.dt}²" in line and "incl. the token block" in line and "layer-0 q/k/v" in line
    assert "token block" not in describe(p, k, rank) and "q/k/v" not in describe(p, k, rank)


def test_calibrate_cli_writes_a_token_map_that_hands_off(pair_dir, tmp_path, capsys):
    out = tmp_path / "t.safetensors"
    args = ["calibrate", "--source", str(pair_dir / "src"), "--target", str(pair_dir / "tgt"), "--corpus",
            str(pair_dir / "corpus.txt"), "--tokens", "300", "--heldout-tokens", "100", "--seq-len", "48",
            "--k", "2", "--rank", "4", "--dtype", "float32", "--token-inputs", "--exact-layer0", "--out", str(out)]
    assert main(args) == 0
    said = capsys.readouterr()
    assert "ridge + token inputs, layer 0 exact" in said.out
    assert "incl. the token block" in said.err and "the target's layer-0 q/k/v" in said.err  # costs.describe
    mapper = Mapper.load(out)
    assert mapper.info.token_inputs and mapper.info.exact_layer0
    source, target = Runner.load(pair_dir / "src"), Runner.load(pair_dir / "tgt")
    mapper.check_pair(source, target)
    ids = Tokenizer.from_dir(pair_dir / "src").encode(load_corpus(str(pair_dir / "corpus.txt")).documents[-1])[:30]
    cache, logits, _ = handoff(source, target, mapper, [ids], HandoffConfig(rho=1.0))
    own, o = target.prefill([ids])
    torch.testing.assert_close(logits, o.logits, atol=1e-5, rtol=1e-5)
    assert main(["inspect", str(out)]) == 0 and "token inputs" in capsys.readouterr().out


def test_vllm_row_handoff_with_a_token_map(tok_pair):
    """The adapter's row handoff (no vLLM needed) maps as `Mapper.apply` does, layer 0 from the target's
    weights; without the target's Runner it refuses."""
    from rarecache.adapters.vllm.connector.core import hand_rows, target_namespace

    source, target, _, _, maps, _, prompts = tok_pair
    mapper, prompt = maps["both"], prompts[0]
    n = len(prompt)
    sc, _ = source.prefill([prompt])
    ref = target.new_cache(1, n)
    mapper.apply(source, sc, target, ref, torch.arange(n)[None], tokens=torch.tensor([prompt]))
    k_src, v_src = sc.k[:, 0, :, :n], sc.v[:, 0, :, :n]
    got = hand_rows(target, mapper, source.config, k_src, v_src, prompt, 0, "rank")
    torch.testing.assert_close(got.k, ref.k[:, 0, :, :n], atol=1e-5, rtol=0)
    torch.testing.assert_close(got.v, ref.v[:, 0, :, :n], atol=1e-5, rtol=0)
    own, _ = target.prefill([prompt])
    full = hand_rows(target, mapper, source.config, k_src, v_src, prompt, n, "rank")
    torch.testing.assert_close(full.k, own.k[:, 0, :, :n], atol=1e-5, rtol=0)
    with pytest.raises(RarecacheError, match="needs the target's Runner"):
        hand_rows(target_namespace(target.config, target.dtype), mapper, source.config, k_src, v_src, prompt, 0,
                  "rank")


def _rank_runner(path, tp: int, rank: int) -> Runner:
    """The target as tensor-parallel rank `rank` of `tp` holds it, without vLLM: q, k and v projections cut to
    the rank's heads (weights.rank_config, sharding.kv_head_range); enough for its layer-0 rows."""
    from rarecache.adapters.vllm.connector.sharding import kv_head_range
    from rarecache.adapters.vllm.connector.weights import rank_config
    from rarecache.models.loader import load_model

    model = load_model(path)
    cfg = rank_config(model.config, tp, rank)
    D = cfg.head_dim
    cols = {"q_proj": slice(rank * cfg.num_heads * D, (rank + 1) * cfg.num_heads * D),
            "k_proj": kv_head_range(model.config.num_kv_heads, tp, rank).columns(D)}
    cols["v_proj"] = cols["k_proj"]
    with torch.no_grad():
        for layer in model.layers:
            a = layer.self_attn
            for name, rows in cols.items():
                full = getattr(a, name)
                cut = torch.nn.Linear(full.in_features, rows.stop - rows.start, bias=full.bias is not None)
                cut.weight.copy_(full.weight[rows])  # (h·D, C): the rank's heads' output rows
                if full.bias is not None:
                    cut.bias.copy_(full.bias[rows])
                setattr(a, name, cut)
            a.num_heads, a.num_kv_heads = cfg.num_heads, cfg.num_kv_heads
    model.config = cfg
    return Runner(model, path, pack=False)


@pytest.mark.parametrize("tp", [2, 4])  # 2 KV heads: one per rank; at 4, each head on two ranks
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_vllm_row_handoff_with_a_token_map_under_tensor_parallelism(pair_dir, tok_pair, kind, tp):
    """Tensor parallel, without vLLM: each rank's Runner computes its own heads' layer-0 rows, `gather` joins
    the ranks' pieces into whole rows (a stand-in all-gather over threads, joined as the worker joins them:
    sharding.join_gathered), and each rank holds its heads of what one whole process hands off. Without
    `gather` a rank refuses."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from rarecache.adapters.vllm.connector.core import hand_rows
    from rarecache.adapters.vllm.connector.sharding import join_gathered, kv_head_range

    source, target, _, _, maps, _, prompts = tok_pair
    mapper, prompt = maps[kind], prompts[0]
    H, D = target.config.num_kv_heads, target.config.head_dim
    sc, _ = source.prefill([prompt])
    k_src, v_src = sc.k[:, 0, :, :len(prompt)], sc.v[:, 0, :, :len(prompt)]
    ref = hand_rows(target, mapper, source.config, k_src, v_src, prompt, 0, "rank")
    ranks = [_rank_runner(pair_dir / "tgt", tp, r) for r in range(tp)]
    heads = [kv_head_range(H, tp, r) for r in range(tp)]
    sent, barrier = [None] * tp, threading.Barrier(tp, timeout=60)

    def gather(rank):
        def joined(rows):  # this rank's (..., h·D) -> (..., Hkv·D), once every rank has sent its own
            sent[rank] = rows
            barrier.wait()
            return join_gathered(torch.stack(sent), H, D)  # (tp, ..., h·D) -> (..., Hkv·D)
        return joined

    def run(rank):
        return hand_rows(ranks[rank], mapper, source.config, k_src, v_src, prompt, 0, "rank", heads=heads[rank],
                         gather=gather(rank))

    with ThreadPoolExecutor(tp) as pool:
        got = list(pool.map(run, range(tp)))
    assert all(sent[r].shape[-1] == heads[r].count * D for r in range(tp))  # each rank sent only its heads
    for h, out in zip(heads, got):
        torch.testing.assert_close(out.k, ref.k[:, h.start:h.stop], atol=1e-5, rtol=0)
        torch.testing.assert_close(out.v, ref.v[:, h.start:h.stop], atol=1e-5, rtol=0)
    with pytest.raises(RarecacheError, match="under tensor parallelism it needs `gather`"):
        hand_rows(ranks[0], mapper, source.config, k_src, v_src, prompt, 0, "rank", heads=heads[0])


def test_a_plain_transfer_view_keeps_the_token_options(tok_pair):
    """A general map records plain transfer's sharpening: its rho-0 view (`at_rho`) still reads the tokens,
    and a rho-0 handoff maps through that view (the reference of the view, layer 0 exact)."""
    from rarecache.transfer.fitting.calibrate import with_plain

    source, target, _, _, maps, _, prompts = tok_pair
    combined = with_plain(maps["both"], (1.0, 0.5))
    view = combined.at_rho(0)
    assert view is not combined and view.info.token_inputs and view.info.exact_layer0
    cache, _, _ = handoff(source, target, combined, prompts[:1], HandoffConfig(rho=0.0, selector="rank"))
    n = len(prompts[0])
    ref = target.new_cache(1, n)
    view.apply_reference(source, source.prefill(prompts[:1])[0], target, ref, torch.arange(n)[None],
                         tokens=torch.tensor([prompts[0]]))
    own, _ = target.prefill(prompts[:1])
    mapped = slice(0, n - 1)  # the last position is always recomputed
    torch.testing.assert_close(cache.k[:, :, :, mapped], ref.k[:, :, :, mapped], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cache.v[0, :, :, :n], own.v[0, :, :, :n], atol=2e-6, rtol=2e-6)
    unsharpened, _, _ = handoff(source, target, maps["both"], prompts[:1], HandoffConfig(rho=0.0, selector="rank"))
    assert not torch.allclose(cache.k[:, :, :, mapped], unsharpened.k[:, :, :, mapped], atol=1e-4)  # the view's


def test_the_committed_served_map_loads_and_saves_unchanged(tmp_path):
    """The served map (v4: token inputs, layer 0 exact, bf16 weights) loads with both options, is not
    flagged as a poor fit, and saves back to the very same bytes (its recorded sha256)."""
    import hashlib

    from rarecache.defaults import SERVED

    path = SERVED.path
    if not path.is_file():
        pytest.skip("the served map is not in this install")
    mapper = Mapper.load(path)
    assert mapper.info.token_inputs and mapper.info.exact_layer0 and mapper.needs_tokens
    assert mapper.exact_layers == 1 and mapper.extra_width == 2 * 256 and mapper.fit_problems() == []
    assert mapper.info.weights == "bfloat16"
    mapper.save(tmp_path / "again.safetensors")
    assert hashlib.sha256((tmp_path / "again.safetensors").read_bytes()).hexdigest() == SERVED.sha256
