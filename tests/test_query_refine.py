"""The refining query-aware variant (`query-refine`, transfer/query.py): its passes, its budget, its exactness."""

from __future__ import annotations

import pytest
import torch

from rarecache.engine.runner import AttnCapture
from rarecache.errors import RarecacheError
from rarecache.transfer.choice import select_top
from rarecache.transfer.handoff import HandoffConfig, budget, handoff, handoff_variants
from rarecache.transfer.query import captured_layers, first_pass, newest, received_by, two_pass
from rarecache.transfer.selectors import SELECTORS, QueryConfig, attention_capture, received

from .test_query import _copy, _mapped

NAME = "query-refine"


@pytest.mark.parametrize("total, window, want", [(19, 4, 3), (12, 3, 1), (9, 3, 0), (10, 0, 0), (615, 8, 295)])
def test_the_refining_pass_takes_its_share_of_the_picks(total, window, want):
    """w + (w + m) + (w + the rest) = the budget, m = ⌊0.5·(budget − 3w)⌋; none without a window or picks."""
    cfg = SELECTORS[NAME].config
    assert cfg.refined(total, window) == want and QueryConfig().refined(total, window) == 0
    for bad in (dict(refine=1.0), dict(refine=-0.1), dict(refine=0.5, source=True)):
        with pytest.raises(RarecacheError, match="bad query selector settings"):
            QueryConfig(**bad)


@pytest.mark.parametrize("rho", [0.5, 0.8])
def test_the_result_is_two_direct_sparse_recomputes_in_turn(fitted, rho):
    """Equality, defined: after every pass the cache and the last logits are bit for bit those of a forward over
    (the kept picks + the window) from the mapped cache, then one over (the rest + the window) from there; the kept
    picks are pass 1's top m, and the rest are read from the window's attention over the refined rows."""
    _, target, _, prompts = fitted
    ids = prompts[0]
    n = len(ids)
    _, mapped, _ = _mapped(fitted, ids)
    sel = SELECTORS[NAME]
    whole, pos = torch.tensor([ids]), torch.arange(n)[None]
    staged = _copy(target, mapped, n)
    logits, p = two_pass(target, staged, whole, pos, [n], sel, rho)
    total = budget(rho, n)
    w = sel.config.split(total, n)
    m = sel.config.refined(total, w)
    window, kept, last = p.first[0], p.kept[0], p.chosen[0]
    assert window.tolist() == list(range(n - w, n)) and len(kept) == m > 0
    assert len(last) == total - 2 * w - m and set(window.tolist()) <= set(last.tolist())
    assert not set(kept.tolist()) & set(last.tolist())
    done, first = p.recomputed(0)
    assert done == sorted(kept.tolist() + last.tolist()) and first == window.tolist() * 2
    assert len(done) + len(first) == total

    # by hand: pass 1 over the mapped cache, its top m; the refining pass; the window's attention read again
    layers = captured_layers(target, sel.config.layers)
    one = _copy(target, mapped, n)
    attn, valid = first_pass(target, one, whole, newest(pos, [n], [w]), layers)
    forced = pos >= n - w
    order1 = sel.order(received_by(sel, attn, valid, one, pos), pos, forced)[0]
    top = select_top(order1, w + m)
    assert kept.tolist() == top[:m].tolist()
    direct = _copy(target, mapped, n)
    attn2 = target.forward(whole[:, top], top[None], direct, logits_at=None,
                           capture=AttnCapture(layers, torch.arange(m, m + w)[None])).attn
    again = received_by(sel, attn2, torch.ones(1, w, dtype=torch.bool), direct, pos)
    assert not torch.allclose(again, received_by(sel, attn, valid, one, pos))  # a second reading, over new rows
    order2 = sel.order(again, pos, forced | torch.isin(pos, top))[0]
    rest = select_top(order2, total - 2 * w)
    assert last.tolist() == [i for i in rest.tolist() if i not in set(top[:m].tolist())]
    want = target.forward(whole[:, last], last[None], direct).logits
    assert torch.equal(logits, want) and torch.equal(staged.k, direct.k) and torch.equal(staged.v, direct.v)
    assert torch.equal(staged.filled, direct.filled)


