"""Selective recompute and the rank-disagreement score on tiny models."""

from __future__ import annotations

import math

import pytest
import torch

from rarecache.engine.runner import Runner
from rarecache.errors import RarecacheError
from rarecache.transfer.features import rows
from rarecache.transfer.handoff import (LAYER_PREFIX, POSITIONS, HandoffConfig, budget, handoff, prefix_layers,
                                        select_top)
from rarecache.transfer.mapper import SIDES
from rarecache.transfer.selectors import SELECTORS, L2Oracle, SelectionContext, attention_capture, rank_scores, received


def own_prefill(target, prompts, max_len):
    return target.prefill(prompts, max_len=max_len)


def test_rho_one_equals_target_prefill(fitted):
    source, target, mapper, prompts = fitted
    cache, logits, res = handoff(source, target, mapper, prompts, HandoffConfig(rho=1.0))
    own, out = own_prefill(target, prompts, max_len=37)
    assert [len(p) for p in res.positions] == [37, 23]
    torch.testing.assert_close(logits, out.logits, atol=1e-5, rtol=0)
    for b, n in enumerate((37, 23)):
        torch.testing.assert_close(cache.k[:, b, :, :n], own.k[:, b, :, :n], atol=1e-5, rtol=0)
        torch.testing.assert_close(cache.v[:, b, :, :n], own.v[:, b, :, :n], atol=1e-5, rtol=0)


