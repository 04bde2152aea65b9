"""Query-aware recompute in two passes (transfer/query.py), its orders (transfer/choice.py) and its wiring."""

from __future__ import annotations

import pytest
import torch

from rarecache.engine.runner import AttnCapture
from rarecache.errors import RarecacheError
from rarecache.transfer.choice import in_turn, lexicographic, spans, union_of_groups
from rarecache.transfer.handoff import HandoffConfig, budget, handoff, handoff_variants
from rarecache.transfer.query import captured_layers, two_pass
from rarecache.transfer.selectors import QUERY_VARIANTS, SELECTORS, QueryConfig, QuerySelector, rank_scores

TWO_PASS = [n for n, s in SELECTORS.items() if s.two_pass]


def _mapped(fitted, ids):
    """The source's rows of `ids`, the map's target cache and its centred outputs (batch one)."""
    source, target, mapper, _ = fitted
    n = len(ids)
    src = source.new_cache(1, n)
    source.forward(torch.tensor([ids]), torch.arange(n)[None], src, logits_at=None)
    cache = target.new_cache(1, n)
    centred = mapper.apply(source, src, target, cache, torch.arange(n)[None], tokens=torch.tensor([ids]))
    return src, cache, centred


def _copy(target, cache, n):
    out = target.new_cache(1, n)
    out.copy_prefix(cache, n)
    return out


def test_every_two_pass_variant_is_registered_by_name():
    assert TWO_PASS == [n for n in QUERY_VARIANTS if not QUERY_VARIANTS[n].source]
    assert SELECTORS["attn-source-span"].needs_source_attention and not SELECTORS["attn-source-span"].two_pass
    assert SELECTORS["query-rank"].needs_rank and not SELECTORS["query"].needs_rank
    assert not any(SELECTORS[n].oracle for n in QUERY_VARIANTS)
    with pytest.raises(RarecacheError, match="bad query selector settings"):
        QueryConfig(group="heads")


@pytest.mark.parametrize("total, handed, want", [(1, 37, 0), (3, 37, 0), (4, 37, 1), (19, 37, 4), (200, 1000, 32),
                                                 (37, 37, 0), (40, 37, 0)])
def test_the_budget_split_counts_both_passes(total, handed, want):
    """w + (w + the others) = the budget; one pass when two do not fit or the budget covers the span."""
    w = QueryConfig().split(total, handed)
    assert w == want
    if w:
        assert w + w + (total - 2 * w) == total and total - 2 * w >= 1 and w <= 0.25 * total


@pytest.mark.parametrize("name", ["query", "query-layer", "query-head", "query-value", "query-common",
                                  "query-span", "query-rank", "query-all"])
def test_pass_two_is_a_direct_sparse_recompute_of_its_set(fitted, name):
    """Equality, defined: after both passes the cache (every layer's rows, `filled`) and the last logits are
    bit for bit those of one forward over pass 2's set from the mapped cache, i.e. pass 1's rows are all
    overwritten (the window is inside pass 2's set) and pass 1 only chose the set."""
    source, target, mapper, prompts = fitted
    ids = prompts[0]
    n = len(ids)
    _, mapped, centred = _mapped(fitted, ids)
    sel = SELECTORS[name]
    rank = rank_scores(mapper, centred) if sel.needs_rank else None
    both = _copy(target, mapped, n)
    whole, pos = torch.tensor([ids]), torch.arange(n)[None]
    logits, p = two_pass(target, both, whole, pos, [n], sel, 0.5, rank)
    chosen = p.chosen[0]
    assert len(p.first[0]) == 4 and set(p.first[0].tolist()) <= set(chosen.tolist())
    direct = _copy(target, mapped, n)
    want = target.forward(whole[:, chosen], chosen[None], direct).logits
    assert torch.equal(logits, want)
    assert torch.equal(both.k, direct.k) and torch.equal(both.v, direct.v) and torch.equal(both.filled, direct.filled)
    # and pass 1 mattered: its rows differ from the mapped ones it overwrote, which pass 2 overwrote again
    window = p.first[0]
    first_only = _copy(target, mapped, n)
    target.forward(whole[:, window], window[None], first_only, logits_at=None)
    assert not torch.equal(first_only.k[:, :, :, window], mapped.k[:, :, :, window])


