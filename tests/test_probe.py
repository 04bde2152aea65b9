"""The fidelity probe: its prompt set on fake task data, its measures on tiny random models against a
slow reference, and resuming."""

from __future__ import annotations

import json
import math

import pytest
import torch

import rarecache.eval.probe as probe
from rarecache.eval.arms import handoff_arm
from rarecache.eval.probe import PLAN, ProbePrompt, build_set, probe_prompt, run_probe, set_digest, summarise_probe
from rarecache.eval.tasks.base import Item
from rarecache.errors import RarecacheError


class FakeTask:
    """items() and calibration_items() as a registered task gives them."""

    def __init__(self, name, items, pool=()):
        self.name, self._items, self._pool = name, list(items), list(pool)

    def items(self):
        return self._items

    def calibration_items(self):
        return self._pool


def _user(text):
    return ({"role": "user", "content": text},)


def _fake_tasks(n=20, stories=20, turns=5):
    chat = [Item(f"coqa_bpb-s{s}-t{t}", _user(f"story {s}") * (2 * t - 1), [f"a{s}.{t}"], {"story": f"s{s}", "turn": t},
                 (f"a{s}.{t}",)) for s in range(stories) for t in range(1, turns + 1)]
    return {
        "coqa_passage": FakeTask("coqa_passage", [Item(f"coqa_passage-s{s}", _user(f"passage {s}"), [f"p{s}"],
                                                       {"story": f"s{s}"}, (f"p{s}",)) for s in range(stories)],
                                 [Item("coqa_passage-cal", _user("x"), ["y"], {"story": "cal"}, ("y",))]),
        "mmlu": FakeTask("mmlu", [Item(f"mmlu-{k}", _user(f"question {k}"), k % 4, {"subject": f"sub{k % 12:02d}"},
                                       tuple("ABCD")) for k in range(n)]),
        "arc_challenge": FakeTask("arc_challenge", [Item(f"arc-{k}", _user(f"shots\n\nQuestion: q{k}\nAnswer:"), 1,
                                                         {"query": f"Question: q{k}\nAnswer:"}, ("no", f"yes {k}"))
                                                    for k in range(n)]),
        "gsm8k_bpb": FakeTask("gsm8k_bpb", [Item(f"gsm8k_bpb-{k}", _user(f"chain {k}"), str(k), {"index": k},
                                                 (f"solution {k}",)) for k in range(n)]),
        "coqa_bpb": FakeTask("coqa_bpb", chat, [Item("coqa_bpb-cal-t5", _user("x"), ["y"], {"story": "cal"}, ("y",))]),
    }


def test_probe_set_is_drawn_past_the_evaluated_items_and_outside_calibration(monkeypatch):
    monkeypatch.setattr(probe, "EVALUATED", 2)
    prompts = build_set(_fake_tasks())
    assert len(prompts) == 32 == sum(k for _, k in PLAN)
    assert [sum(p.category == c for p in prompts) for c, _ in PLAN] == [k for _, k in PLAN]
    by = {c: [p for p in prompts if p.category == c] for c, _ in PLAN}
    assert [p.id for p in by["passage"]] == [f"passage-coqa_passage-s{s}" for s in range(12, 20)]  # the tail
    # MMLU: the last item of every other subject of 12 (sub01, sub03, ...: items 13, 15, 17, 19, 9, 11)
    assert [p.id for p in by["mmlu"]] == [f"mmlu-mmlu-{k}" for k in (13, 15, 17, 19, 9, 11)]
    assert [p.reference for p in by["mmlu"]] == ["ABCD"[k % 4] for k in (13, 15, 17, 19, 9, 11)]  # gold letters
    assert by["arc"][0].messages == ({"role": "user", "content": probe.ARC_INSTRUCTION + "Question: q14\nAnswer:"},)
    assert by["arc"][0].reference == "yes 14"  # 0-shot: the exemplars are dropped, the gold answer's text kept
    assert [p.reference for p in by["chain"]] == [f"solution {k}" for k in range(16, 20)]
    # chat: turn CHAT_TURN of the stories just before the passage prompts' stories
    assert [p.id for p in by["chat"]] == [f"chat-coqa_bpb-s{s}-t{probe.CHAT_TURN}" for s in range(4, 12)]
    assert len(by["chat"][0].messages) == 2 * probe.CHAT_TURN - 1
    assert set_digest(prompts) == set_digest(build_set(_fake_tasks()))
    changed = [ProbePrompt(p.id, p.category, p.messages, p.reference + "!") if k == 0 else p
               for k, p in enumerate(prompts)]
    assert set_digest(changed) != set_digest(prompts)


