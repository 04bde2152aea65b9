"""The runner against transformers and against itself on tiny random models."""

from __future__ import annotations

import pytest
import torch

from rarecache.engine.generate import SamplingConfig, decode, generate
from rarecache.engine.runner import AttnCapture, Runner, pad_batch
from rarecache.models.packed import PackedLinear, can_pack

ATOL = 1e-4


def full_forward(runner: Runner, tokens: torch.Tensor):
    cache = runner.new_cache(tokens.shape[0], tokens.shape[1])
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    out = runner.forward(tokens, positions, cache, logits_at="all")
    return cache, out.logits


def assert_matches_transformers(runner: Runner, hf) -> None:
    """The runner's logits and every layer's K and V against transformers' model on the runner's device."""
    tokens = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(tokens.to(runner.device), use_cache=True)
    cache, logits = full_forward(runner, tokens)
    assert logits.device == runner.device
    torch.testing.assert_close(logits, ref.logits, atol=ATOL, rtol=0)
    for i, layer in enumerate(ref.past_key_values.layers):
        k, v = cache.layer(i, 40)
        torch.testing.assert_close(k, layer.keys, atol=ATOL, rtol=0)
        torch.testing.assert_close(v, layer.values, atol=ATOL, rtol=0)


def test_logits_and_kv_match_transformers(tiny):
    _, path, hf = tiny
    assert_matches_transformers(Runner.load(path), hf)


def test_attention_capture_matches_transformers(tiny):
    _, path, hf = tiny
    hf.set_attn_implementation("eager")
    runner = Runner.load(path)
    tokens = torch.randint(0, 97, (1, 30), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf(tokens, output_attentions=True).attentions
    rows = torch.tensor([[3, 17, 29]])
    cache = runner.new_cache(1, 30)
    out = runner.forward(tokens, torch.arange(30)[None], cache, capture=AttnCapture(frozenset({0, 2}), rows))
    assert sorted(out.attn) == [0, 2]
    for i in (0, 2):
        torch.testing.assert_close(out.attn[i], ref[i][:, :, rows[0]], atol=ATOL, rtol=0)


def test_incremental_decode_equals_full_forward(tiny):
    _, path, _ = tiny
    runner = Runner.load(path)
    tokens = torch.randint(0, 97, (1, 24), generator=torch.Generator().manual_seed(3))
    _, full = full_forward(runner, tokens)
    cache = runner.new_cache(1, 24)
    out = runner.forward(tokens[:, :10], torch.arange(10)[None], cache)
    torch.testing.assert_close(out.logits, full[:, 9], atol=ATOL, rtol=0)
    for p in range(10, 24):
        out = runner.forward(tokens[:, p : p + 1], torch.tensor([[p]]), cache)
        torch.testing.assert_close(out.logits, full[:, p], atol=ATOL, rtol=0)


def test_scattered_subset_over_prefilled_cache_equals_full_forward(tiny):
    _, path, _ = tiny
    runner = Runner.load(path)
    T = 32
    tokens = torch.randint(0, 97, (1, T), generator=torch.Generator().manual_seed(4))
    own, full = full_forward(runner, tokens)
    subset = torch.tensor([[0, 5, 6, 13, 20, 21, 31]])
    cache = runner.new_cache(1, T)
    cache.k.copy_(own.k)
    cache.v.copy_(own.v)
    cache.filled.copy_(own.filled)
    # garbage in the subset's rows: the pass must overwrite them before anyone reads them
    cache.k[:, :, :, subset[0]] = 1e3
    cache.v[:, :, :, subset[0]] = -1e3
    out = runner.forward(tokens[:, subset[0]], subset, cache, logits_at="all")
    torch.testing.assert_close(out.logits, full[:, subset[0]], atol=ATOL, rtol=0)
    torch.testing.assert_close(cache.k, own.k, atol=ATOL, rtol=0)
    torch.testing.assert_close(cache.v, own.v, atol=ATOL, rtol=0)


def test_unfilled_slots_are_invisible(tiny):
    """A query sees only filled slots: leaving a slot unfilled equals dropping that token."""
    _, path, _ = tiny
    runner = Runner.load(path)
    tokens = torch.randint(0, 97, (1, 12), generator=torch.Generator().manual_seed(5))
    keep = [i for i in range(12) if i != 4]
    cache = runner.new_cache(1, 12)
    out = runner.forward(tokens[:, keep], torch.tensor([keep]), cache)
    assert not cache.filled[0, 4] and cache.filled[0, keep].all()
    # same computation by hand: attention over the remaining positions only
    ref_cache = runner.new_cache(1, 12)
    pos = torch.tensor([keep])
    h = runner.embed(tokens[:, keep])
    ref_cache.mark(pos)
    for i in range(runner.num_layers):
        q, k, v = runner.qkv(i, h, runner.cos_sin(pos))
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        h = runner.finish(i, h, a)
    torch.testing.assert_close(out.logits, runner.logits(h, pos), atol=ATOL, rtol=0)


def test_padded_batch_equals_single_runs(tiny):
    _, path, _ = tiny
    runner = Runner.load(path)
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (5, 17, 11)]
    _, batch = runner.prefill(prompts)  # on a CPU: one prompt at a time into row views
    padded = runner.forward(*pad_batch(prompts), runner.new_cache(3, 17))  # one right-padded pass
    for b, p in enumerate(prompts):
        _, single = runner.prefill([p])
        torch.testing.assert_close(batch.logits[b], single.logits[0], atol=ATOL, rtol=0)
        torch.testing.assert_close(padded.logits[b], single.logits[0], atol=ATOL, rtol=0)
    cfg = SamplingConfig(max_new_tokens=8)
    batched = generate(runner, prompts, cfg)
    for b, p in enumerate(prompts):
        assert batched[b].tokens == generate(runner, [p], cfg)[0].tokens