def test_handoff_runs_the_two_passes_over_the_mapped_cache(fitted):
    """Through `handoff`, bit for bit: the cache the handoff's map makes (`apply_scored`, as `map_and_score`
    calls it), then one forward over the chosen set."""
    source, target, mapper, prompts = fitted
    ids = prompts[0]
    n = len(ids)
    cache, logits, res = handoff(source, target, mapper, [ids], HandoffConfig(0.5, "query"))
    src, _, _ = _mapped(fitted, ids)
    mapped = target.new_cache(1, n)
    mapper.apply_scored(source, src, target, mapped, torch.arange(n)[None], rank=False, tokens=torch.tensor([ids]))
    chosen = torch.tensor(res.positions[0])
    want = target.forward(torch.tensor([ids])[:, chosen], chosen[None], mapped).logits
    assert torch.equal(logits, want) and torch.equal(cache.k, mapped.k) and torch.equal(cache.v, mapped.v)
    t = res.timings
    assert t["recompute"] == t["pass1"] + t["pass2"] and t["pass1"] > 0 and t["pass2"] > 0


def test_pass_one_ranks_by_the_newest_queries_attention(fitted):
    """`query`'s picks, by hand: the newest w positions over the mapped cache, their attention in the top
    quarter of the layers summed over heads and queries, the first positions (sinks) and the window left
    out; the window and the top budget − 2w of the rest."""
    source, target, mapper, prompts = fitted
    ids = prompts[0]
    n, rho = len(ids), 0.5
    _, _, res = handoff(source, target, mapper, [ids], HandoffConfig(rho, "query"))
    total = budget(rho, n)
    w = QueryConfig().split(total, n)
    assert res.first_pass == [list(range(n - w, n))] and res.recomputed(0) == total
    _, mapped, _ = _mapped(fitted, ids)
    layers = captured_layers(target, 0.25)
    assert layers == frozenset({target.num_layers - 1})
    out = target.forward(torch.tensor([ids[n - w:]]), torch.arange(n - w, n)[None], mapped, logits_at=None,
                         capture=AttnCapture(layers, torch.arange(w)[None]))
    got = sum(out.attn[layer][0].sum(dim=(0, 1)) for layer in layers)  # (n,)
    got[:4] = -1  # sinks
    got[n - w:] = -1  # the window: in anyway
    others = got.topk(total - 2 * w).indices.tolist()
    assert res.positions[0] == sorted(others + list(range(n - w, n)))


@pytest.mark.parametrize("name", TWO_PASS)
def test_rho_one_is_the_targets_own_prefill(fitted, name):
    source, target, mapper, prompts = fitted
    cache, logits, res = handoff(source, target, mapper, prompts, HandoffConfig(1.0, name))
    own, out = target.prefill(prompts, max_len=37)
    assert res.positions == [list(range(37)), list(range(23))] and res.recomputed(0) == 37
    torch.testing.assert_close(logits, out.logits, atol=1e-5, rtol=0)
    for b, n in enumerate((37, 23)):
        torch.testing.assert_close(cache.k[:, b, :, :n], own.k[:, b, :, :n], atol=1e-5, rtol=0)
        torch.testing.assert_close(cache.v[:, b, :, :n], own.v[:, b, :, :n], atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["query", "query-layer-span", "query-rank"])