def test_probe_set_refuses_evaluated_or_calibration_items(monkeypatch):
    monkeypatch.setattr(probe, "EVALUATED", 2)
    tasks = _fake_tasks()
    tasks["arc_challenge"]._items = tasks["arc_challenge"]._items[:7]  # the 6 ARC prompts would start at item 1
    with pytest.raises(RarecacheError, match="arc_challenge has too few items: its probe items would start at 1"):
        build_set(tasks)
    tasks = _fake_tasks()
    tasks["mmlu"]._items = tasks["mmlu"]._items[:12]  # one item per subject: items 1, 3, ... start at 1
    with pytest.raises(RarecacheError, match="mmlu has too few items: its probe items would start at 1"):
        build_set(tasks)
    tasks = _fake_tasks()
    tasks["gsm8k_bpb"]._pool = [tasks["gsm8k_bpb"].items()[-1]]
    with pytest.raises(RarecacheError, match="gsm8k_bpb item.* gsm8k_bpb-19 are in its calibration pool"):
        build_set(tasks)
    tasks = _fake_tasks(stories=17)  # chat stories would start at story 1
    with pytest.raises(RarecacheError, match="coqa_bpb has too few items"):
        build_set(tasks)
    tasks = _fake_tasks()
    tasks["coqa_bpb"]._pool = [Item("coqa_bpb-other-t5", _user("x"), ["y"], {"story": "s5"}, ("y",))]
    with pytest.raises(RarecacheError, match="coqa_bpb item.* s5 are in its calibration pool"):  # by story
        build_set(tasks)


def _variants(specs, label="m"):
    return [(label, handoff_arm(s, label)) for s in specs]


def test_probe_measures_against_a_slow_reference_and_rho_one_is_the_target(fitted):
    """KL from the target's own distribution at every answer position, computed by the probe's batched path,
    equals one handoff per arm plus separate passes (the reference); at rho 1 the handoff is the target's own
    prefill: KL 0, the same top tokens, attention-output cosine 1 at every layer. Plain transfer moves them."""
    from rarecache.transfer.handoff import handoff

    source, target, mapper, prompts = fitted
    ids, answer = prompts[0][:30], prompts[1][:6]
    variants = _variants(["0:rank", "0.3:rank", "0.3:suffix+rank", "1:rank"])
    rows = probe_prompt(source, target, {"m": mapper}, variants, ids, answer)
    assert [r["arm"] for r in rows] == ["rho=0/rank", "rho=0.3/rank", "rho=0.3/suffix+rank", "rho=1/rank"]
    n, m = len(ids), len(answer)
    whole = torch.tensor([ids + answer[:-1]])
    own = target.forward(whole, torch.arange(n + m - 1)[None], target.new_cache(1, n + m), logits_at="all").logits
    own = own[0, n - 1:].float().log_softmax(-1)  # (m, V): the target alone, one pass
    for r, (_, arm) in zip(rows, variants):
        cache, last, _ = handoff(source, target, mapper, [ids], arm.config, max_len=n + m)
        rest = target.forward(torch.tensor([answer[:-1]]), torch.arange(n, n + m - 1)[None], cache,
                              logits_at="all").logits[0]
        theirs = torch.cat([last, rest]).float().log_softmax(-1)  # (m, V)
        kl = (own.exp() * (own - theirs)).sum(-1).clamp(min=0) / math.log(2)
        assert r["kl"] == pytest.approx(kl.mean().item(), abs=1e-4)
        assert r["kl_first"] == pytest.approx(kl[0].item(), abs=1e-4)
        assert r["top1"] == pytest.approx((own.argmax(-1) == theirs.argmax(-1)).float().mean().item())
        assert len(r["attn_cos_layers"]) == target.num_layers and (r["prompt_tokens"], r["answer_tokens"]) == (n, m)
    plain, *_, full = rows
    assert full["kl"] < 1e-6 and full["top1"] == 1.0 and min(full["attn_cos_layers"]) > 1 - 1e-5
    # (tiny random models are near uniform: plain transfer's KL is small, yet > 1000x rho 1's rounding)
    assert plain["kl"] > 1e-4 and plain["kl"] > rows[1]["kl"] and plain["attn_cos"] < full["attn_cos"] - 1e-3