def test_greedy_generation_matches_transformers(tiny):
    _, path, hf = tiny
    runner = Runner.load(path)
    prompt = torch.randint(0, 97, (1, 9), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        ref = hf.generate(prompt, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    ours = generate(runner, prompt.tolist(), SamplingConfig(max_new_tokens=12))[0]
    assert ours.tokens == ref[0, 9:].tolist() and ours.finish_reason == "length"


def test_sampling_is_seeded_and_stops(tiny):
    _, path, _ = tiny
    runner = Runner.load(path)
    prompt = [[1, 2, 3, 4]]
    cfg = SamplingConfig(max_new_tokens=10, temperature=1.0, top_p=0.9, seed=11)
    a, b = generate(runner, prompt, cfg)[0], generate(runner, prompt, cfg)[0]
    assert a.tokens == b.tokens
    # a vanishing top_p keeps only the top token: sampling becomes greedy
    greedy = generate(runner, prompt, SamplingConfig(max_new_tokens=10))[0]
    assert generate(runner, prompt, SamplingConfig(max_new_tokens=10, temperature=1.0, top_p=1e-6))[0].tokens == greedy.tokens
    # stopping on the third greedy token ends before it, reason "stop"
    stop = greedy.tokens[2]
    first = greedy.tokens.index(stop)
    stopped = generate(runner, prompt, SamplingConfig(max_new_tokens=10, stop_token_ids=(stop,)))[0]
    assert stopped.tokens == greedy.tokens[:first] and stopped.finish_reason == "stop"


def test_decode_continues_from_given_cache(tiny):
    """decode() from a prefilled cache equals generate() (the path a handoff takes)."""
    _, path, _ = tiny
    runner = Runner.load(path)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12]]
    cfg = SamplingConfig(max_new_tokens=6)
    tokens, positions = pad_batch(prompts)
    cache = runner.new_cache(2, 5 + 6)
    first = runner.forward(tokens, positions, cache)
    out = decode(runner, cache, first.logits, torch.tensor([3, 5]), cfg)
    assert [g.tokens for g in out] == [g.tokens for g in generate(runner, prompts, cfg)]


