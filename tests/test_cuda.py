"""The exactness checks again on a GPU: the runner against transformers, the fast attention paths against
the dense reference, and the handoff's ρ = 1 against the target's own prefill, all on CUDA, at tiny shapes
and at the papers' widths (random weights, a few layers).

Every fast path is tested on the CPU elsewhere; the CUDA kernels (causal and masked SDPA, index_copy into
the cache, the map's batched products) are other code, so they get their own run. Skipped where there is
no GPU (CI); `scripts/gpu.sh` runs them on one.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from rarecache.engine import attention
from rarecache.engine.runner import Runner
from rarecache.transfer.handoff import HandoffConfig, handoff

from .test_runner import ATOL, assert_matches_transformers, full_forward

CUDA = os.environ.get("RARECACHE_TEST_DEVICE", "cuda")  # =cpu: a smoke run of this file where there is no GPU
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(CUDA == "cuda" and not torch.cuda.is_available(),
                                                   reason="needs a CUDA GPU")]


@pytest.fixture(autouse=True)
def _fp32_matmuls():
    """TF32 off: the comparisons below are against float32 references."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def test_runner_matches_transformers_on_cuda(tiny):
    _, path, hf = tiny
    runner = Runner.load(path, device=CUDA)
    assert runner.device.type == torch.device(CUDA).type
    assert_matches_transformers(runner, hf.to(CUDA))


def test_scattered_recompute_over_a_cuda_cache_equals_full_forward(tiny):
    _, path, _ = tiny
    runner = Runner.load(path, device=CUDA)
    T = 80
    tokens = torch.randint(0, 97, (1, T), generator=torch.Generator().manual_seed(4))
    own, full = full_forward(runner, tokens)
    subset = torch.tensor([[0, 5, 6, 13, 20, 21, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46, 47, 48,
                            49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 70, 79]])  # > one query block
    cache = runner.new_cache(1, T)
    for name in ("k", "v", "filled"):
        getattr(cache, name).copy_(getattr(own, name))
    cache.k[:, :, :, subset[0]] = 1e3  # garbage the pass must overwrite before anyone reads it
    cache.v[:, :, :, subset[0]] = -1e3
    out = runner.forward(tokens[:, subset[0]], subset, cache, logits_at="all")
    torch.testing.assert_close(out.logits, full[:, subset[0]], atol=ATOL, rtol=0)
    torch.testing.assert_close(cache.k, own.k, atol=ATOL, rtol=0)
    torch.testing.assert_close(cache.v, own.v, atol=ATOL, rtol=0)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_fast_attention_paths_equal_the_dense_reference_on_cuda(dtype, atol):
    """The causal kernel, the dense mask `attend` takes on a GPU and the CPU's query blocks against the dense
    reference, CUDA kernels."""
    g = torch.Generator().manual_seed(9)
    B, H, Hkv, S, D = 2, 8, 2, 700, 128

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(CUDA, dtype)

    k, v, q = rand(B, Hkv, S, D), rand(B, Hkv, S, D), rand(B, H, S, D)
    filled = torch.ones(B, S, dtype=torch.bool, device=CUDA)
    pos = torch.arange(S, device=CUDA).expand(B, S)
    out, _ = attention.attend(q, pos, k, v, filled)
    torch.testing.assert_close(out, attention.attend_dense(q, pos, k, v, filled), atol=atol, rtol=0)
    for n in ([300, 260], [40, 700]):
        q_pos = torch.full((B, max(n)), -1)
        for b in range(B):
            q_pos[b, : n[b]] = torch.randperm(S, generator=g)[: n[b]].sort().values
        f = filled & (torch.rand(B, S, generator=g) >= 0.1).to(CUDA)  # some slots never filled
        q_pos = q_pos.to(CUDA)
        f[torch.arange(B, device=CUDA)[:, None], q_pos.clamp(min=0)] = True
        qq = rand(B, H, max(n), D)
        ref = attention.attend_dense(qq, q_pos, k, v, f)
        valid = (q_pos >= 0)[:, None, :, None]
        # the device's choice (FlexAttention on CUDA), FlexAttention itself, and the CPU's blocks
        for path in (attention.attend, attention.attend_flex, attention.attend_sparse):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # off CUDA FlexAttention runs eagerly, and says so
                fast, _ = path(qq, q_pos, k, v, f)
            torch.testing.assert_close(fast * valid, ref * valid, atol=atol, rtol=0)