def test_attention_cosines_are_one_over_the_same_rows_and_fall_with_other_rows(fitted):
    from rarecache.transfer.diagnostics import attention_cosines

    _, target, _, prompts = fitted
    ids = prompts[0][:20]
    own = target.new_cache(1, 24)
    target.forward(torch.tensor([ids]), torch.arange(20)[None], own)
    others = target.new_cache(2, 24)
    others.copy_prefix(own, 20)
    others.v[:, 1, :, :10] += torch.randn_like(others.v[:, 1, :, :10])  # row 1: its first 10 values disturbed
    toks = torch.tensor([prompts[1][:4]])
    cos = attention_cosines(target, own, others, toks, torch.arange(20, 24)[None])
    assert cos.shape == (target.num_layers, 2)
    assert torch.allclose(cos[:, 0], torch.ones(target.num_layers), atol=1e-5) and (cos[:, 1] < 0.999).all()
    torch.testing.assert_close(others.k[:, 1, :, 20:24], own.k[:, 0, :, 20:24])  # the same new rows in both


def test_run_probe_resumes_per_prompt_and_summarises(chat, tmp_path):
    llms, maps = chat
    source, target = llms["small"], llms["large"]
    mapper = maps[("small", "large")]
    words = "the quick brown fox jumps over the lazy dog".split()
    prompts = [ProbePrompt(f"p{k}", c, _user(" ".join(words[k:] + words[:k])), " ".join(words[:3 + k]))
               for k, c in enumerate(["passage", "mmlu", "chat"])]
    variants = _variants(["0:rank", "0.5:rank"])
    whole = run_probe(prompts, source, target, {"m": mapper}, variants, tmp_path / "whole.jsonl", progress=False)
    part = tmp_path / "part.jsonl"
    run_probe(prompts[:1], source, target, {"m": mapper}, variants, part, progress=False)  # killed after one prompt
    with open(part, "a") as f:
        f.write('{"prompt": "p1", "vari')  # a line cut short by the kill
    run_probe(prompts, source, target, {"m": mapper}, variants, part, progress=False)
    assert part.read_text() == whole.read_text()
    rows = [json.loads(line) for line in whole.read_text().splitlines()]
    assert [(r["prompt"], r["variant"]) for r in rows] == [(p.id, f"m/rho={r:g}/rank") for p in prompts
                                                            for r in (0, 0.5)]
    s = summarise_probe(rows, prompts)["arms"]["m"]
    plain = [r for r in rows if r["arm"] == "rho=0/rank"]
    assert s["rho=0/rank"]["n"] == 3 and s["rho=0/rank"]["kl"] == pytest.approx(sum(r["kl"] for r in plain) / 3)
    assert list(s["rho=0/rank"]["by_category"]) == ["passage", "mmlu", "chat"]  # PLAN's order
    assert s["rho=0/rank"]["by_category"]["mmlu"]["kl"] == pytest.approx(plain[1]["kl"])
    assert len(s["rho=0.5/rank"]["attn_cos_layers"]) == target.runner.num_layers
    assert s["rho=0.5/rank"]["kl"] < s["rho=0/rank"]["kl"]  # half recomputed moves the target less than none
    only = summarise_probe(rows, prompts[:1])["arms"]["m"]["rho=0/rank"]
    assert only["n"] == 1 and only["kl"] == pytest.approx(plain[0]["kl"])


def test_probe_command_refuses_bad_arms_and_maps_before_loading_models(tmp_path, capsys):
    from rarecache.cli import main

    base = ["eval", "probe", "--source", "a", "--target", "b", "--out", str(tmp_path / "p.jsonl")]
    assert main(base + ["--map", str(tmp_path / "none.safetensors")]) == 2
    assert "no map file" in capsys.readouterr().err
    (tmp_path / "m.safetensors").write_bytes(b"x")
    assert main(base + ["--map", str(tmp_path / "m.safetensors"), "--arms", "target"]) == 2
    assert "name a handoff as RHO:SELECTOR" in capsys.readouterr().err