def test_two_passes_are_deterministic_and_a_batch_is_its_rows(fitted, name):
    source, target, mapper, prompts = fitted
    runs = [handoff(source, target, mapper, prompts, HandoffConfig(0.4, name)) for _ in range(2)]
    (c1, l1, r1), (c2, l2, r2) = runs
    assert r1.positions == r2.positions and r1.first_pass == r2.first_pass
    assert torch.equal(l1, l2) and torch.equal(c1.k, c2.k)
    for b, ids in enumerate(prompts):  # each prompt alone: its own budget and window
        _, lg, alone = handoff(source, target, mapper, [ids], HandoffConfig(0.4, name))
        assert alone.positions[0] == r1.positions[b] and alone.first_pass[0] == r1.first_pass[b]
        torch.testing.assert_close(lg[0], l1[b], atol=1e-4, rtol=0)


def test_sinks_are_left_out_of_the_attention_ranking(fitted):
    source, target, mapper, prompts = fitted
    for rho in (0.3, 0.5, 0.7):
        _, _, res = handoff(source, target, mapper, prompts[:1], HandoffConfig(rho, "query"))
        assert not set(res.positions[0]) & {0, 1, 2, 3}
    sel = SELECTORS["query"]
    pos = torch.arange(8)[None]
    att = torch.tensor([[[9.0, 8, 0, 0, 1, 2, 3, 0]]])
    order = sel.order(att, pos, pos >= 7)  # sinks last (before padding), the forced first
    assert order[0].argsort(descending=True).tolist() == [7, 6, 5, 4, 0, 1, 2, 3]  # sinks by index, whatever
    # the attention they drew


def test_the_raw_span_ranks_the_sinks_with_their_span():
    """`attn-source-span-raw` is the served span with the first positions ranked like any other (sinks draw the
    most attention, so position 0 and its 8 neighbours come first); the served span puts them last."""
    pos = torch.arange(40)[None]
    att = torch.zeros(1, 1, 40)
    att[0, 0, 0], att[0, 0, 30] = 9.0, 5.0
    raw = SELECTORS["attn-source-span-raw"].order(att, pos)[0].argsort(descending=True).tolist()
    assert raw[0] == 0 and set(raw[:9]) == set(range(9)) and raw[9] == 30
    served = SELECTORS["attn-source-span"].order(att, pos)[0].argsort(descending=True).tolist()
    assert served[0] == 30 and served[-4:] == [0, 1, 2, 3]


def test_the_blend_sums_the_two_signals_shares(fitted):
    """`query-blend`: pass 1's attention and the source's, each over what the ranked positions (not the window, not
    the sinks) receive, summed, then the served arm's ±8 spans; by hand, through a handoff."""
    from rarecache.transfer.choice import spans as span_order
    from rarecache.transfer.query import first_pass, newest, received_by
    from rarecache.transfer.selectors import attention_capture, received

    source, target, mapper, prompts = fitted
    ids = prompts[0]
    n, rho = len(ids), 0.5
    sel = SELECTORS["query-blend"]
    assert sel.two_pass and sel.needs_source_attention
    _, _, res = handoff(source, target, mapper, [ids], HandoffConfig(rho, "query-blend"))
    src = source.new_cache(1, n)
    out = source.forward(torch.tensor([ids]), torch.arange(n)[None], src,
                         capture=attention_capture(source, torch.tensor([n])))
    src_att = received(out.attn, n)  # (1, n)
    _, mapped, _ = _mapped(fitted, ids)
    total = budget(rho, n)
    w = sel.config.split(total, n)
    pos = torch.arange(n)[None]
    attn, valid = first_pass(target, mapped, torch.tensor([ids]), newest(pos, [n], [w]), captured_layers(target, 0.25))
    tgt_att = received_by(sel, attn, valid, mapped, pos)[:, 0]  # (1, n)
    ranked = (pos >= 4) & (pos < n - w)
    share = lambda x: (x * ranked) / (x * ranked).sum()  # noqa: E731
    key = span_order(share(tgt_att) + share(src_att), 8, ranked)[0].masked_fill(~ranked[0], float("-inf"))
    others = key.topk(total - 2 * w).indices.tolist()
    assert res.positions[0] == sorted(others + list(range(n - w, n))) and res.first_pass == [list(range(n - w, n))]
    with pytest.raises(ValueError, match="blends in the source's attention"):
        sel.order(tgt_att[:, None], pos)
    with pytest.raises(RarecacheError, match="bad query selector settings"):
        QueryConfig(blend=True, group="layer")


