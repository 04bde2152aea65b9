"""Scored conversation turns and the drift harness on the tiny pair."""

from __future__ import annotations

import json
import math

import pytest
import torch

from rarecache.eval.drift import parse_arm, report, run_drift
from rarecache.transfer.conversation import Conversation
from rarecache.transfer.gate import GatePolicy
from rarecache.transfer.handoff import HandoffConfig

TURNS = [("the quick brown fox", "jumps over"), ("the lazy dog", "def add return"), ("tokens and", "spaces"),
         ("add return", "the fox")]


def direct_bpb(llm, messages, answer):
    """Bits per byte of `answer` after `messages`, in one forward pass over the whole sequence."""
    prompt = llm.encode(messages)
    cont = llm.tokenizer.encode(answer, add_special_tokens=False)
    ids = prompt + cont
    logits = llm.runner.forward(torch.tensor([ids]), torch.arange(len(ids))[None], llm.runner.new_cache(1, len(ids)),
                                logits_at="all").logits[0]
    lp = torch.log_softmax(logits[len(prompt) - 1 : -1].float(), -1).gather(1, torch.tensor(cont)[:, None]).sum()
    return -lp.item() / (math.log(2) * len(answer.encode()))


def test_scored_turns_equal_one_pass_over_the_conversation(chat):
    models, _ = chat
    llm = models["large"]
    conv = Conversation({"large": llm}, {})
    for user, answer in TURNS:
        want = direct_bpb(llm, conv.messages + [{"role": "user", "content": user}], answer)
        turn = conv.score(user, answer, "large")
        assert turn.bpb == pytest.approx(want, abs=1e-4)
        assert turn.reused > 0 or len(conv.turns) == 1  # it kept its rows of the earlier turns, answers included


def test_switching_every_turn_at_rho_one_is_each_model_alone(chat):
    models, maps = chat
    conv = Conversation(models, maps, HandoffConfig(1.0))
    for k, (user, answer) in enumerate(TURNS):
        who = ("small", "large")[k % 2]
        want = direct_bpb(models[who], conv.messages + [{"role": "user", "content": user}], answer)
        turn = conv.score(user, answer, who)
        assert turn.bpb == pytest.approx(want, abs=1e-4)
        assert (turn.handoff is not None) == (k > 0)


def _pair(chat):
    models, maps = chat
    return models["small"], models["large"], {("source", "target"): maps[("small", "large")],
                                              ("target", "source"): maps[("large", "small")]}


def test_drift_harness_resumes_and_its_exact_arms_show_no_drift(chat, tmp_path):
    source, target, maps = _pair(chat)
    convs = [("s1", TURNS), ("s2", TURNS[::-1])]
    out = tmp_path / "drift.jsonl"
    never = GatePolicy("rank", (0.1, 0.3), -1.0)
    run_drift(convs[:1], source, target, maps, ["alone", "1:rank", "gate", "0.2:rank"], never, out, progress=False)
    first = out.read_text()
    run_drift(convs, source, target, maps, ["alone", "1:rank", "gate", "0.2:rank"], never, out, progress=False)
    assert out.read_text().startswith(first)  # resumed: the first story is not redone
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(rows) == 2 * (2 * len(TURNS) + 3 * len(TURNS))
    _, fig = report(out)
    for arm in ("switch/1:rank", "switch/gate"):  # all recomputed, or the target's own prefill: exact
        assert fig[arm]["delta"] == pytest.approx(0.0, abs=1e-4) and fig[arm]["n"] == 4
    assert fig["switch/gate"]["fallback_share"] == 1.0 and fig["switch/gate"]["mean_recomputed_share"] == 1.0
    assert fig["switch/1:rank"]["mean_recomputed_share"] == 1.0
    assert 0 < fig["switch/0.2:rank"]["mean_recomputed_share"] < 1


def test_drift_arms_and_missing_policy_are_refused(chat, tmp_path):
    from rarecache.errors import RarecacheError

    assert parse_arm("0.2:attn-source")[0] == "switch/0.2:attn-source"
    for bad in ("x:rank", "0.2:magic", "2:rank"):
        with pytest.raises(RarecacheError):
            parse_arm(bad)
    source, target, maps = _pair(chat)
    with pytest.raises(RarecacheError, match="policy"):
        run_drift([("s", TURNS)], source, target, maps, ["gate"], None, tmp_path / "x.jsonl", progress=False)
