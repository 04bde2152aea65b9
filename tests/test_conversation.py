"""Multi-turn conversations that switch model between turns."""

from __future__ import annotations

import pytest

from rarecache import LLM, SamplingConfig
from rarecache.errors import RarecacheError
from rarecache.transfer.conversation import Conversation
from rarecache.transfer.handoff import HandoffConfig
from rarecache.transfer.mapper import Mapper

SAMPLING = SamplingConfig(max_new_tokens=5, ignore_eos=True)
TURNS = ["the quick brown fox", "jumps over the lazy dog", "def add return", "tokens and spaces"]


def fresh_answer(llm: LLM, messages) -> list[int]:
    return llm.generate([messages], SAMPLING)[0].tokens


@pytest.mark.parametrize("schedule", [["small", "small", "small"], ["small", "large", "large"],
                                      ["small", "large", "small", "large"], ["large", "small", "small"]])
def test_switching_with_rho_one_equals_each_model_alone(chat, schedule):
    """With ρ = 1 every handed-off position is recomputed, so each turn equals the model
    answering the whole conversation from scratch."""
    models, maps = chat
    conv = Conversation(models, maps, HandoffConfig(rho=1.0), SAMPLING)
    for text, who in zip(TURNS, schedule):
        want = fresh_answer(models[who], conv.messages + [{"role": "user", "content": text}])
        turn = conv.say(text, who)
        assert turn.tokens == want
        switched = len(conv.turns) > 1 and conv.turns[-2].model != who
        assert (turn.handoff is not None) == switched
        if switched:
            start, end = turn.handoff.handed_off[0]
            assert start == turn.reused and end == turn.prompt_tokens
            assert turn.handoff.positions[0] == list(range(start, end))
        elif len(conv.turns) > 1:
            assert turn.reused > 0  # it kept its own rows of the earlier turns