def test_a_span_after_kept_rows(fitted):
    """A later turn: only [k, n) is handed off; the window is its newest, the budget its ⌈ρ·(n − k)⌉, and
    the target's own rows before k stay."""
    source, target, mapper, prompts = fitted
    ids, n, k = prompts[0], len(prompts[0]), 10
    own, _ = target.prefill([ids], max_len=n)
    held = target.new_cache(1, n)
    held.copy_prefix(own, k)
    cache, _, res = handoff(source, target, mapper, [ids], HandoffConfig(0.6, "query"), target_cache=held,
                            target_kept=[k])
    total = budget(0.6, n - k)
    w = QueryConfig().split(total, n - k)
    assert res.handed_off == [(k, n)] and res.recomputed(0) == total and w > 0
    assert res.first_pass == [list(range(n - w, n))] and min(res.positions[0]) >= k
    torch.testing.assert_close(cache.k[:, 0, :, :k], own.k[:, 0, :, :k], atol=0, rtol=0)


def test_variants_equal_one_handoff_each(fitted):
    """Evaluation arms: pass 1 shared by the variants with the same window, pass 2 in the budget's batch;
    the same sets, first passes, logits and rows as a handoff each."""
    from rarecache.transfer.selectors import attention_capture, received

    source, target, mapper, prompts = fitted
    ids = prompts[0]
    n = len(ids)
    src = source.new_cache(1, n)
    out = source.forward(torch.tensor([ids]), torch.arange(n)[None], src,
                         capture=attention_capture(source, torch.tensor([n])))
    names = ["query", "query-layer", "query-value", "query-span", "query-rank", "query-w8", "attn-source-span",
             "attn-source-line", "attn-source-block", "query-blend"]
    variants = [("a", HandoffConfig.named(0.5, s)) for s in names] + [("a", HandoffConfig(0.5, "rank")),
                                                                      ("a", HandoffConfig(1.0, "query"))]
    cache, logits, results = handoff_variants(source, target, {"a": mapper}, ids, variants, src,
                                              source_attn=received(out.attn, n))
    for v, (_, cfg) in enumerate(variants):
        ref_cache, ref_logits, ref = handoff(source, target, mapper, [ids], cfg)
        assert results[v].positions == ref.positions and results[v].first_pass == ref.first_pass, cfg
        assert results[v].recomputed(0) == ref.recomputed(0) == budget(cfg.rho, n)
        torch.testing.assert_close(logits[v], ref_logits[0], atol=1e-4, rtol=0)
        torch.testing.assert_close(cache.k[:, v, :, :n], ref_cache.k[:, 0, :, :n], atol=1e-5, rtol=0)
    assert len({tuple(r.positions[0]) for r in results[:5]}) > 1  # the variants do choose differently


def test_orders_from_scores():
    pad = torch.tensor([[False] * 5 + [True]])
    assert lexicographic(torch.tensor([[1.0, 2, 2, 0]]), torch.tensor([[0.0, 1, 3, 9]])).argsort(
        descending=True).tolist() == [[2, 1, 0, 3]]
    first, second = torch.tensor([[5.0, 4, 3, 2, 1, 0]]), torch.tensor([[0.0, 0, 0, 1, 2, 9]])
    turn = in_turn(first, second, pad)  # 0 (first's), 4 (second's: 5 is padding), 1, 3, 2
    assert turn[0].argsort(descending=True).tolist()[:5] == [0, 4, 1, 3, 2] and turn[0, 5] == 0
    key = torch.tensor([[0.0, 0, 0, 0, 9, 0, 0, 0, 0, 5, 0, 0]])
    every = torch.ones_like(key, dtype=torch.bool)
    by_span = spans(key, 2, every)[0].argsort(descending=True).tolist()
    assert set(by_span[:5]) == {2, 3, 4, 5, 6} and by_span[0] == 4  # the best span, its peak first
    assert set(by_span[5:9]) == {7, 8, 9, 10} and by_span[5] == 9  # the next peak's (6 is taken)
    some = every.clone()
    some[0, 3] = False
    assert 3 not in spans(key, 2, some)[0].argsort(descending=True).tolist()[:4]  # ineligible: no span, last
    att = torch.tensor([[[9.0, 8, 0, 0], [0, 0, 1, 2]]])  # two groups, each's own top first
    union = union_of_groups(att, torch.ones(1, 4, dtype=torch.bool))[0].argsort(descending=True).tolist()
    assert union == [0, 3, 1, 2]


