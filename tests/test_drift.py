"""Scored conversation turns and the drift harness on the tiny pair."""

from __future__ import annotations

import json
import math

import pytest
import torch

from rarecache.errors import RarecacheError
from rarecache.eval.drift import parse_arm, report, run_drift
from rarecache.transfer.conversation import Conversation
from rarecache.transfer.gate.policy import GatePolicy
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
    own = [r for r in rows if "handed_off" in r]  # the target's own prefill of each handed-off span, timed
    assert own and all(r["own_prefill_s"] > 0 and r["own_prefill_tokens"] == r["handed_off"] for r in own)
    assert fig["switch/0.2:rank"]["expected_speedup"] > 0
    assert 0 < fig["switch/0.2:rank"]["mean_recomputed_share"] < 1


def test_healing_arms_keep_a_handoffs_error_on_its_own_turn(chat, tmp_path):
    """`:heal` arms: every handed-off turn is healed after it is scored (its row says how many positions,
    and the report what that cost against the target's own prefill); the turn itself is scored before
    healing, so the first handoff scores as without it, and at rho 1 there is nothing to heal."""
    source, target, maps = _pair(chat)
    out = tmp_path / "drift.jsonl"
    arms = ["alone", "0.2:rank", "0.2:rank:heal", "1:rank:heal"]
    run_drift([("s1", TURNS)], source, target, maps, arms, None, out, progress=False)
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    by = {(r["arm"], r["turn"]): r for r in rows if r["arm"] != "alone"}
    healed = [r for r in rows if r["arm"] == "switch/0.2:rank:heal" and "handed_off" in r]
    assert healed and all(r["healed"] > 0 and r["seconds"]["heal"] > 0 for r in healed)
    assert all(r["healed"] == 0 for r in rows if r["arm"] == "switch/1:rank:heal")
    assert all("healed" not in r for r in rows if r["arm"] == "switch/0.2:rank")
    assert by[("switch/0.2:rank:heal", 2)]["bpb"] == pytest.approx(by[("switch/0.2:rank", 2)]["bpb"], abs=1e-6)
    _, fig = report(out)
    assert fig["switch/0.2:rank:heal"]["heal_over_own_prefill"] > 0 and fig["switch/0.2:rank"]["heal_over_own_prefill"] is None
    assert fig["switch/1:rank:heal"]["delta"] == pytest.approx(0.0, abs=1e-4)
    with pytest.raises(RarecacheError, match="bad drift arm"):
        parse_arm("alone:heal")
    assert parse_arm("gate:heal") == ("switch/gate:heal", None)


def test_drift_arms_and_missing_policy_are_refused(chat, tmp_path):
    from rarecache.errors import RarecacheError

    assert parse_arm("0.2:attn-source")[0] == "switch/0.2:attn-source"
    for bad in ("x:rank", "0.2:magic", "2:rank"):
        with pytest.raises(RarecacheError):
            parse_arm(bad)
    source, target, maps = _pair(chat)
    with pytest.raises(RarecacheError, match="policy"):
        run_drift([("s", TURNS)], source, target, maps, ["gate"], None, tmp_path / "x.jsonl", progress=False)



def test_drift_resume_refuses_other_maps_dtype_or_gate_rule(chat, tmp_path):
    """A drift file records what its rows depend on; resuming it with anything else is refused before a
    row is written, so a refitted gate policy or another map cannot mix into one file's figures."""
    from rarecache.errors import RarecacheError
    from rarecache.eval.drift import drift_meta
    from rarecache.eval.results import models_meta

    source, target, maps = _pair(chat)
    paths = {}
    for (a, b), m in maps.items():
        paths[f"{a}->{b}"] = tmp_path / f"{a}-{b}.safetensors"
        m.save(paths[f"{a}->{b}"])
    never, other = GatePolicy("rank", (0.1, 0.3), -1.0), GatePolicy("rank", (0.1, 0.3), 0.5)
    out = tmp_path / "drift.jsonl"

    def run(arms, policy=never, dtype="float32", files=paths, reverse=True, convs=(("s1", TURNS[:2]),)):
        meta = drift_meta(models_meta(source, target, files, dtype), reverse, arms, policy)
        run_drift(list(convs), source, target, maps, arms, policy, out, progress=False, meta=meta)

    run(["alone", "0.2:rank"])
    assert json.loads(out.with_suffix(".meta.json").read_text())["gate"] is None
    run(["alone", "0.2:rank", "gate"])  # a file run without the gate arm may gain it
    rows = out.read_text()
    swapped = {"source->target": paths["target->source"], "target->source": paths["source->target"]}
    for kwargs, why in (({"policy": other}, "gate"), ({"dtype": "bfloat16"}, "dtype"), ({"files": swapped}, "map"),
                        ({"reverse": False}, "reverse")):
        with pytest.raises(RarecacheError, match=why):
            run(["alone", "gate"], convs=(("s2", TURNS[:2]),), **kwargs)
        assert out.read_text() == rows
    run(["alone", "0.2:rank"], policy=other, convs=(("s2", TURNS[:2]),))  # no gate arm: the rule is not used
    assert json.loads(out.with_suffix(".meta.json").read_text())["gate"]["threshold"] == -1.0
    # `eval gate report --drift`: the gate arm as the report's CoQA task, only under the rule it ran with
    from rarecache.eval.drift import gate_figures
    from rarecache.packages import sha256_file

    sha = sha256_file(paths["source->target"])
    fig = gate_figures(out, never, sha)
    assert fig["fallback_share"] == 1.0 and fig["delta"] == pytest.approx(0.0, abs=1e-4)
    assert fig["gated"] == pytest.approx(fig["target"], abs=1e-4) and fig["expected_speedup"] > 0
    with pytest.raises(RarecacheError, match="another rule"):
        gate_figures(out, other, sha)
    for sha in ("0" * 64, None):  # the ladders' map must be known and the same
        with pytest.raises(RarecacheError, match="through map"):
            gate_figures(out, never, sha)
    bare = tmp_path / "bare.jsonl"  # rows without a run record: what they ran with is unknown
    bare.write_text(out.read_text())
    with pytest.raises(RarecacheError, match="no run record"):
        run_drift([("s1", TURNS[:2])], source, target, maps, ["alone"], None, bare, progress=False,
                  meta=drift_meta(models_meta(source, target, paths, "float32"), True, ["alone"], None))