def test_bf16_close_to_fp32(tiny):
    _, path, _ = tiny
    tokens = torch.randint(0, 97, (1, 16), generator=torch.Generator().manual_seed(8))
    _, ref = full_forward(Runner.load(path), tokens)
    _, low = full_forward(Runner.load(path, dtype=torch.bfloat16), tokens)
    assert low.dtype == torch.float32
    assert (low - ref).abs().max() < 0.1 * ref.abs().max()


def test_fast_attention_paths_equal_the_dense_reference():
    """Plain prefill (causal kernel) and scattered queries (sparse-causal blocks) vs the dense mask."""
    from rarecache.engine import attention

    g = torch.Generator().manual_seed(9)
    B, H, Hkv, S, D = 2, 4, 2, 600, 16
    k, v = torch.randn(B, Hkv, S, D, generator=g), torch.randn(B, Hkv, S, D, generator=g)
    filled = torch.ones(B, S, dtype=torch.bool)
    pos = torch.arange(S).expand(B, S)
    q = torch.randn(B, H, S, D, generator=g)
    out, _ = attention.attend(q, pos, k, v, filled)
    torch.testing.assert_close(out, attention.attend_dense(q, pos, k, v, filled), atol=1e-5, rtol=0)
    for trial in range(4):
        n = [300, 260]
        q_pos = torch.full((B, max(n)), -1)
        for b in range(B):
            q_pos[b, : n[b]] = torch.randperm(S, generator=g)[: n[b]].sort().values
        if trial == 3:  # unsorted queries are still exact
            q_pos[:, : min(n)] = q_pos[:, : min(n)].flip(1)
        holes = torch.rand(B, S, generator=g) < 0.1  # some slots never filled
        f = filled & ~holes
        f[torch.arange(B)[:, None], q_pos.clamp(min=0)] = True
        qq = torch.randn(B, H, max(n), D, generator=g)
        fast, _ = attention.attend(qq, q_pos, k, v, f)
        ref = attention.attend_dense(qq, q_pos, k, v, f)
        valid = (q_pos >= 0)[:, None, :, None]
        torch.testing.assert_close(fast * valid, ref * valid, atol=1e-5, rtol=0)


def test_stop_check_ends_a_row(tiny):
    _, path, _ = tiny
    runner = Runner.load(path)
    greedy = generate(runner, [[1, 2, 3]], SamplingConfig(max_new_tokens=8))[0].tokens
    cache, first = runner.prefill([[1, 2, 3]], max_len=11)
    out = decode(runner, cache, first.logits, torch.tensor([3]), SamplingConfig(max_new_tokens=8),
                 stop_check=lambda toks: len(toks) == 3)[0]
    assert out.tokens == greedy[:3] and out.finish_reason == "stop"


@pytest.mark.skipif(not can_pack(torch.bfloat16, "cpu"), reason="no oneDNN packing on this machine")
def test_packed_linear_equals_f_linear():
    """The prepacked bf16 product runs the same oneDNN kernel as F.linear: equal to the last bit."""
    g = torch.Generator().manual_seed(3)
    for bias in (True, False):
        lin = torch.nn.Linear(48, 80, bias=bias).to(torch.bfloat16)
        packed = PackedLinear(lin.weight, lin.bias)
        for shape in ((1, 48), (5, 48), (2, 33, 48)):
            x = torch.randn(*shape, generator=g).to(torch.bfloat16)
            torch.testing.assert_close(packed(x), lin(x), atol=0, rtol=0)
        x = torch.randn(7, 2, 48, generator=g).to(torch.bfloat16).transpose(0, 1)  # not contiguous: packed
        torch.testing.assert_close(packed(x), lin(x.contiguous()), atol=0, rtol=0)  # copies it first