def test_handoff_records_and_costs_count_every_pass(fitted):
    from rarecache.transfer.costs import describe_recompute

    source, target, mapper, prompts = fitted
    for rho in (0.3, 0.5, 0.9):
        cache, logits, res = handoff(source, target, mapper, prompts, HandoffConfig(rho, NAME))
        for b, ids in enumerate(prompts):
            assert res.recomputed(b) == budget(rho, len(ids))
    t = res.timings
    assert t["recompute"] == pytest.approx(t["pass1"] + t["refine"] + t["pass2"]) and t["refine"] > 0
    _, _, res = handoff(source, target, mapper, prompts[:1], HandoffConfig(0.5, NAME))
    text = describe_recompute(target.config, 37, res.positions[0], res.first_pass[0])
    w = len(set(res.first_pass[0]))
    assert text.startswith(f"recomputed 3 passes, {2 * w} + {len(res.positions[0])} = 19 of 37 positions: "
                           f"pass 1 the newest {w}, a refining pass those again")


@pytest.mark.parametrize("rho", [0.1, 0.15, 0.3, 0.5])
def test_a_batch_is_its_rows(fitted, rho):
    """Rows of different lengths in one batch, some refined and some not (a budget too small for a window or for
    picks to refine): each row's sets, passes and logits are its own handoff's, and each spends its own budget."""
    source, target, mapper, prompts = fitted
    _, logits, res = handoff(source, target, mapper, prompts, HandoffConfig(rho, NAME))
    for b, ids in enumerate(prompts):
        _, lg, alone = handoff(source, target, mapper, [ids], HandoffConfig(rho, NAME))
        assert alone.positions[0] == res.positions[b] and alone.first_pass[0] == res.first_pass[b]
        assert res.recomputed(b) == budget(rho, len(ids))
        torch.testing.assert_close(lg[0], logits[b], atol=1e-4, rtol=0)


def test_variants_equal_one_handoff_each(fitted):
    """Beside a two-pass variant sharing its window (`query-w8`), in one evaluation: the same sets, passes, logits
    and rows as a handoff each (the refining pass writes its own copy, and its last pass starts there)."""
    source, target, mapper, prompts = fitted
    ids = prompts[0]
    n = len(ids)
    src = source.new_cache(1, n)
    out = source.forward(torch.tensor([ids]), torch.arange(n)[None], src,
                         capture=attention_capture(source, torch.tensor([n])))
    variants = [("a", HandoffConfig(rho, s)) for rho in (0.5, 0.7) for s in ("query-w8", NAME, "query")]
    cache, logits, results = handoff_variants(source, target, {"a": mapper}, ids, variants, src,
                                              source_attn=received(out.attn, n))
    for v, (_, cfg) in enumerate(variants):
        ref_cache, ref_logits, ref = handoff(source, target, mapper, [ids], cfg)
        assert results[v].positions == ref.positions and results[v].first_pass == ref.first_pass, cfg
        assert results[v].recomputed(0) == budget(cfg.rho, n)
        assert ("refine" in results[v].timings) == (cfg.selector == NAME)
        torch.testing.assert_close(logits[v], ref_logits[0], atol=1e-4, rtol=0)
        torch.testing.assert_close(cache.k[:, v, :, :n], ref_cache.k[:, 0, :, :n], atol=1e-5, rtol=0)


def test_the_vllm_adapter_refuses_it_clearly():
    from rarecache.adapters.vllm.connector.core import ENGINE_SELECTORS, check_selector

    assert NAME not in ENGINE_SELECTORS and "query-w8" in ENGINE_SELECTORS and "query-blend" not in ENGINE_SELECTORS
    with pytest.raises(RarecacheError, match="query-blend.*needs the source's attention"):
        check_selector("query-blend")
    with pytest.raises(RarecacheError, match="query-refine.*keeps a refining pass's rows"):
        check_selector(NAME)