# -- the same run through the HTTP server (rarecache serve's scoring extensions)


def _server(chat, cfg=HandoffConfig(0.2, "rank"), gate=None, reverse=True, request_budget=True):
    """A DriftServer over the app on the tiny pair (FastAPI's TestClient as its transport)."""
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from rarecache.eval.drift_server import DriftServer
    from rarecache.serve.app import create_app
    from rarecache.serve.service import ChatService, ServiceConfig

    models, maps = chat
    maps = maps if reverse else {("small", "large"): maps[("small", "large")]}
    cfg = ServiceConfig(cfg, gate=gate, request_budget=request_budget, min_handoff_tokens=0)
    app = create_app(ChatService(models, maps, cfg))
    return DriftServer("http://testserver", "small", "large", client=TestClient(app))


def _timeless(x):
    """A row's field without the seconds anything took (the gate records each rung's)."""
    if isinstance(x, dict):
        return {k: _timeless(v) for k, v in x.items() if k != "seconds"}
    return [_timeless(v) for v in x] if isinstance(x, list) else x


def _rows(path):
    return {(r["story"], r["turn"], r["arm"], r["model"]): r for r in map(json.loads, path.read_text().splitlines())}


def test_drift_through_the_server_equals_the_conversation_path(chat, tmp_path):
    """The same stories and arms, once through `Conversation` and once as requests to the server
    (models alternating in the `model` field): every turn's bpb agrees, as do how many positions were
    kept, handed off and recomputed and what the gate decided; the server's rows say so, and its
    run resumes like the other."""
    from rarecache.eval.drift_server import run_drift_server

    source, target, maps = _pair(chat)
    convs = [("s1", TURNS), ("s2", TURNS[::-1])]
    never = GatePolicy("rank", (0.1, 0.3), -1.0)
    local = tmp_path / "local.jsonl"
    run_drift(convs, source, target, maps, ["alone", "0.2:rank", "gate"], never, local, progress=False)
    served = tmp_path / "served.jsonl"
    server = _server(chat, gate=never)  # one server, every arm: each request names its arm's budget
    run_drift_server(convs[:1], server, ["alone", "0.2:rank"], served, progress=False)
    first = served.read_text()
    run_drift_server(convs, server, ["alone", "0.2:rank", "gate"], served, progress=False)
    assert served.read_text().startswith(first)  # resumed: the first story is not redone
    want, got = _rows(local), _rows(served)
    assert set(got) == set(want) and len(got) == 2 * (2 + 2) * len(TURNS)
    for key, w in want.items():
        g = got[key]
        assert g["via"] == "server" and g["served_model"] == {"source": "small", "target": "large"}[key[3]]
        assert g["bpb"] == pytest.approx(w["bpb"], abs=1e-6), key
        for field in ("prompt_tokens", "reused", "handed_off", "recomputed", "gate"):
            assert _timeless(g.get(field)) == _timeless(w.get(field)), (key, field)
    assert sum("handed_off" in r for r in got.values()) == 2 * 2 * (len(TURNS) - 1)  # both ways, every switch
    _, fig_local = report(local)
    _, fig_served = report(served)
    for arm in ("switch/0.2:rank", "switch/gate"):
        assert fig_served[arm]["delta"] == pytest.approx(fig_local[arm]["delta"], abs=1e-6)
        assert fig_served[arm]["n"] == fig_local[arm]["n"] == 4