def test_rho_one_maps_and_scores_nothing(fitted, monkeypatch):
    """Every handed-off position is recomputed at rho 1 (and in a one-position span at any rho), so no mapped
    row would be read: the map and the selector never run, and the result is still the target's own rows,
    after kept rows too."""
    source, target, mapper, prompts = fitted
    ran, apply_scored = [], type(mapper).apply_scored
    monkeypatch.setattr(type(mapper), "apply_scored", lambda *a, **k: ran.append("map") or apply_scored(*a, **k))
    ids, n, k = prompts[0], len(prompts[0]), 20
    own, out = target.prefill([ids], max_len=n + 5)
    for selector in ("rank", "attn-source"):
        cache, logits, res = handoff(source, target, mapper, [ids], HandoffConfig(1.0, selector), max_len=n + 5)
        assert res.positions == [list(range(n))] and res.scores is None and res.timings["score"] < 1
        torch.testing.assert_close(logits, out.logits, atol=1e-5, rtol=0)
        torch.testing.assert_close(cache.k[:, :, :, :n], own.k[:, :, :, :n], atol=1e-5, rtol=0)
    held = target.new_cache(1, n)
    held.copy_prefix(own, k)
    cache, logits, res = handoff(source, target, mapper, [ids], HandoffConfig(1.0, "suffix"), target_cache=held,
                                 target_kept=[k])
    assert res.positions == [list(range(k, n))]
    torch.testing.assert_close(logits, out.logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(cache.v[:, :, :, :n], own.v[:, :, :, :n], atol=1e-5, rtol=0)
    _, _, res = handoff(source, target, mapper, [ids], HandoffConfig(0.0, "rank"), target_cache=held,
                        target_kept=[n - 1])
    assert res.positions == [[n - 1]] and ran == []
    handoff(source, target, mapper, [ids], HandoffConfig(0.9, "rank"))  # below 1: the map runs
    assert ran == ["map"]


def test_rho_zero_is_plain_transfer(fitted):
    """Only the last position is computed; every other row is the map's output."""
    source, target, mapper, prompts = fitted
    cache, logits, res = handoff(source, target, mapper, prompts[:1], HandoffConfig(rho=0.0, selector="rank"))
    assert res.positions == [[36]]
    mapped = target.new_cache(1, 37)
    src_cache, _ = source.prefill(prompts[:1])
    mapper.apply(source, src_cache, target, mapped, torch.arange(37)[None])
    torch.testing.assert_close(cache.k[:, :, :, :36], mapped.k[:, :, :, :36], atol=0, rtol=0)
    assert not torch.allclose(cache.k[:, :, :, 36], mapped.k[:, :, :, 36])  # the last row is the target's own
    # its logits: the target's last-position forward over the mapped cache
    out = target.forward(torch.tensor([[prompts[0][36]]]), torch.tensor([[36]]), mapped)
    torch.testing.assert_close(logits, out.logits, atol=1e-5, rtol=0)


def test_score_equals_reduced_rank_gap_the_long_way(fitted):
    source, target, mapper, prompts = fitted
    src_cache, _ = source.prefill(prompts[:1])
    pos = torch.arange(37)[None]
    cache = target.new_cache(1, 37)
    z = mapper.apply(source, src_cache, target, cache, pos, dtype=torch.float64)
    fast = rank_scores(mapper, z)[0].double()
    slow = torch.zeros(37, dtype=torch.float64)
    for side in SIDES:
        f = mapper.sides[side]
        x = rows(source, src_cache, pos, side)[0].double()  # (T, Ls·ds)
        width = x.shape[1] // source.num_layers
        for l in range(f.weight.shape[0]):
            xs = torch.cat([x[:, j * width:(j + 1) * width] for j in f.sources[l].tolist()], 1)
            w, b = f.weight[l].double(), f.bias[l].double()
            vr = f.basis[l].double()
            w_r = w @ vr @ vr.T  # reduced-rank map
            mu = f.mean[l].double()  # μ̂ = x̄W + b
            b_r = mu - (mu - b) @ vr @ vr.T  # refit bias μ̂ − x̄W_r: sends x̄ to μ̂
            slow += ((xs @ w + b) - (xs @ w_r + b_r)).square().sum(1)
    torch.testing.assert_close(fast, slow, rtol=1e-3, atol=1e-6 * slow.max().item())


def test_score_limits_in_rank(fitted):
    source, target, mapper, prompts = fitted
    src_cache, _ = source.prefill(prompts[:1])
    pos = torch.arange(37)[None]
    z = mapper.apply(source, src_cache, target, target.new_cache(1, 37), pos, dtype=torch.float64)
    saved = {s: mapper.sides[s].basis for s in SIDES}
    try:
        for s in SIDES:
            mapper.sides[s].basis = saved[s][..., :0]  # r = 0
        norm = sum(z[s].square().sum(-1).sum(0) for s in SIDES)[0]
        torch.testing.assert_close(rank_scores(mapper, z)[0].double(), norm, rtol=1e-5, atol=1e-6)
        for s in SIDES:  # r = d_t: complete basis
            dt = z[s].shape[-1]
            lt = z[s].shape[0]
            mapper.sides[s].basis = torch.linalg.qr(torch.randn(lt, dt, dt, dtype=torch.float64)).Q
        assert rank_scores(mapper, z).abs().max() < 1e-6 * norm.max()
    finally:
        for s in SIDES:
            mapper.sides[s].basis = saved[s]


@pytest.mark.parametrize("name", [*SELECTORS, "layer-prefix"])
@pytest.mark.parametrize("rho", [0.0, 0.1, 0.3, 0.5, 0.99])
def test_selection_honours_budget_and_keeps_last(fitted, name, rho):
    source, target, mapper, prompts = fitted
    _, _, res = handoff(source, target, mapper, prompts, HandoffConfig.named(rho, name))
    for b, (chosen, prompt) in enumerate(zip(res.positions, prompts)):
        n = len(prompt)
        if name == "layer-prefix":  # FLOP-matched: n·m + (L − m) ≈ ⌈ρn⌉·L token-layers
            L, m = target.num_layers, res.prefix_layers
            assert chosen == [n - 1] and abs(n * m + (L - m) - budget(rho, n) * L) <= n * 1.5
            continue
        # every pass counted (a two-pass selector's first pass, the newest positions, is inside its second)
        assert res.recomputed(b) == budget(rho, n) == max(1, math.ceil(round(rho * n, 6)))
        assert chosen == sorted(set(chosen)) and chosen[-1] == n - 1 and chosen[0] >= 0
        first = res.first_pass[b] if res.first_pass else []
        w = len(set(first))  # the window, listed once per earlier pass (a refining variant's pass too)
        assert first == list(range(n - w, n)) * (len(first) // max(w, 1)) and set(first) <= set(chosen)
        assert len(first) in (w, 2 * w if SELECTORS[name].two_pass and SELECTORS[name].config.refine else w)
        assert bool(res.first_pass) == SELECTORS[name].two_pass


def test_rank_selector_picks_highest_scores(fitted):
    source, target, mapper, prompts = fitted
    _, _, res = handoff(source, target, mapper, prompts[:1], HandoffConfig(rho=0.3, selector="rank"))
    scores = res.scores[0]
    chosen = set(res.positions[0])
    rest = [s for i, s in enumerate(scores[:-1].tolist()) if i not in chosen]
    picked = [s for i, s in enumerate(scores[:-1].tolist()) if i in chosen]
    assert min(picked) >= max(rest)


def test_bad_settings_are_clear_errors():
    with pytest.raises(RarecacheError, match="rho"):
        HandoffConfig(rho=1.5)
    with pytest.raises(RarecacheError, match="unknown selector"):
        HandoffConfig(selector="magic")
    with pytest.raises(RarecacheError, match=r"unknown selector 'layer-prefix'; .*query-blend \(layer-prefix "
                                             r"is a schedule: schedule='layer-prefix'\)$"):
        HandoffConfig(selector="layer-prefix")
    with pytest.raises(RarecacheError, match="unknown schedule 'magic'; choose from positions, layer-prefix$"):
        HandoffConfig(schedule="magic")
    # the one word users give: the message lists every name they may give
    with pytest.raises(RarecacheError, match="^unknown selector 'magic'; choose from rank, random, attn-source, "
                                             r"suffix, attn-rank, attn\+rank, suffix\+attn, suffix\+rank, attn-target, "
                                             r"l2-oracle, query, query-layer, query-head, query-all, query-value, "
                                             r"query-common, query-raw, query-span, query-layer-span, query-rank, "
                                             r"query-w8, query-w64, attn-source-span, attn-source-line, "
                                             r"attn-source-block, attn-source-mix, query-refine, attn-source-span-raw, "
                                             r"query-blend, layer-prefix$"):
        HandoffConfig.named(0.3, "magic")
    with pytest.raises(RarecacheError, match=r"^rho must be a number in \[0, 1\], got 1.5$"):
        HandoffConfig.named(1.5, "magic")


def test_layer_prefix_is_a_schedule_named_like_a_selector():
    """Users name layer-prefix where they name a selector; inside it is a schedule that scores nothing."""
    cfg = HandoffConfig.named(0.3, "layer-prefix", seed=4)
    assert (cfg.schedule, cfg.rho, cfg.seed, cfg.scorer, cfg.name) == (LAYER_PREFIX, 0.3, 4, None, "layer-prefix")
    assert cfg == HandoffConfig(0.3, seed=4, schedule=LAYER_PREFIX)
    for name in SELECTORS:
        cfg = HandoffConfig.named(0.5, name)
        assert cfg == HandoffConfig(0.5, name) and cfg.schedule == POSITIONS
        assert cfg.name == name and cfg.scorer is SELECTORS[name]


def test_layer_prefix_limits(fitted):
    """All layers for every position is the target's own prefill; none is plain transfer."""
    source, target, mapper, prompts = fitted
    assert prefix_layers(1.0, 37, 4) == 4 and prefix_layers(0.0, 37, 4) == 0
    _, full, res = handoff(source, target, mapper, prompts, HandoffConfig(rho=1.0, schedule=LAYER_PREFIX))
    _, own = target.prefill(prompts)
    assert res.prefix_layers == 4
    torch.testing.assert_close(full, own.logits, atol=1e-5, rtol=0)
    _, plain, _ = handoff(source, target, mapper, prompts, HandoffConfig(rho=0.0, selector="rank"))
    _, none, res = handoff(source, target, mapper, prompts, HandoffConfig(rho=0.0, schedule=LAYER_PREFIX))
    assert res.prefix_layers == 0
    torch.testing.assert_close(none, plain, atol=1e-5, rtol=0)


def test_oracles_are_labelled():
    assert {n for n, s in SELECTORS.items() if s.oracle} == {"attn-target", "l2-oracle"}
    assert SELECTORS["l2-oracle"].label == "l2-oracle (oracle)" and SELECTORS["rank"].label == "rank"


def test_l2_oracle_ranks_the_corrupted_rows_first(fitted):
    source, target, mapper, prompts = fitted
    ids = prompts[:1]
    own, _ = target.prefill(ids)
    mapped = target.new_cache(1, 37)
    for name in ("k", "v", "filled"):
        getattr(mapped, name).copy_(getattr(own, name))
    bad = [3, 17, 30]
    mapped.k[:, :, :, bad] *= 1.5
    mapped.v[:, :, :, bad] += 0.3
    ctx = SelectionContext(source, target, mapper, torch.tensor(ids), torch.arange(37)[None], mapped, {})
    scores = L2Oracle().scores(ctx)[0]
    assert sorted(scores.topk(3).indices.tolist()) == bad
    assert scores[[i for i in range(37) if i not in bad]].abs().max() < 1e-5


def test_attention_received_matches_a_manual_sum(fitted):
    from rarecache.engine.runner import AttnCapture
    from rarecache.transfer.selectors import attention_capture, received

    source, _, _, prompts = fitted
    ids = torch.tensor(prompts[:1])
    cap = attention_capture(source, torch.tensor([37]))
    out = source.forward(ids, torch.arange(37)[None], source.new_cache(1, 37), capture=cap)
    got = received(out.attn, 37)[0]
    every = AttnCapture(frozenset(range(source.num_layers)), torch.arange(37)[None])
    full = source.forward(ids, torch.arange(37)[None], source.new_cache(1, 37), capture=every).attn
    want = sum(full[l][0, :, 5:37].sum(dim=(0, 1)) for l in range(source.num_layers - 1, source.num_layers))
    assert cap.layers == frozenset({source.num_layers - 1})
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_variants_equal_one_handoff_each(fitted):
    """The shared-map, batched-recompute path against a plain handoff per (map, config)."""
    from rarecache.transfer.handoff import handoff_variants
    from rarecache.transfer.selectors import attention_capture, received

    source, target, mapper, prompts = fitted
    ids = prompts[0]
    n = len(ids)
    src = source.new_cache(1, n)
    out = source.forward(torch.tensor([ids]), torch.arange(n)[None], src, capture=attention_capture(source, torch.tensor([n])))
    src_attn = received(out.attn, n)
    own_cache = target.new_cache(1, n)
    out = target.forward(torch.tensor([ids]), torch.arange(n)[None], own_cache,
                         capture=attention_capture(target, torch.tensor([n])))
    target_prefill = (own_cache, received(out.attn, n))
    other = scaled_map(mapper)
    variants = [("a", HandoffConfig.named(0.3, s)) for s in ("rank", "random", "attn-source", "attn-target",
                                                            "l2-oracle", "layer-prefix")]
    variants += [("a", HandoffConfig(0.0, "rank")), ("b", HandoffConfig(0.3, "rank")),
                 ("a", HandoffConfig(0.5, "rank")), ("b", HandoffConfig(1.0))]
    cache, logits, results = handoff_variants(source, target, {"a": mapper, "b": other}, ids, variants, src,
                                              source_attn=src_attn, target_prefill=target_prefill)
    for v, (label, cfg) in enumerate(variants):
        ref_cache, ref_logits, ref = handoff(source, target, {"a": mapper, "b": other}[label], [ids], cfg)
        assert results[v].positions == ref.positions, (label, cfg)
        assert results[v].prefix_layers == ref.prefix_layers
        torch.testing.assert_close(logits[v], ref_logits[0], atol=1e-4, rtol=0)
        torch.testing.assert_close(cache.k[:, v, :, :n], ref_cache.k[:, 0, :, :n], atol=1e-5, rtol=0)
        torch.testing.assert_close(cache.v[:, v, :, :n], ref_cache.v[:, 0, :, :n], atol=1e-5, rtol=0)
    assert results[0].timings["recompute_batch"] == 6  # every ρ = 0.3 position selector of map a, rank of map b
    assert not torch.allclose(logits[0], logits[7], atol=1e-3)  # the two maps really differ
    own_logits = target.forward(torch.tensor([ids]), torch.arange(n)[None], target.new_cache(1, n)).logits
    torch.testing.assert_close(logits[-1], own_logits[0], atol=1e-5, rtol=0)  # ρ = 1: the target's own prefill


def scaled_map(mapper):
    """Another map for the same pair: the fitted one with its weights halved."""
    import dataclasses

    sides = {k: dataclasses.replace(s, weight=s.weight * 0.5) if hasattr(s, "weight") else s
             for k, s in mapper.sides.items()}
    return type(mapper)(mapper.info, sides)


def test_packed_bf16_handoff_equals_plain(fitted, pair_dir):
    """The whole handoff in bf16 with prepacked weights against F.linear: equal to the last bit."""
    from rarecache.models.packed import can_pack

    if not can_pack(torch.bfloat16, "cpu"):
        pytest.skip("no oneDNN packing on this machine")
    _, _, mapper, prompts = fitted
    runs = []
    for pack in (None, False):
        source = Runner.load(pair_dir / "src", dtype=torch.bfloat16, pack=pack)
        target = Runner.load(pair_dir / "tgt", dtype=torch.bfloat16, pack=pack)
        assert target.packed == (pack is None)
        runs.append(handoff(source, target, mapper, prompts, HandoffConfig(rho=0.3, selector="rank")))
    (c1, l1, r1), (c2, l2, r2) = runs
    assert r1.positions == r2.positions
    torch.testing.assert_close(l1, l2, atol=0, rtol=0)
    torch.testing.assert_close(c1.k, c2.k, atol=0, rtol=0)
    torch.testing.assert_close(c1.v, c2.v, atol=0, rtol=0)


def test_suffix_recomputes_the_newest_positions(fitted):
    source, target, mapper, prompts = fitted
    _, _, res = handoff(source, target, mapper, prompts, HandoffConfig(rho=0.3, selector="suffix"))
    for chosen, prompt in zip(res.positions, prompts):
        n, k = len(prompt), budget(0.3, len(prompt))
        assert chosen == list(range(n - k, n))


@pytest.mark.parametrize("name", ["attn-rank", "attn+rank"])
def test_combined_selectors_combine_attention_and_rank(fitted, name):
    """The combined scores are a function of the two shares: recomputed by hand from the same handoff's
    attn-source and rank scores, and the chosen set is their top-k."""
    source, target, mapper, prompts = fitted
    ids = prompts[:1]
    _, _, attn = handoff(source, target, mapper, ids, HandoffConfig(rho=0.3, selector="attn-source"))
    _, _, rank = handoff(source, target, mapper, ids, HandoffConfig(rho=0.3, selector="rank"))
    _, _, both = handoff(source, target, mapper, ids, HandoffConfig(rho=0.3, selector=name))
    a, r = attn.scores[0].float(), rank.scores[0].float().clamp(min=0)
    a, r = a / a.sum(), r / r.sum()
    want = a * r if name == "attn-rank" else a + r
    torch.testing.assert_close(both.scores[0].float(), want, rtol=1e-4, atol=1e-7)
    k = budget(0.3, len(ids[0]))
    assert both.positions[0] == sorted(select_top(want, k).tolist())


@pytest.mark.parametrize("name, other", [("suffix+attn", "attn-source"), ("suffix+rank", "rank")])
def test_suffix_plus_takes_newest_and_the_other_list_in_turn(fitted, name, other):
    """Any budget's set is the union of the newest positions and the other list's top (the source's
    attention, or rank disagreement), taken in turn (recomputed by hand from the other selector's
    scores), budgets nest, and the variants path picks the same positions as a direct handoff."""
    from rarecache.transfer.handoff import handoff_variants

    source, target, mapper, prompts = fitted
    ids = prompts[:1]
    n = len(ids[0])
    _, _, ref = handoff(source, target, mapper, ids, HandoffConfig(rho=0.3, selector=other))
    by_other = ref.scores[0].float().argsort(descending=True, stable=True).tolist()
    by_recency = list(range(n - 1, -1, -1))
    want, seen = [], set()
    for a, r in zip(by_other, by_recency):  # in turn: newest, other, newest, ...
        for p in (r, a):
            if p not in seen:
                seen.add(p)
                want.append(p)
    previous: set[int] = set()
    src = source.new_cache(1, n)
    src_out = source.forward(torch.tensor(ids), torch.arange(n)[None], src,
                             capture=attention_capture(source, torch.tensor([n])))
    for rho in (0.1, 0.3, 0.6):
        _, _, res = handoff(source, target, mapper, ids, HandoffConfig(rho=rho, selector=name))
        k = budget(rho, n)
        assert res.positions[0] == sorted(want[:k])
        assert previous <= set(res.positions[0])
        previous = set(res.positions[0])
        _, _, (var,) = handoff_variants(source, target, {"": mapper}, ids[0], [("", HandoffConfig(rho, name))], src,
                                        source_attn=received(src_out.attn, n))
        assert var.positions == res.positions
    k = budget(0.6, n)  # the other list reaches the set: it is not the suffix alone
    assert previous != set(range(n - k, n)) and n - 1 in previous


def test_one_file_maps_plain_transfer_with_its_plain_view_and_handoffs_with_its_fit(fitted, tmp_path):
    """A map recording plain_sharpen: at rho 0 a handoff (direct, or among variants) is the resharpened
    map's, at rho > 0 the stored fit's, bit for bit; the file round-trips and the view is made once."""
    from rarecache.transfer.fitting.calibrate import with_plain
    from rarecache.transfer.fitting.refit import resharpen
    from rarecache.transfer.handoff import handoff_variants
    from rarecache.transfer.mapper import Mapper

    source, target, mapper, prompts = fitted
    combined = with_plain(mapper, (1.0, 0.5))
    combined.save(tmp_path / "c.safetensors")
    combined = Mapper.load(tmp_path / "c.safetensors")
    assert combined.info.plain_sharpen == {"k": 1.0, "v": 0.5} and combined.info.sharpen == {}
    assert "plain transfer (rho 0) k:R2^-1 v:R2^-0.5" in combined.summary()
    sharp = resharpen(mapper, (1.0, 0.5))
    view = combined.plain()
    assert view is combined.plain() and view is combined.at_rho(0) and combined.at_rho(0.2) is combined
    assert view.info.sharpen == sharp.info.sharpen and view.info.plain_sharpen is None and view.plain() is view
    for side in SIDES:  # the view is the resharpened fit (made in float64 from the stored float32 tensors)
        torch.testing.assert_close(view.sides[side].weight, sharp.sides[side].weight.float(), atol=1e-6, rtol=1e-5)
    bf16 = combined.computing_in(torch.bfloat16)
    assert bf16.plain().compute_dtype == torch.bfloat16 and bf16.plain() is bf16.plain()
    ids = prompts[:1]
    c0, l0, _ = handoff(source, target, combined, ids, HandoffConfig(0.0, "rank"))
    s0, ls0, _ = handoff(source, target, sharp, ids, HandoffConfig(0.0, "rank"))
    r0, lr0, _ = handoff(source, target, mapper, ids, HandoffConfig(0.0, "rank"))
    torch.testing.assert_close(l0, ls0, atol=1e-4, rtol=0)
    torch.testing.assert_close(c0.k, s0.k, atol=1e-5, rtol=0)
    assert not torch.allclose(c0.k, r0.k, atol=1e-3)  # the sharpening really changes the rows
    c3, l3, _ = handoff(source, target, combined, ids, HandoffConfig(0.3, "rank"))
    r3, lr3, _ = handoff(source, target, mapper, ids, HandoffConfig(0.3, "rank"))
    assert torch.equal(l3, lr3) and torch.equal(c3.k, r3.k)
    # among variants: each budget through its own fit, the two fits mapped once each
    n = len(ids[0])
    src = source.new_cache(1, n)
    source.forward(torch.tensor(ids), torch.arange(n)[None], src)
    variants = [("c", HandoffConfig(0.0, "rank")), ("c", HandoffConfig(0.3, "rank")),
                ("c", HandoffConfig.named(0.2, "suffix"))]
    cache, logits, _ = handoff_variants(source, target, {"c": combined}, ids[0], variants, src)
    for v, (_, cfg) in enumerate(variants):
        ref_cache, ref_logits, _ = handoff(source, target, combined, ids, cfg)
        torch.testing.assert_close(logits[v], ref_logits[0], atol=1e-4, rtol=0)
        torch.testing.assert_close(cache.k[:, v, :, :n], ref_cache.k[:, 0, :, :n], atol=1e-5, rtol=0)


def test_a_span_after_kept_rows_maps_as_in_a_whole_handoff(fitted):
    """A later turn hands off only the span the target has not seen: its rows are mapped exactly as the
    same positions of a whole-prompt handoff (the map reads the source's rows at each position; nothing
    depends on where the span starts), the target's own rows before it stay, and the selector's picks
    among the span recompute against them."""
    source, target, mapper, prompts = fitted
    ids, n, k = prompts[0], len(prompts[0]), 20
    whole, _, _ = handoff(source, target, mapper, [ids], HandoffConfig(rho=0.0, selector="rank"))
    own, _ = target.prefill([ids], max_len=n)
    for rho in (0.0, 0.3):
        held = target.new_cache(1, n)
        held.copy_prefix(own, k)
        cache, _, res = handoff(source, target, mapper, [ids], HandoffConfig(rho=rho, selector="suffix"),
                                target_cache=held, target_kept=[k])
        assert res.handed_off == [(k, n)] and all(k <= p < n for p in res.positions[0])
        mapped = [p for p in range(k, n) if p not in res.positions[0]]
        for c, w, o in ((cache.k, whole.k, own.k), (cache.v, whole.v, own.v)):
            torch.testing.assert_close(c[:, 0, :, :k], o[:, 0, :, :k], atol=0, rtol=0)  # its own rows, untouched
            torch.testing.assert_close(c[:, 0, :, mapped], w[:, 0, :, mapped], atol=1e-5, rtol=0)