@pytest.mark.skipif(not can_pack(torch.bfloat16, "cpu"), reason="no oneDNN packing on this machine")
def test_packed_runner_equals_plain_runner(tiny):
    _, path, _ = tiny
    fast, plain = Runner.load(path, dtype=torch.bfloat16), Runner.load(path, dtype=torch.bfloat16, pack=False)
    assert fast.packed and not plain.packed and not Runner.load(path).packed  # float32 stays unpacked
    assert any(isinstance(m, PackedLinear) for m in fast.model.layers.modules())
    assert isinstance(fast.model.packed_head, PackedLinear) and plain.model.packed_head is None
    tokens = torch.randint(0, 97, (2, 30), generator=torch.Generator().manual_seed(4))
    (c1, l1), (c2, l2) = full_forward(fast, tokens), full_forward(plain, tokens)
    torch.testing.assert_close(l1, l2, atol=0, rtol=0)
    torch.testing.assert_close(c1.k, c2.k, atol=0, rtol=0)
    torch.testing.assert_close(c1.v, c2.v, atol=0, rtol=0)
    cfg = SamplingConfig(max_new_tokens=6)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12]]
    assert [g.tokens for g in generate(fast, prompts, cfg)] == [g.tokens for g in generate(plain, prompts, cfg)]
    assert Runner.load(path, pack=True).packed  # float32 packs only when asked (tests/test_bench_handoff.py)


@pytest.mark.parametrize("pack", [False, None])  # None: packed where this CPU packs bf16
def test_float32_logits_keep_what_a_bf16_head_rounds(tiny, pack):
    """A bf16 model's own head rounds every logit to bf16 (choices a few hundredths apart tie); inside
    `float32_logits` the same normed rows and weight are summed in float32: equal to a float64 product to
    float32 rounding, off bf16's grid, and a packed untied model keeps the plain head it reads."""
    _, path, _ = tiny
    runner = Runner.load(path, dtype=torch.bfloat16, pack=pack)
    normed = []
    hook = runner.model.model.norm.register_forward_hook(lambda mod, args, out: normed.append(out))
    tokens = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(5))
    _, own = full_forward(runner, tokens)
    with runner.float32_logits():
        _, exact = full_forward(runner, tokens)
    hook.remove()
    assert not runner.float32_head and own.dtype == exact.dtype == torch.float32
    want = (normed[-1].double() @ runner.model.head_weight.double().T).float()  # (B, T, V)
    torch.testing.assert_close(exact, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(own, own.bfloat16().float())  # the model's own head: on bf16's grid
    assert not torch.equal(exact, exact.bfloat16().float())
    torch.testing.assert_close(own, want, atol=0, rtol=2 ** -8)  # within bf16's rounding of the same product
    with runner.float32_logits(), runner.float32_logits():
        pass
    assert not runner.float32_head  # nested uses restore what was there


def test_packing_default_is_by_dtype_device_and_capability(tiny, monkeypatch):
    """One rule (`packs_by_default`): bfloat16 packs on a CPU whose oneDNN packs it, float32 and other devices
    never unless asked; a CPU that cannot pack bf16 (mocked) loads it unpacked."""
    from rarecache.models import packed

    _, path, _ = tiny
    assert not packed.packs_by_default(torch.float32, "cpu") and not packed.packs_by_default(torch.bfloat16, "meta")
    assert packed.packs_by_default(torch.bfloat16, "cpu") == can_pack(torch.bfloat16, "cpu")
    assert Runner.load(path, dtype=torch.bfloat16).packed == can_pack(torch.bfloat16, "cpu")
    monkeypatch.setattr(packed, "_cpu_packs_bf16", lambda: False)
    assert not packed.packs_by_default(torch.bfloat16, "cpu") and not Runner.load(path, dtype=torch.bfloat16).packed


def test_decode_step_over_separate_caches_equals_each_row_alone(tiny):
    """The scheduler's step: one token for each of three sequences held in their own caches, the
    linear layers batched, equals `forward` on each alone (logits and the rows written), and a
    `Row` sampling from its own logits draws what `decode` of that row alone draws."""
    from rarecache.engine.generate import Row

    _, path, _ = tiny
    runner = Runner.load(path)
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (4, 13, 9)]
    steps = 5
    mine, alone = [], []
    for p in prompts:
        mine.append(runner.prefill([p], max_len=len(p) + steps)[0])
        alone.append(runner.prefill([p], max_len=len(p) + steps)[0])
    tokens = torch.tensor([p[-1] for p in prompts])
    for s in range(steps):
        positions = torch.tensor([len(p) + s for p in prompts])
        got = runner.decode_step(tokens, positions, mine)
        for b in range(3):
            want = runner.forward(tokens[b].view(1, 1), positions[b].view(1, 1), alone[b]).logits
            torch.testing.assert_close(got[b : b + 1], want, atol=ATOL, rtol=0)
        tokens = got.argmax(-1)
    for c1, c2 in zip(mine, alone):
        torch.testing.assert_close(c1.k, c2.k, atol=ATOL, rtol=0)
        torch.testing.assert_close(c1.v, c2.v, atol=ATOL, rtol=0)
        assert torch.equal(c1.filled, c2.filled)
    with pytest.raises(ValueError, match="^decode_step needs one token, one position and one cache per sequence$"):
        runner.decode_step(tokens, torch.tensor([1, 2]), mine)

    cfg = SamplingConfig(max_new_tokens=7, temperature=1.0, top_p=0.9, seed=5)
    cache, first = runner.prefill([prompts[1]], max_len=len(prompts[1]) + 7)
    row, logits, pos = Row(cfg), first.logits, len(prompts[1])
    while row.take(logits):
        logits = runner.decode_step(torch.tensor(row.tokens[-1:]), torch.tensor([pos]), [cache])
        pos += 1
    assert row.tokens == generate(runner, [prompts[1]], cfg)[0].tokens and row.finish_reason == "length"
    assert row.fed == row.tokens[:-1]  # the last sampled token was never fed