def test_drift_through_the_server_refuses_what_it_would_not_measure(chat, tmp_path):
    """A gate arm on a server without a gate policy, a server that does not hand off with the budget a
    request names, a server without the map, a results file of the other path: refused before a row is
    written."""
    from rarecache.errors import RarecacheError
    from rarecache.eval.drift_server import DriftServer, run_drift_server

    source, target, maps = _pair(chat)
    out = tmp_path / "x.jsonl"
    with pytest.raises(RarecacheError, match="needs a server started with --rho auto"):
        run_drift_server([("s", TURNS)], _server(chat), ["gate"], out, progress=False)
    deaf = _server(chat)  # a server that ignores the request's budget (an older one): its handoffs are caught
    score = deaf.score
    deaf.score = lambda who, messages, answer, salt, budget=None: score(who, messages, answer, salt)
    with pytest.raises(RarecacheError, match=r"not at rho 0.3 \(rank\) as asked"):
        run_drift_server([("s", TURNS)], deaf, ["0.3:rank"], out, progress=False)
    with pytest.raises(RarecacheError, match="l2-oracle is an oracle"):
        run_drift_server([("s", TURNS)], _server(chat), ["0.2:l2-oracle"], out, progress=False)
    with pytest.raises(RarecacheError, match="healing runs in process only"):
        run_drift_server([("s", TURNS)], _server(chat), ["alone", "0.2:rank:heal"], out, progress=False)
    closed = _server(chat, request_budget=False)  # hands off at its own 0.2 / rank only
    with pytest.raises(RarecacheError, match="takes no request's budget"):
        run_drift_server([("s", TURNS)], closed, ["alone", "0.3:rank"], out, progress=False)
    assert not out.exists() or out.read_text() == ""
    run_drift_server([("s", TURNS)], _server(chat, reverse=False, request_budget=False), ["0.2:rank"], out,
                     progress=False)  # one way; the server's own budget is fine on a closed server
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [("handed_off" in r) for r in rows] == [False, True, False, True]  # the source re-reads what it missed
    no_map = _server(chat)
    no_map.names = {"source": "large", "target": "small"}
    no_map._maps = {("source", "target")} - {("source", "target")}
    with pytest.raises(RarecacheError, match="no map from large to small"):
        run_drift_server([("s", TURNS)], no_map, ["0.2:rank"], tmp_path / "y.jsonl", progress=False)
    with pytest.raises(RarecacheError, match="no model 'huge'"):
        DriftServer("http://testserver", "small", "huge", client=_server(chat).client).maps()
    local = tmp_path / "local.jsonl"
    run_drift([("s", TURNS)], source, target, maps, ["alone"], None, local, progress=False)
    with pytest.raises(RarecacheError, match="another --out"):
        run_drift_server([("s", TURNS), ("t", TURNS)], _server(chat), ["alone"], local, progress=False)
    with pytest.raises(RarecacheError, match="another --out"):
        run_drift([("t", TURNS)], source, target, maps, ["alone"], None, out, progress=False)


def test_drift_cli_through_a_server(chat, tmp_path, monkeypatch, capsys):
    """`rarecache eval drift run --server URL --api-key KEY`: the turns go to the server named (here
    the app behind a TestClient, with the key it was started with), and the flags that belong to
    the server are refused."""
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    import rarecache.eval.drift as drift
    import rarecache.eval.drift_server as drift_server
    from rarecache.cli import main
    from rarecache.serve.app import create_app
    from rarecache.serve.service import ChatService, ServiceConfig

    models, maps = chat
    cfg = ServiceConfig(HandoffConfig(0.2, "rank"), min_handoff_tokens=0)
    app = create_app(ChatService(models, maps, cfg), api_key="k1")
    made, real = {}, drift_server.DriftServer

    def server(url, source, target, api_key):
        made.update(url=url, api_key=api_key)
        return real(url, source, target, api_key, client=TestClient(app))

    monkeypatch.setattr(drift_server, "DriftServer", server)
    monkeypatch.setattr(drift, "conversations", lambda cache_dir, stories: [("s1", TURNS)][:stories])
    monkeypatch.delenv("RARECACHE_API_KEY", raising=False)
    out = tmp_path / "drift.jsonl"
    args = ["eval", "drift", "run", "--source", "small", "--target", "large", "--arms", "alone", "0.2:rank",
            "--stories", "1", "--out", str(out), "--server", "http://127.0.0.1:8000"]
    assert main(args) == 2 and "401" in capsys.readouterr().err  # no key: the server's refusal
    monkeypatch.setenv("RARECACHE_API_KEY", "k1")
    assert main(args) == 0
    assert made == {"url": "http://127.0.0.1:8000", "api_key": "k1"}
    assert "switch/0.2:rank" in capsys.readouterr().out
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(rows) == 3 * len(TURNS) and all(r["via"] == "server" for r in rows)
    for extra, said in ((["--map", "m.safetensors"], "--map"), (["--gate-policy", "p.json"], "--gate-policy")):
        assert main([*args, *extra]) == 2 and said in capsys.readouterr().err
    assert main([*args[:-1], "127.0.0.1:8000"]) == 2 and "http://" in capsys.readouterr().err
    assert main([*args[:-2], "--api-key", "k1"]) == 2 and "--server" in capsys.readouterr().err
    assert main(args[:-2]) == 2 and "--map" in capsys.readouterr().err
