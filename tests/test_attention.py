"""The scattered-query kernels (engine.attention) against the dense reference on the CPU, the one place the
kernel is chosen, the FlexAttention fallback, and no host read of a device tensor inside a layer."""

from __future__ import annotations

import warnings

import pytest
import torch

from rarecache.bench.shapes import random_mapper, random_runner
from rarecache.engine import attention
from rarecache.engine.runner import Runner
from rarecache.transfer import fused
from rarecache.transfer.handoff import HandoffConfig, handoff


def scattered(g, B=2, H=4, Hkv=2, S=300, D=16, n=(130, 97), unsorted=False):
    """Random q, k, v, query positions (B, T) with padding (-1) and slots never filled."""
    k, v = torch.randn(B, Hkv, S, D, generator=g), torch.randn(B, Hkv, S, D, generator=g)
    q_pos = torch.full((B, max(n)), -1)
    for b in range(B):
        q_pos[b, : n[b]] = torch.randperm(S, generator=g)[: n[b]].sort().values
    if unsorted:
        q_pos[:, : min(n)] = q_pos[:, : min(n)].flip(1)
    filled = torch.rand(B, S, generator=g) >= 0.1
    filled[torch.arange(B)[:, None], q_pos.clamp(min=0)] = True
    return torch.randn(B, H, max(n), D, generator=g), q_pos, k, v, filled


def test_choose_is_by_device():
    assert attention.choose("cpu") == attention.BLOCKS
    assert attention.choose(torch.device("cuda", 0)) == (attention.FLEX if attention.flex_available()
                                                          else attention.DENSE)
    assert attention.choose("meta") == attention.DENSE
    assert Runner(random_runner("toy-target", torch.float32, "cpu").model).kernel == attention.BLOCKS


@pytest.mark.parametrize("unsorted", [False, True])
def test_every_kernel_equals_the_dense_reference(unsorted):
    """Blocks, FlexAttention (eager on the CPU) and the planned dense mask, over padded scattered queries."""
    g = torch.Generator().manual_seed(5)
    q, q_pos, k, v, filled = scattered(g, unsorted=unsorted)
    ref = attention.attend_dense(q, q_pos, k, v, filled)
    valid = (q_pos >= 0)[:, None, :, None]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # FlexAttention says it is not compiled: it is the eager reference here
        for kind in (attention.BLOCKS, attention.FLEX, attention.DENSE):
            plan = attention.prepare(kind, q_pos, filled, plain=False)
            assert plan.kind == kind
            out, _ = attention.attend(q, q_pos, k, v, filled, plan=plan)
            torch.testing.assert_close(out * valid, ref * valid, atol=1e-5, rtol=0)
    out, _ = attention.attend(q, q_pos, k, v, filled)  # unplanned: the device's kernel, planned here
    torch.testing.assert_close(out * valid, ref * valid, atol=1e-5, rtol=0)
    # a few queries and a plain prefill take the small dense kernel and the causal one on every device
    assert attention.prepare(attention.FLEX, q_pos[:, :20], filled, plain=False).kind == attention.DENSE
    S = k.shape[2]
    assert attention.prepare(attention.FLEX, torch.arange(S).expand(2, S), torch.ones(2, S, dtype=torch.bool)
                             ).kind == attention.CAUSAL


