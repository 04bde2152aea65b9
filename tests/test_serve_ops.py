"""What an operator and a router see of `serve`: /metrics, each response's handoff outcome, and the
door's papercuts (bearer scheme, OpenAPI pages, one string rule, non-JSON bodies, bad files)."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest

from rarecache.cli import main
from rarecache.errors import RarecacheError
from rarecache.serve.outcome import HEADER, ROUTER_MAPPER, ROUTER_STATUS, fields, header, headers, outcome
from rarecache.serve.request import check_text
from rarecache.serve.service import ChatService, ServiceConfig
from rarecache.transfer.gate.policy import GatePolicy
from rarecache.transfer.handoff import HandoffConfig

from .test_conversation import TURNS

pytest.importorskip("fastapi")
parser = pytest.importorskip("prometheus_client.parser")
from fastapi.testclient import TestClient  # noqa: E402

from rarecache.serve.app import create_app  # noqa: E402


def served(chat, maps=None, **kw):
    models, all_maps = chat
    kw.setdefault("min_handoff_tokens", 0)
    svc = ChatService(models, all_maps if maps is None else maps, ServiceConfig(HandoffConfig(0.3, "rank"), **kw))
    return svc, TestClient(create_app(svc))


def post(client, model, messages, **kw):
    r = client.post("/v1/chat/completions", json={"model": model, "messages": messages, "max_tokens": 3, **kw})
    assert r.status_code == 200, r.text
    return r


def scrape(client) -> dict[tuple[str, tuple], float]:
    """/metrics as {(sample name, sorted labels): value}."""
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in parser.text_string_to_metric_families(r.text) for s in fam.samples}


def m(samples, name, **labels) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def test_metrics_count_real_requests(chat):
    """After real requests on the tiny pair, the counters moved by exactly what the responses said."""
    svc, client = served(chat)
    before = scrape(client)
    for model in ("small", "large"):  # every series is there from the start, at 0
        assert m(before, "rarecache_handoffs_total", model=model) == 0
        assert m(before, "rarecache_ttft_seconds_count", model=model) == 0
        for reason in ("no_entry", "identity_mismatch", "evicted", "store_down", "gate"):
            assert m(before, "rarecache_handoff_fallbacks_total", model=model, reason=reason) == 0
    messages = [{"role": "user", "content": TURNS[0]}]
    first = post(client, "small", messages).json()["rarecache"]  # nothing held anywhere: its own prefill
    messages += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": TURNS[1]}]
    r = post(client, "large", messages)  # handed off from small
    second = r.json()["rarecache"]
    messages += [{"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]},
                 {"role": "user", "content": TURNS[2]}]
    post(client, "large", messages, stream=True)  # streamed: its own (approximate) rows reused, counted too
    after = scrape(client)
    assert first["handoff"] == "fallback_reprefill" and first["fallback_reason"] == "no_entry"
    assert second["handoff"] == "applied" and second["recomputed_tokens"] > 0
    assert m(after, "rarecache_handoff_fallbacks_total", model="small", reason="no_entry") == 1
    assert m(after, "rarecache_handoffs_total", model="large") == 1
    assert m(after, "rarecache_positions_recomputed_total", model="large") == second["recomputed_tokens"]
    assert m(after, "rarecache_requests_total", model="large", handoff="applied") == 1
    assert m(after, "rarecache_requests_total", model="large", handoff="fallback_reprefill") == 1
    assert m(after, "rarecache_approximate_reuses_total", model="large") == 1  # the stream reused mapped rows
    assert m(after, "rarecache_ttft_seconds_count", model="small") == 1
    assert m(after, "rarecache_ttft_seconds_count", model="large") == 2
    assert m(after, "rarecache_ttft_seconds_sum", model="large") > 0
    stats = svc.store.stats()
    assert m(after, "rarecache_store_up") == 1
    for model in ("small", "large"):
        for key in ("hits", "misses", "evictions"):
            assert m(after, f"rarecache_store_{key}_total", model=model) == stats["models"][model][key]
        for key in ("bytes", "entries"):
            assert m(after, f"rarecache_store_{key}", model=model) == stats["models"][model][key]
    assert m(after, "rarecache_store_misses_total", model="small") == 1  # its first request found nothing
    assert m(after, "rarecache_store_hits_total", model="small") == 1  # the handoff read small's rows
    assert m(after, "rarecache_store_hits_total", model="large") == 1  # the stream reused large's own
    assert sum(m(after, "rarecache_store_bytes", model=x) for x in ("small", "large")) == svc.held_bytes() > 0
    other = TestClient(create_app(svc))  # a second app over the same service: its own registry, from 0
    assert m(scrape(other), "rarecache_handoffs_total", model="large") == 0


def test_eviction_is_counted_and_named_as_the_fallback_reason(chat):
    """With room for one entry, a conversation small held is evicted by the next one (another tenant's, so
    that no shorter prefix of it stays); the large model asked for it then reads it itself, and says the
    rows it could have used were evicted."""
    svc, client = served(chat, cache_bytes=1)
    conv_a = [{"role": "user", "content": TURNS[0] + " " + TURNS[2]}]
    post(client, "small", conv_a)
    post(client, "small", [{"role": "user", "content": TURNS[3]}], cache_salt="b")  # evicts conv_a's entry
    r = post(client, "large", conv_a)
    info = r.json()["rarecache"]
    assert info["handoff"] == "fallback_reprefill" and info["fallback_reason"] == "evicted"
    assert r.headers[HEADER] == "fallback_reprefill; reason=evicted; approximate=0"
    samples = scrape(client)
    assert m(samples, "rarecache_store_evictions_total", model="small") >= 1
    assert m(samples, "rarecache_handoff_fallbacks_total", model="large", reason="evicted") == 1


def test_every_response_says_the_handoff_outcome(chat):
    """applied, fallback_reprefill with its reason, or unsupported, in the body and the header; and
    whether approximate rows (an earlier handoff's) were reused."""
    models, maps = chat
    _, client = served(chat, maps={("small", "large"): maps[("small", "large")]})  # nothing maps into small
    messages = [{"role": "user", "content": TURNS[0]}]
    r = post(client, "small", messages)
    assert r.json()["rarecache"]["handoff"] == "unsupported" and r.json()["rarecache"]["fallback_reason"] is None
    assert r.headers[HEADER] == "unsupported; approximate=0"
    messages += [{"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]},
                 {"role": "user", "content": TURNS[1]}]
    r = post(client, "large", messages)
    assert r.json()["rarecache"]["handoff"] == "applied" and r.headers[HEADER] == "applied; approximate=0"
    messages += [{"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]},
                 {"role": "user", "content": TURNS[2]}]
    r = post(client, "large", messages)  # its own entry, whose rows the handoff left: not an exact hit
    info = r.json()["rarecache"]
    assert info["reused_approximate_tokens"] > 0 and info["approximate_rows_reused"] is True
    assert info["handoff"] == "fallback_reprefill" and info["fallback_reason"] == "no_entry"
    assert r.headers[HEADER] == "fallback_reprefill; reason=no_entry; approximate=1"
    r = post(client, "large", messages, stream=True)  # its headers waited for the outcome
    lines = r.text.split("\n")
    last = json.loads([x[6:] for x in lines if x.startswith("data: {")][-1])["rarecache"]
    assert last["handoff"] == "fallback_reprefill" and last["approximate_rows_reused"] is True
    assert r.headers[HEADER] == "fallback_reprefill; reason=no_entry; approximate=1"


def test_a_gate_fallback_is_named(chat):
    models, maps = chat
    never = GatePolicy("rank", (0.1, 0.3), -1.0)  # never accepts
    svc = ChatService(models, maps, ServiceConfig(gate=never, min_handoff_tokens=0))
    client = TestClient(create_app(svc))
    messages = [{"role": "user", "content": TURNS[0]}]
    post(client, "small", messages)
    messages += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": TURNS[1]}]
    r = post(client, "large", messages)
    assert r.json()["rarecache"]["gate"]["decision"] == "fallback"
    assert r.headers[HEADER] == "fallback_reprefill; reason=gate; approximate=0"
    assert m(scrape(client), "rarecache_handoff_fallbacks_total", model="large", reason="gate") == 1


def test_outcome_fields_are_checked_and_named_for_a_router():
    """Every engine's reply carries its outcome, read as it is; a status that cannot be is refused; the headers
    say it in our words and in semantic-router's (the map's id with an applied handoff only)."""
    down = SimpleNamespace(handoff_status="fallback_reprefill", fallback_reason="store_down", reused_approximate=3,
                           mapper_id=None)
    assert header(outcome(down)) == "fallback_reprefill; reason=store_down; approximate=1"
    assert headers(outcome(down)) == {HEADER: "fallback_reprefill; reason=store_down; approximate=1",
                                      ROUTER_STATUS: "fallback_reprefill"}
    applied = SimpleNamespace(handoff_status="applied", fallback_reason=None, reused_approximate=0, mapper_id="ab12")
    assert headers(outcome(applied)) == {HEADER: "applied; approximate=0", ROUTER_STATUS: "applied",
                                         ROUTER_MAPPER: "ab12"}
    for status, reason, mapper in (("fallback_reprefill", None, None), ("fallback_reprefill", "other", None),
                                   ("applied", "gate", None), ("maybe", None, None), (None, None, None),
                                   ("unsupported", None, "ab12"), ("fallback_reprefill", "gate", "ab12")):
        with pytest.raises(ValueError):
            fields(status, reason, False, mapper)


def test_store_stats_are_read_through_the_contract(chat):
    """/metrics reads the engine's store_stats: a flat dict (as the vLLM row stores give) as model="all", and a
    store whose stats fail as store_up 0, without failing the scrape."""
    svc, client = served(chat)
    flat = {"hits": 4, "misses": 2, "bytes": 1024, "evictions": 1, "entries": 3}
    svc.store = SimpleNamespace(stats=lambda: flat)
    samples = scrape(client)
    assert m(samples, "rarecache_store_hits_total", model="all") == 4
    assert m(samples, "rarecache_store_bytes", model="all") == 1024
    svc.store = SimpleNamespace(stats=lambda: (_ for _ in ()).throw(ConnectionError("redis down")))
    samples = scrape(client)
    assert m(samples, "rarecache_store_up") == 0


# ---------------------------------------------------------------------------------------------- papercuts


def test_bearer_scheme_is_case_insensitive(chat):
    models, maps = chat
    client = TestClient(create_app(ChatService(models, maps), api_key="s3cret"))
    for given in ("bearer s3cret", "BEARER s3cret", "Bearer  s3cret"):
        assert client.get("/v1/models", headers={"authorization": given}).status_code == 200, given
    for given in ("bearer wrong", "Basic s3cret", "bearers3cret", "s3cret", "bearer"):
        assert client.get("/v1/models", headers={"authorization": given}).status_code == 401, given


def test_openapi_pages_are_off_unless_asked(chat, pair_dir, fitted, tmp_path, monkeypatch):
    import uvicorn

    models, maps = chat
    off = TestClient(create_app(ChatService(models, maps)))
    on = TestClient(create_app(ChatService(models, maps), openapi_docs=True))
    for path in ("/docs", "/redoc", "/openapi.json"):
        r = off.get(path)
        assert r.status_code == 404 and set(r.json()) == {"error"}
        assert on.get(path).status_code == 200
    path = tmp_path / "m.safetensors"
    fitted[2].save(path)
    started = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: started.update(app=app))
    args = ["serve", "--source", str(pair_dir / "src"), "--target", str(pair_dir / "tgt"), "--dtype", "float32",
            "--map", str(path)]
    assert main([*args, "--openapi-docs"]) == 0
    assert TestClient(started["app"]).get("/openapi.json").status_code == 200
    assert main(args) == 0
    assert TestClient(started["app"]).get("/openapi.json").status_code == 404


@pytest.mark.parametrize("body, field", [
    ({"messages": [{"role": "user", "content": "hi \ud800"}]}, "messages[0].content"),
    ({"cache_salt": "tenant-\udfff"}, "cache_salt"),
    ({"stop": "x\ud800"}, "stop"),
    ({"stop": ["ok", "\ud83d"]}, "stop[1]"),
    ({"model": "small\ud800"}, "model"),
    ({"user": "\udc00"}, "user"),
    ({"rarecache": {"selector": "rank\ud800"}}, "rarecache.selector"),
])
def test_one_string_rule_refuses_a_lone_surrogate_in_every_field(chat, body, field):
    models, maps = chat
    svc = ChatService(models, maps)
    client = TestClient(create_app(svc))
    full = {"model": "small", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **body}
    r = client.post("/v1/chat/completions", content=json.dumps(full).encode(),  # "\\ud800" as JSON writes it
                    headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert "lone surrogate" in message and message.startswith(field), message
    assert svc.load == (0, 0)
    with pytest.raises(RarecacheError, match=r"messages\[0\]\.content .*lone surrogate"):  # the service's own door
        svc.complete("small", [{"role": "user", "content": "\ud800"}], None)
    check_text({"ok": ["fine", "ünïcode ☃ 🙂"]}, "")  # valid text passes


def test_a_body_not_sent_as_json_gets_a_415(chat):
    models, maps = chat
    client = TestClient(create_app(ChatService(models, maps)))
    raw = json.dumps({"model": "small", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    for headers in ({"content-type": "text/plain"}, {"content-type": "application/x-www-form-urlencoded"}):
        r = client.post("/v1/chat/completions", content=raw.encode(), headers=headers)
        assert r.status_code == 415 and "JSON" in r.json()["error"]["message"], r.text
    for ctype in ("application/json", "application/json; charset=utf-8", "application/vnd.x+json"):
        assert client.post("/v1/chat/completions", content=raw.encode(),
                           headers={"content-type": ctype}).status_code == 200, ctype


@pytest.mark.parametrize("hidden", [65, 292])  # 65 heads do not divide it; 292 / 4 heads = 73, odd
def test_a_wrong_hidden_size_names_the_file_and_the_field(tmp_path, pair_dir, hidden):
    from rarecache.models.config import ModelConfig
    from rarecache.models.loader import load_model

    copy = tmp_path / "copied"
    shutil.copytree(pair_dir / "src", copy)  # qwen2, 4 heads, no head_dim in config.json
    cfg = json.loads((copy / "config.json").read_text())
    assert "head_dim" not in cfg or cfg["head_dim"] is None
    (copy / "config.json").write_text(json.dumps({**cfg, "hidden_size": hidden}))
    for load in (ModelConfig.from_dir, load_model):
        with pytest.raises(RarecacheError) as e:
            load(copy)
        assert str(copy / "config.json") in str(e.value) and f"hidden_size {hidden}" in str(e.value)
    assert main(["generate", "--model", str(copy), "hi"]) == 2


def test_generate_checks_the_map_before_loading_weights(pair_dir, tmp_path, monkeypatch, capsys):
    from rarecache.engine.llm import LLM

    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}")
    built = []
    monkeypatch.setattr(LLM, "__init__", lambda self, *a, **kw: built.append(a))
    args = ["generate", "--model", str(pair_dir / "tgt"), "--source", str(pair_dir / "src"), "hi"]
    assert main([*args, "--map", str(bad)]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and "map" in err and "Traceback" not in err
    assert main([*args, "--map", str(tmp_path / "none.safetensors")]) == 2
    assert built == []  # no model was built for either