def test_the_query_selectors_wire_in(fitted):
    """Eval arms by name, the gate refuses (no one order of positions), a two-pass selector never scores in
    one pass."""
    from rarecache.eval.arms import Arm
    from rarecache.transfer.gate.policy import GatePolicy

    arm = Arm.parse("0.3:query@v4", ("v4",))[0]
    assert (arm.config.selector, arm.config.rho, arm.map, arm.name) == ("query", 0.3, "v4", "rho=0.3/query@v4")
    with pytest.raises(RarecacheError, match="one-pass selector"):
        Arm.parse("ladder:query", ("",))
    with pytest.raises(RarecacheError, match="one-pass selector"):
        GatePolicy("query")
    with pytest.raises(RuntimeError, match="two passes"):
        SELECTORS["query"].scores(None)
    assert isinstance(SELECTORS["query"], QuerySelector)


def test_costs_count_both_passes(fitted):
    from rarecache.transfer.costs import describe_recompute, position_flops, recompute_flops

    _, target, _, _ = fitted
    cfg = target.config
    one = describe_recompute(cfg, 37, list(range(37)))
    assert one.startswith("recomputed 1 pass, 37 of 37 positions; 1.000 of the target's prefill FLOPs")
    two = describe_recompute(cfg, 37, [5, 9, 35, 36], [35, 36])
    assert "2 passes, 2 + 4 = 6 of 37 positions: pass 1 the newest 2, pass 2 those again and 2" in two
    spent = recompute_flops(cfg, [5, 9, 35, 36, 35, 36]) / recompute_flops(cfg, list(range(37)))
    assert f"{spent:.3f} of the target's prefill FLOPs" in two
    assert position_flops(cfg, 10) - position_flops(cfg, 9) == 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim


@pytest.mark.parametrize("name", ["attn-source-span", "attn-source"])
def test_a_source_holding_the_prompt_scores_as_a_fresh_prefill(fitted, name):
    """A selector reading the source's attention from its last ATTN_QUERIES queries: a source cache that already
    holds the whole prompt (a cascade re-asking the turn; `rarecache serve`) computes those rows again, so the
    scores and the chosen positions are the fresh prefill's, not those of the last query alone."""
    from rarecache.transfer.selectors import ATTN_QUERIES

    source, target, mapper, prompts = fitted
    ids = prompts[0]
    n = len(ids)
    assert n > ATTN_QUERIES  # (the case that differs: fewer rows computed again than queries read)
    cfg = HandoffConfig(0.3, name)
    _, fresh_logits, fresh = handoff(source, target, mapper, [ids], cfg)
    held = source.new_cache(1, n)
    source.forward(torch.tensor([ids]), torch.arange(n)[None], held, logits_at=None)
    for kept in (n, n - 1):
        _, logits, res = handoff(source, target, mapper, [ids], cfg, source_cache=held, source_kept=[kept])
        assert res.positions[0] == fresh.positions[0]
        torch.testing.assert_close(res.scores[0], fresh.scores[0], rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(logits, fresh_logits, rtol=1e-4, atol=1e-5)