def test_partial_recompute_spends_the_budget_on_the_unseen_span(chat):
    models, maps = chat
    conv = Conversation(models, maps, HandoffConfig(rho=0.3, selector="rank"), SAMPLING)
    conv.say(TURNS[0], "small")
    conv.say(TURNS[1], "large")  # large has seen nothing: everything is handed off
    conv.say(TURNS[2], "small")  # small kept its first turn: only the rest is handed back
    turn = conv.turns[-1]
    start, end = turn.handoff.handed_off[0]
    assert start == turn.reused > 0 and end == turn.prompt_tokens
    chosen = turn.handoff.positions[0]
    assert len(chosen) == -(-3 * (end - start) // 10) and chosen[-1] == end - 1 and chosen[0] >= start


def test_unknown_model_and_bad_map(chat):
    models, maps = chat
    with pytest.raises(RarecacheError, match="unknown model"):
        Conversation(models, maps).say("hi", "huge")
    with pytest.raises(RarecacheError, match="runs"):
        Conversation(models, {("large", "small"): maps[("small", "large")]})
    with pytest.raises(RarecacheError, match="names a model the conversation does not have"):
        Conversation(models, {("small", "huge"): maps[("small", "large")]})
    assert isinstance(maps[("small", "large")], Mapper)


def _own_rows(llm: LLM, ids: list[int]):
    import torch

    from rarecache.engine.runner import spans

    cache = llm.runner.new_cache(1, len(ids))
    toks, pos = spans([ids], [0], llm.runner.device)
    llm.runner.forward(toks, pos, cache, logits_at=None)
    return cache.k[:, :, :, : len(ids)], cache.v[:, :, :, : len(ids)]


@pytest.mark.parametrize("how", ["rank", "gate"])
def test_heal_makes_every_row_the_models_own_prefill(chat, how, monkeypatch):
    """After a handoff a model's rows are approximate from the first handed-off position on (mapped rows,
    and every row computed over them). Healed, they are the model's own prefill of what it holds, row for
    row; unhealed they are not (so the check can fail). A gate that climbs rungs of scattered positions
    recomputes early positions at a higher rung than later ones that attended to their mapped rows: healing
    starts at the handed-off span, not at the first mapped row."""
    import torch

    from rarecache.transfer.gate.policy import GatePolicy

    from rarecache.transfer.gate import ladder as gate_mod  # (the ladder reads _accepts there)

    models, maps = chat
    gate = None
    if how == "gate":  # accept the second rung whatever its signal: both rungs climbed, positions chosen at each
        gate = GatePolicy("rank", (0.2, 0.5), threshold=1.0)
        seen = []
        monkeypatch.setattr(gate_mod, "_accepts", lambda *a: seen.append(1) or len(seen) % 2 == 0)
    for heal in (False, True):
        conv = Conversation(models, maps, HandoffConfig(rho=0.3, selector="rank"), SAMPLING, gate=gate, heal=heal)
        conv.say(TURNS[0], "small")
        turn = conv.say(TURNS[1] + " " + TURNS[2], "large")
        st = conv.state["large"]
        start = turn.handoff.handed_off[0][0]
        if gate is not None:
            assert turn.gate.decision == "accept" and turn.gate.rho == 0.5
        assert turn.healed == (len(st.ids) - start if heal else 0) and ("heal" in turn.seconds) == heal
        assert (st.inexact_from is None) == heal and (st.approximate == []) == heal
        k, v = _own_rows(models["large"], st.ids)
        n = len(st.ids)
        same = torch.allclose(st.cache.k[:, :, :, :n], k, atol=1e-5, rtol=0) and torch.allclose(
            st.cache.v[:, :, :, :n], v, atol=1e-5, rtol=0)
        assert same == heal
        # the next turn of the same model reuses only its own rows when healed
        nxt = conv.say(TURNS[3], "large")
        assert nxt.handoff is None and nxt.reused > 0


def test_healing_in_steps_ends_at_the_models_own_prefill(chat):
    """`heal(..., limit)` (the server's idle steps): after each step the rows before the new `inexact_from`
    are the model's own prefill and the rest wait for the next step; the last step leaves every row the
    model's own, as one whole heal does."""
    import torch

    from rarecache.transfer.conversation import heal

    models, maps = chat
    conv = Conversation(models, maps, HandoffConfig(rho=0.3, selector="rank"), SAMPLING)
    conv.say(TURNS[0], "small")
    conv.say(TURNS[1] + " " + TURNS[2], "large")
    st = conv.state["large"]
    start, n = st.inexact_from, len(st.ids)
    assert start is not None and n - start > 6
    k, v = _own_rows(models["large"], st.ids)

    def exact(upto):
        return torch.allclose(st.cache.k[:, :, :, :upto], k[:, :, :, :upto], atol=1e-5, rtol=0) and torch.allclose(
            st.cache.v[:, :, :, :upto], v[:, :, :, :upto], atol=1e-5, rtol=0)

    assert exact(start) and not exact(n)
    steps = []
    while st.inexact_from is not None:
        done = heal(models["large"].runner, st, limit=3)
        steps.append(done)
        if st.inexact_from is not None:
            assert st.inexact_from == start + sum(steps) and exact(st.inexact_from) and not exact(n)
            assert all(p >= st.inexact_from for p in st.approximate)
    assert steps[:-1] == [3] * (len(steps) - 1) and sum(steps) == n - start
    assert exact(n) and st.approximate == []
    assert heal(models["large"].runner, st, limit=3) == 0


def test_a_gate_rung_that_recomputes_every_position_is_the_models_own_prefill(chat, monkeypatch):
    """A gate's top rung (0.99 of a short span) may cover every handed-off position. Its rungs are direct
    handoffs (the rows a lower rung recomputed over mapped rows are recomputed again), so the cache is the
    model's own prefill and nothing is marked approximate or inexact."""
    import torch

    from rarecache.transfer.gate import ladder as gate_mod  # (the ladder reads _accepts there)
    from rarecache.transfer.gate.policy import GatePolicy

    models, maps = chat
    seen = []
    monkeypatch.setattr(gate_mod, "_accepts", lambda *a: seen.append(1) or len(seen) % 2 == 0)
    conv = Conversation(models, maps, HandoffConfig(rho=0.3, selector="rank"), SAMPLING,
                        gate=GatePolicy("rank", (0.3, 0.99), threshold=1.0))
    conv.say(TURNS[0], "small")
    turn = conv.say(TURNS[1] + " " + TURNS[2], "large")
    st = conv.state["large"]
    start, end = turn.handoff.handed_off[0]
    assert turn.gate.decision == "accept" and turn.gate.rho == 0.99 and st.approximate == []
    assert turn.handoff.positions[0] == list(range(start, end)) and len(turn.gate.rungs) == 3  # both rungs climbed
    assert st.inexact_from is None
    k, v = _own_rows(models["large"], st.ids)
    n = len(st.ids)
    assert torch.allclose(st.cache.k[:, :, :, :n], k, atol=1e-5, rtol=0)
    assert torch.allclose(st.cache.v[:, :, :, :n], v, atol=1e-5, rtol=0)