def test_a_pass_reads_its_positions_on_the_host_once(tiny, monkeypatch):
    """A forward pass (and a decode step) reads what its layers need about the positions once, on the host
    (`Step`), instead of asking the device at every layer (a GPU waits for its queue there): the per-layer
    device check is never called, and prefill, a scattered recompute and a decode step give what they gave."""
    from rarecache.engine import attention
    from rarecache.engine.runner import Step

    _, path, _ = tiny
    runner = Runner.load(path)
    runner.attention = lambda *a, plain=None, plan=None, **kw: attention.attend(*a, **kw)  # checked per layer
    tokens = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(11))
    own, full = full_forward(runner, tokens)
    subset = torch.tensor([[3, 4, 9, 20, 39], [0, 1, 2, 33, 38]])
    cache = runner.new_cache(2, 40)
    for name in ("k", "v", "filled"):
        getattr(cache, name).copy_(getattr(own, name))
    before = runner.forward(tokens.gather(1, subset), subset, cache, logits_at="all").logits
    step_logits = runner.decode_step(tokens[:, 39], torch.tensor([39, 39]), [own.row(0), own.row(1)])

    def device_check(*_):
        raise AssertionError("the plain-prefill check ran on the device inside a pass")

    runner.attention = attention.attend
    monkeypatch.setattr(attention, "_is_plain_prefill", device_check)
    _, again = full_forward(runner, tokens)
    torch.testing.assert_close(again, full, atol=0, rtol=0)
    cache = runner.new_cache(2, 40)
    for name in ("k", "v", "filled"):
        getattr(cache, name).copy_(getattr(own, name))
    torch.testing.assert_close(runner.forward(tokens.gather(1, subset), subset, cache, logits_at="all").logits,
                               before, atol=0, rtol=0)
    torch.testing.assert_close(runner.decode_step(tokens[:, 39], torch.tensor([39, 39]), [own.row(0), own.row(1)]),
                               step_logits, atol=0, rtol=0)
    assert Step.of(torch.arange(5).expand(2, 5)) == Step(4, True)
    assert Step.of(torch.tensor([[0, 1, 2], [0, 1, -1]])) == Step(2, False)  # a padded row is no plain prefill
    assert Step.of(torch.tensor([[1, 2, 3]])) == Step(3, False)  # nor a span after kept rows