def test_block_lengths_are_each_blocks_highest_position():
    g = torch.Generator().manual_seed(2)
    _, q_pos, *_ = scattered(g)
    lengths = attention.block_lengths(q_pos)
    assert len(lengths) == -(-q_pos.shape[1] // attention.QUERY_BLOCK)
    for j, length in enumerate(lengths):
        block = q_pos[:, j * attention.QUERY_BLOCK : (j + 1) * attention.QUERY_BLOCK]
        assert length == max(int(block.max()) + 1, 1)
    assert attention.block_lengths(torch.full((2, 40), -1)) == (1, 1)


def test_query_blocks_coalesce_blocks_with_close_key_ranges():
    """Calls cover every query in order, each over keys past its queries' positions, computing at most
    MERGE_SLACK more pairs than the 32-query blocks apart; a suffix over a long prefix is one call, queries
    spread from position 0 are several."""
    g = torch.Generator().manual_seed(2)
    _, spread, *_ = scattered(g)
    suffix = torch.arange(700, 1000).expand(2, 300)
    for q_pos in (spread, suffix):
        calls, start = attention.query_blocks(q_pos), 0
        for end, length in calls:
            assert end > start and length >= int(q_pos[:, start:end].max()) + 1
            start = end
        assert start == q_pos.shape[1]
        B = attention.QUERY_BLOCK
        apart = sum(min(B, q_pos.shape[1] - j * B) * n for j, n in enumerate(attention.block_lengths(q_pos)))
        starts = [0] + [e for e, _ in calls[:-1]]
        assert sum((e - s) * n for s, (e, n) in zip(starts, calls)) <= (1 + attention.MERGE_SLACK) * apart
    assert len(attention.query_blocks(suffix)) == 1 < len(attention.query_blocks(spread))


def test_a_prefix_query_set_over_a_longer_cache_takes_the_causal_kernel():
    """Queries at 0..T-1 over a cache allocated longer (its later slots empty, or filled by someone else:
    no query sees them) run the causal kernel, and equal the dense reference; a hole before T does not."""
    g = torch.Generator().manual_seed(3)
    T, S = 50, 80
    q, k, v = torch.randn(1, 4, T, 16, generator=g), torch.randn(1, 2, S, 16, generator=g), torch.randn(1, 2, S, 16,
                                                                                                       generator=g)
    q_pos = torch.arange(T)[None]
    for filled in (torch.arange(S)[None] < T, torch.arange(S)[None] < T + 10):
        assert attention.prepare(attention.BLOCKS, q_pos, filled).kind == attention.CAUSAL
        out, _ = attention.attend(q, q_pos, k, v, filled)
        torch.testing.assert_close(out, attention.attend_dense(q, q_pos, k, v, filled), atol=1e-5, rtol=0)
    holed = torch.arange(S)[None] < T
    holed[0, 7] = False
    assert attention.prepare(attention.BLOCKS, q_pos, holed).kind == attention.BLOCKS


def test_a_flex_failure_falls_back_to_the_dense_mask_and_is_recorded(monkeypatch):
    import torch.nn.attention.flex_attention as flex

    def broken(*_, **__):
        raise RuntimeError("no kernel for you")

    monkeypatch.setattr(flex, "flex_attention", broken)
    monkeypatch.setattr(attention, "FAILURES", [])
    g = torch.Generator().manual_seed(8)
    q, q_pos, k, v, filled = scattered(g)
    plan = attention.prepare(attention.FLEX, q_pos, filled, plain=False)
    out, _ = attention.attend(q, q_pos, k, v, filled, plan=plan)
    valid = (q_pos >= 0)[:, None, :, None]
    torch.testing.assert_close(out * valid, attention.attend_dense(q, q_pos, k, v, filled) * valid, atol=1e-5,
                               rtol=0)
    assert len(attention.FAILURES) == 1 and "no kernel for you" in attention.FAILURES[0]
    assert attention.choose("cuda") == attention.DENSE  # every later pass on a GPU takes the dense mask


class HostReads:
    """Counts reads of tensor values by the host (item, tolist, bool, int, float, cpu, numpy) while `on`."""

    NAMES = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy")

    def __init__(self, monkeypatch):
        self.on, self.reads = False, []
        for name in self.NAMES:
            original = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._wrap(name, original))

    def _wrap(self, name, original):
        def read(t, *a, **kw):
            if self.on:
                self.reads.append(name)
            return original(t, *a, **kw)

        return read

    def around(self, owner, monkeypatch, name):
        """Count inside every call of owner.name."""
        original = getattr(owner, name)

        def counted(*a, **kw):
            self.on = True
            try:
                return original(*a, **kw)
            finally:
                self.on = False

        monkeypatch.setattr(owner, name, counted)


def test_no_layer_reads_the_device(monkeypatch):
    """Inside a layer (qkv, cache write, attention, MLP) of a prefill, a scattered recompute, a handoff and
    the map's per-layer writes, the host reads no tensor value: on a GPU each read waits for its queue."""
    torch.manual_seed(0)
    source, target = (random_runner(n, torch.float32, "cpu") for n in ("toy-source", "toy-target"))
    mapper = random_mapper(source, target, k=2, rank=8)
    prompts = torch.randint(0, 512, (2, 150), generator=torch.Generator().manual_seed(1)).tolist()
    prompts[1] = prompts[1][:117]
    counter = HostReads(monkeypatch)
    counter.around(Runner, monkeypatch, "layer")
    counter.around(fused, monkeypatch, "_write")
    own, _ = target.prefill(prompts)
    for selector in ("rank", "suffix"):
        cache, logits, res = handoff(source, target, mapper, prompts, HandoffConfig(rho=0.5, selector=selector))
        assert len(res.positions[0]) == 75 > attention.QUERY_BLOCK  # query blocks, not the small dense kernel
    assert counter.reads == []
    counter.on = True  # the counter can fail: the unplanned path reads the positions' blocks on the host
    q = torch.randn(1, 6, 40, 16)
    kv = torch.randn(1, 2, 150, 16)
    attention.attend(q, torch.arange(0, 120, 3)[None], kv, kv, torch.ones(1, 150, dtype=torch.bool), plain=False)
    counter.on = False
    assert "cpu" in counter.reads


def test_a_planned_recompute_equals_the_reference_path():
    """The handoff's recompute through the planned kernel (blocks here, FlexAttention forced) equals the
    dense-mask reference, cache rows and logits."""
    torch.manual_seed(0)
    source, target = (random_runner(n, torch.float32, "cpu") for n in ("toy-source", "toy-target"))
    mapper = random_mapper(source, target, k=2, rank=8)
    prompts = torch.randint(0, 512, (2, 160), generator=torch.Generator().manual_seed(2)).tolist()
    prompts[1] = prompts[1][:101]
    cfg = HandoffConfig(rho=0.3, selector="rank")
    target.attention = attention.attend_reference
    ref_cache, ref, ref_res = handoff(source, target, mapper, prompts, cfg)
    target.attention = attention.attend
    for kind in (attention.BLOCKS, attention.FLEX):
        target.kernel = kind
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cache, logits, res = handoff(source, target, mapper, prompts, cfg)
        assert res.positions == ref_res.positions
        torch.testing.assert_close(logits, ref, atol=1e-5, rtol=0)
        for b, n in enumerate((160, 101)):
            torch.testing.assert_close(cache.k[:, b, :, :n], ref_cache.k[:, b, :, :n], atol=1e-5, rtol=0)
            torch.testing.assert_close(cache.v[:, b, :, :n], ref_cache.v[:, b, :, :n], atol=1e-5, rtol=0)