def test_flex_attention_compiles_and_is_chosen_on_cuda():
    """On CUDA `choose` picks FlexAttention, and it compiles: a failure would fall back to the dense mask
    (exact, recorded in attention.FAILURES, which this test shows)."""
    g = torch.Generator().manual_seed(3)
    B, H, Hkv, S, T, D = 2, 8, 2, 500, 160, 128
    k, v = (torch.randn(B, Hkv, S, D, generator=g).to(CUDA) for _ in range(2))
    q = torch.randn(B, H, T, D, generator=g).to(CUDA)
    q_pos = torch.stack([torch.randperm(S, generator=g)[:T].sort().values for _ in range(B)]).to(CUDA)
    filled = torch.ones(B, S, dtype=torch.bool, device=CUDA)
    plan = attention.prepare(attention.choose(CUDA), q_pos, filled, plain=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out, _ = attention.attend(q, q_pos, k, v, filled, plan=plan)
    torch.testing.assert_close(out, attention.attend_dense(q, q_pos, k, v, filled), atol=1e-5, rtol=0)
    if CUDA == "cuda":
        assert plan.kind == attention.FLEX
        assert attention.FAILURES == []


def test_no_sync_inside_a_layer_on_cuda(monkeypatch):
    """A handoff (map, score, recompute) runs its layers without waiting for the device: CUDA's sync debug
    mode raises on any synchronising call inside a layer or the map's per-layer writes (on the CPU smoke
    run, the host-read counter of tests/test_attention.py)."""
    from rarecache.bench.shapes import random_mapper, random_runner
    from rarecache.transfer import fused

    from .test_attention import HostReads

    torch.manual_seed(0)
    source, target = (random_runner(n, torch.float32, CUDA) for n in ("toy-source", "toy-target"))
    mapper = random_mapper(source, target, k=2, rank=8)
    prompts = torch.randint(0, 512, (2, 300), generator=torch.Generator().manual_seed(1)).tolist()
    prompts[1] = prompts[1][:211]
    counter = HostReads(monkeypatch) if CUDA != "cuda" else None

    def guarded(owner, name):
        original = getattr(owner, name)

        def call(*a, **kw):
            if counter is not None:
                counter.on = True
            else:
                torch.cuda.set_sync_debug_mode("error")
            try:
                return original(*a, **kw)
            finally:
                if counter is not None:
                    counter.on = False
                else:
                    torch.cuda.set_sync_debug_mode("default")

        monkeypatch.setattr(owner, name, call)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for guard in (False, True):  # unguarded first: compiling FlexAttention may wait for the device
            if guard:
                guarded(type(target), "layer")
                guarded(fused, "_write")
            for selector in ("rank", "suffix"):
                handoff(source, target, mapper, prompts, HandoffConfig(rho=0.3, selector=selector))
    assert counter is None or counter.reads == []
    assert attention.FAILURES == []  # (a sync inside FlexAttention would have been caught there and recorded)


def test_rho_one_equals_the_targets_prefill_on_cuda(fitted):
    _, _, mapper, prompts = fitted
    source, target = (Runner(r.model.to(CUDA), r.path) for r in fitted[:2])
    try:
        cache, logits, res = handoff(source, target, mapper, prompts, HandoffConfig(rho=1.0))
        own, out = target.prefill(prompts, max_len=37)
        assert logits.device.type == torch.device(CUDA).type
        torch.testing.assert_close(logits, out.logits, atol=1e-5, rtol=0)
        for b, n in enumerate((37, 23)):
            torch.testing.assert_close(cache.k[:, b, :, :n], own.k[:, b, :, :n], atol=1e-5, rtol=0)
            torch.testing.assert_close(cache.v[:, b, :, :n], own.v[:, b, :, :n], atol=1e-5, rtol=0)
        # plain transfer on the GPU maps the same rows as on the CPU
        cpu_cache, _, _ = handoff(*(Runner(r.model.to("cpu"), r.path) for r in (source, target)), mapper, prompts,
                                  HandoffConfig(rho=0.0, selector="rank"))
        source, target = (Runner(r.model.to(CUDA), r.path) for r in (source, target))
        gpu_cache, _, _ = handoff(source, target, mapper, prompts, HandoffConfig(rho=0.0, selector="rank"))
        for b, n in enumerate((37, 23)):  # (the spare slot past the last position holds padding's rows)
            torch.testing.assert_close(gpu_cache.k[:, b, :, :n].cpu(), cpu_cache.k[:, b, :, :n], atol=1e-4, rtol=0)
            torch.testing.assert_close(gpu_cache.v[:, b, :, :n].cpu(), cpu_cache.v[:, b, :, :n], atol=1e-4, rtol=0)
    finally:
        for r in fitted[:2]:
            r.model.to("cpu")


@pytest.mark.parametrize("selector", ["rank", "suffix"])
def test_paper_widths_on_cuda(selector):
    """Qwen3-0.6B -> 14B widths (two layers each, random weights and map): ρ = 1 is the target's own prefill,
    and at ρ 0.3 the recompute through `attend` and through the query blocks equals the dense-mask one."""
    from rarecache.bench.shapes import random_mapper, random_runner

    torch.manual_seed(0)
    source, target = (random_runner(n, torch.float32, CUDA, max_layers=2) for n in ("qwen3-0.6b", "qwen3-14b"))
    mapper = random_mapper(source, target, rank=32)
    prompts = torch.randint(0, 151936, (2, 300), generator=torch.Generator().manual_seed(3)).tolist()
    prompts[1] = prompts[1][:211]
    cache, logits, _ = handoff(source, target, mapper, prompts, HandoffConfig(rho=1.0, selector=selector))
    own, out = target.prefill(prompts, max_len=300)
    torch.testing.assert_close(logits, out.logits, atol=1e-4, rtol=0)
    for b, n in enumerate((300, 211)):
        torch.testing.assert_close(cache.k[:, b, :, :n], own.k[:, b, :, :n], atol=1e-4, rtol=0)
    cfg = HandoffConfig(rho=0.3, selector=selector)
    fast_cache, fast, fast_res = handoff(source, target, mapper, prompts, cfg)
    for other in (attention.attend_reference, attention.attend_sparse):
        target.attention = other
        try:
            ref_cache, ref, ref_res = handoff(source, target, mapper, prompts, cfg)
        finally:
            target.attention = attention.attend
        assert fast_res.positions == ref_res.positions
        torch.testing.assert_close(fast, ref, atol=1e-4, rtol=0)
        for b, n in enumerate((300, 211)):
            torch.testing.assert_close(fast_cache.k[:, b, :, :n], ref_cache.k[:, b, :, :n], atol=1e-4, rtol=0)
