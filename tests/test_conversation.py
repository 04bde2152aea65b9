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
    conv = Conversation(models, maps, HandoffConfig(rho=0.3), SAMPLING)
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
