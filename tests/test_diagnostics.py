"""The mapping paper's diagnostics (§4.5): planted errors land where the numbers say."""

from __future__ import annotations

import copy

import torch

from rarecache.transfer.diagnostics import _k_concentration, _v_concentration, diagnose, layer_rank_scores
from rarecache.transfer.mapper import SIDES
from rarecache.transfer.selectors import rank_scores


def test_layer_rank_scores_sum_to_the_shared_score(fitted):
    source, target, mapper, prompts = fitted
    ids = prompts[0]
    cache, _ = source.prefill([ids])
    mapped = target.new_cache(1, len(ids))
    pos = torch.arange(len(ids))[None]
    centred = mapper.apply(source, cache, target, mapped, pos)
    per_layer = layer_rank_scores(mapper, centred)
    assert per_layer.shape == (target.num_layers, 1, len(ids))
    torch.testing.assert_close(per_layer.sum(0), rank_scores(mapper, centred).float(), rtol=1e-5, atol=1e-5)


def test_k_concentration_follows_the_query_directions():
    g = torch.Generator().manual_seed(0)
    D, n = 8, 50
    basis, _ = torch.linalg.qr(torch.randn(D, D, generator=g))
    scales = torch.tensor([10.0, 5, 2, 1, 1, 0.5, 0.2, 0.1])
    q = (torch.randn(2, n, D, generator=g) * scales) @ basis.T  # (H=2, n, D): both heads share one kv head
    along = lambda j: torch.randn(1, n, 1, generator=g) * basis[:, j]  # noqa: E731  error on direction j only
    top, bottom = _k_concentration(along(0), q), _k_concentration(along(D - 1), q)
    assert top.item() > 3 and bottom.item() < 0.1
    iso = _k_concentration(torch.randn(1, 4000, D, generator=g), torch.cat([q] * 80, 1)[:, :4000])
    assert 0.8 < iso.item() < 1.2  # error spread evenly: concentration near 1


def test_v_concentration_follows_the_attention():
    n = 20
    probs = torch.full((2, n, n), 0.1 / (n - 1))
    probs[..., 3] = 0.9  # every query reads position 3
    at_read = torch.zeros(1, n, 4)
    at_read[0, 3] = 1.0
    ignored = torch.zeros(1, n, 4)
    ignored[0, 10] = 1.0
    assert _v_concentration(at_read, probs).item() > 10
    assert _v_concentration(ignored, probs).item() < 0.1


def test_exact_cache_has_cosine_one_and_a_worse_map_lower(fitted):
    source, target, mapper, prompts = fitted
    d = diagnose(source, target, mapper, prompts, rho=0.3)
    assert len(d.cosine) == target.num_layers and d.prompts == 2 and d.tokens == sum(map(len, prompts))
    assert all(-1 <= c <= 1 for c in d.cosine) and all(0 <= a <= 1 for a in d.rank_agreement + d.error_agreement)

    exact = copy.copy(mapper)

    def true_rows(source_, source_cache, target_, target_cache, positions, dtype=None, tokens=None):
        out = mapper.apply(source_, source_cache, target_, target_cache, positions, dtype, tokens)
        n = int(positions.max()) + 1
        own, _ = target_.prefill([exact.ids[:n]])
        for layer in range(target_.num_layers):
            k, v = own.layer(layer, n)
            target_cache.write(layer, positions, k, v)
        return out

    for ids in prompts:
        exact.ids = ids
        exact.apply = true_rows
        e = diagnose(source, target, exact, [ids], rho=0.3)
        assert min(e.cosine) > 1 - 1e-5

    worse = copy.deepcopy(mapper)
    for s in SIDES:
        worse.sides[s].weight.mul_(0.3)
        worse._cast.clear()
    w = diagnose(source, target, worse, prompts, rho=0.3)
    assert sum(w.cosine) < sum(d.cosine)
