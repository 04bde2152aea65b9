"""The chat service and its HTTP front: answers equal each model's own, caches are reused and handed off."""

from __future__ import annotations

import math
from dataclasses import replace
from types import SimpleNamespace
from concurrent.futures import ThreadPoolExecutor

import pytest

from rarecache import SamplingConfig
from rarecache.errors import RarecacheError
from rarecache.cli import main
from rarecache.defaults import MIN_HANDOFF_TOKENS
from rarecache.packages import sha256_file
from rarecache.serve.service import ChatService, ServiceConfig
from rarecache.transfer.conversation import common_prefix
from rarecache.transfer.handoff import HandoffConfig

from .test_conversation import TURNS, fresh_answer

fastapi = pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from rarecache.serve.app import create_app  # noqa: E402

SAMPLING = SamplingConfig(max_new_tokens=5, ignore_eos=True)


def service(chat, rho=1.0, **kw):
    models, maps = chat
    kw.setdefault("min_handoff_tokens", 0)  # the tiny models' prompts are short: hand them off all the same
    return ChatService(models, maps, ServiceConfig(HandoffConfig(rho=rho, selector="rank"), **kw))


def ask(client, model, messages, **kw):
    r = client.post("/v1/chat/completions", json={"model": model, "messages": messages, "max_tokens": 5, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def assert_rows_held(svc: ChatService) -> None:
    """Every held entry has a filled cache row for each token it claims, and none past them."""
    for es in svc.store.entries.values():
        for e in es:
            n = len(e.held.ids)
            assert e.held.cache.filled[0, :n].all() and not e.held.cache.filled[0, n:].any()


def test_switching_over_http_equals_each_model_alone_at_rho_one(chat):
    """A stateless client moves one conversation small -> large -> small: with ρ = 1 every answer
    equals the model answering the whole conversation itself, and the response says where the
    rows came from."""
    models, _ = chat
    client = TestClient(create_app(service(chat)))
    messages = []
    for k, who in enumerate(["small", "large", "small", "small"]):
        messages.append({"role": "user", "content": TURNS[k]})
        body = ask(client, who, messages)
        want = models[who].generate([messages], SamplingConfig(max_new_tokens=5))[0]
        text = body["choices"][0]["message"]["content"]
        assert text == want.text and body["usage"]["completion_tokens"] == len(want.tokens)
        info, n = body["rarecache"], body["usage"]["prompt_tokens"]
        if k == 0:
            assert info["handed_off_from"] is None and info["reused_tokens"] == 0
        elif k in (1, 2):  # the other model holds more of the conversation: handed off, all recomputed
            assert info["handed_off_from"] == ("small" if who == "large" else "large")
            assert info["handed_off_tokens"] == n - info["reused_tokens"] == info["recomputed_tokens"]
            assert info["rho"] == 1.0
        else:  # small answered the last turn itself: it keeps its rows
            assert info["handed_off_from"] is None and info["reused_tokens"] > 0
        messages.append({"role": "assistant", "content": text})
    assert_rows_held(client.app.state.service)


def test_partial_recompute_budget(chat):
    svc = service(chat, rho=0.3)
    first = [{"role": "user", "content": TURNS[0]}]
    svc.complete("small", first, SAMPLING)
    reply = svc.complete("large", first, SAMPLING)
    assert reply.handed_off_from == "small" and reply.reused == 0
    assert reply.handed_off == reply.prompt_tokens
    assert reply.recomputed == math.ceil(0.3 * reply.prompt_tokens)


def test_conversations_sharing_a_prefix_do_not_overwrite_each_other(chat):
    """Two conversations interleaved on one model: each next turn keeps all its own earlier rows
    (the shared system prompt is copied, not taken over), and every answer is the model's own."""
    models, _ = chat
    svc = service(chat)
    convs = [[{"role": "user", "content": TURNS[0]}], [{"role": "user", "content": TURNS[1]}]]
    for turn in range(2):
        for c, messages in enumerate(convs):
            reply = svc.complete("large", messages, SAMPLING)
            assert reply.tokens == fresh_answer(models["large"], messages)
            if turn == 1:  # all of its first prompt and answer, up to the re-rendered answer's end
                assert reply.reused >= len(models["large"].encode(messages[:1])) + 1
            messages += [{"role": "assistant", "content": reply.text}, {"role": "user", "content": TURNS[2 + c]}]
    assert len(svc.store.entries["large"]) == 2 and not svc.store.entries["small"]


def test_eviction_keeps_answers_exact(chat):
    models, _ = chat
    svc = service(chat, cache_bytes=1)  # nothing survives the next request
    a = [{"role": "user", "content": TURNS[0]}]
    b = [{"role": "user", "content": TURNS[1]}]
    first = svc.complete("small", a, SAMPLING)
    svc.complete("small", b, SAMPLING)
    assert len(svc.store.entries["small"]) == 1  # a's entry went
    again = svc.complete("small", a, SAMPLING)
    shared = common_prefix(models["small"].encode(a), models["small"].encode(b))  # the system prompt
    assert 0 < again.reused == shared < again.prompt_tokens - 5  # only b's entry was left to reuse
    assert again.tokens == first.tokens == fresh_answer(models["small"], a)


def test_concurrent_requests_equal_sequential(chat):
    """Requests from several threads run one at a time over the shared store; at ρ = 1 every
    answer is the model's own whichever order they ran in and whatever was handed off."""
    models, _ = chat
    svc = service(chat)
    jobs = [("small" if k % 2 else "large", [{"role": "user", "content": TURNS[k % 3]}]) for k in range(6)]
    with ThreadPoolExecutor(3) as pool:
        got = list(pool.map(lambda job: svc.complete(job[0], job[1], SAMPLING), jobs))
    for (who, messages), reply in zip(jobs, got):
        assert reply.tokens == fresh_answer(models[who], messages)
    assert any(r.handed_off_from for r in got) and any(r.reused for r in got)


def test_requests_are_validated(chat):
    svc = service(chat, max_new_tokens=8)
    client = TestClient(create_app(svc, default_max_tokens=4))
    user = [{"role": "user", "content": "the quick brown fox"}]

    def err(status, body):
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == status, r.text
        return r.json()["error"]["message"]

    assert "unknown model 'huge'" in err(404, {"model": "huge", "messages": user})
    assert "messages" in err(400, {"model": "small", "messages": []})
    assert "role" in err(400, {"model": "small", "messages": [{"role": "robot", "content": "hi"}]})
    assert err(400, {"model": "small", "messages": user, "tools": [{"type": "function"}]}).endswith(": tools")
    assert "stop takes" in err(400, {"model": "small", "messages": user, "stop": ["a", "b", "c", "d", "e"]})
    assert "stop takes" in err(400, {"model": "small", "messages": user, "stop": ""})
    assert "stop takes" in err(400, {"model": "small", "messages": user, "stop": "x" * 65})
    assert err(400, {"model": "small", "messages": user, "n": 2}).endswith("not supported by this server: n")
    assert "at most 8" in err(400, {"model": "small", "messages": user, "max_tokens": 9})
    assert "nothing to answer" in err(400, {"model": "small", "messages": user + [
        {"role": "assistant", "content": "ok"}]})
    long = [{"role": "user", "content": "fox " * 300}]
    assert "positions" in err(400, {"model": "small", "messages": long, "max_tokens": 8})
    assert "positions" in err(400, {"model": "small", "messages": long, "max_tokens": 8, "stream": True})
    assert "temperature" in err(400, {"model": "small", "messages": user, "temperature": -1})
    r = client.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()
    assert not svc.store.entries["small"]  # failed requests leave no cache behind
    # defaults: stream false and n 1 are fine; no max_tokens -> the server default
    body = ask(client, "small", user, stream=False, n=1, max_tokens=None)
    assert body["usage"]["completion_tokens"] <= 4
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["small", "large"]
    assert client.get("/health").json()["held_cache_bytes"] == svc.held_bytes() > 0


def test_maps_must_fit_the_models_the_service_has(chat):
    models, maps = chat
    with pytest.raises(RarecacheError, match="names a model the service does not have"):
        ChatService(models, {("small", "huge"): maps[("small", "large")]})
    with pytest.raises(RarecacheError, match="runs"):  # a map used in the wrong direction
        ChatService(models, {("large", "small"): maps[("small", "large")]})


def test_serve_cli(pair_dir, fitted, tmp_path, monkeypatch, capsys):
    _, _, mapper, _ = fitted
    path = tmp_path / "m.safetensors"
    mapper.save(path)
    args = ["serve", "--source", str(pair_dir / "src"), "--target", str(pair_dir / "tgt"), "--dtype", "float32"]
    assert main([*args, "--map", str(tmp_path / "none.safetensors")]) == 2
    assert "no map file" in capsys.readouterr().err
    assert main([*args, "--map", str(path), "--port", "0"]) == 2
    assert "--port must be in 1..65535, got 0" in capsys.readouterr().err
    assert main(args) == 2 and "give --map" in capsys.readouterr().err  # only the bundled pair has a default
    assert main([*args, "--map", str(path), "--max-batch", "0"]) == 2 and "--max-batch" in capsys.readouterr().err
    assert main(["bench", "load", "--model", str(pair_dir / "tgt"), "--clients", "0"]) == 2
    assert "clients" in capsys.readouterr().err
    started = {}
    import uvicorn

    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: started.update(app=app, **kw))
    assert main([*args, "--map", str(path), "--min-handoff-tokens", "-1"]) == 2
    assert "--min-handoff-tokens" in capsys.readouterr().err
    messages = [{"role": "user", "content": TURNS[0]}]
    for shortest in (None, "0"):  # the default floor (defaults.MIN_HANDOFF_TOKENS), then none
        floor = [] if shortest is None else ["--min-handoff-tokens", shortest]
        assert main([*args, "--map", str(path), "--rho", "1", "--port", "8123", *floor]) == 0
        assert started["port"] == 8123 and started["host"] == "127.0.0.1"
        client = TestClient(started["app"])
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["src", "tgt"]
        ask(client, "src", messages)
        r = client.post("/v1/chat/completions", json={"model": "tgt", "messages": messages, "max_tokens": 5})
        body = r.json()
        if shortest is None:  # a prompt of a few tokens: the model reads it itself
            assert body["usage"]["prompt_tokens"] < MIN_HANDOFF_TOKENS and body["rarecache"]["handed_off_from"] is None
            assert (body["rarecache"]["handoff"], body["rarecache"]["fallback_reason"]) == ("fallback_reprefill",
                                                                                            "short_prompt")
            assert r.headers["x-vsr-kv-transfer-status"] == "fallback_reprefill"
        else:  # the map's id is its file's sha256, named for a router
            assert body["rarecache"]["handed_off_from"] == "src"
            assert body["rarecache"]["mapper_id"] == r.headers["x-vsr-kv-mapper-id"] == sha256_file(path)


def test_switch_bench_rho_one_agrees_with_rereading(chat, tmp_path):
    """The load generator's two arms: at ρ = 1 the handoff arm answers exactly what the re-reading
    arm answers, hands off at every switch (both directions with a reverse map) and keeps rows
    on the turns that stay."""
    from rarecache.bench.serve import SwitchBenchConfig, run_switch_bench

    models, maps = chat
    (tmp_path / "passages.txt").write_text("\n\n\n".join(f"{t} and {t} again, the lazy dog" for t in TURNS))
    cfg = SwitchBenchConfig(conversations=2, passage_tokens=20, schedule=("source", "target", "target", "source"),
                            max_new_tokens=4, corpus=str(tmp_path / "passages.txt"), handoff=HandoffConfig(rho=1.0),
                            questions=("the fox?", "the dog?", "add?", "spaces?"))
    lines = []
    out = run_switch_bench(models["small"], models["large"], maps[("small", "large")], maps[("large", "small")],
                           cfg, emit=lines.append)
    rows = out["rows"]
    assert len(rows) == 8 and all(r["same_answer"] for r in rows)
    assert [r["switched"] for r in rows[:4]] == [False, True, False, True]
    for r in rows:
        if r["switched"]:
            assert r["handed_off_from"] is not None and r["recomputed"] == r["handed_off"]
            assert r["baseline_reused"] < r["rarecache_reused"] + r["handed_off"]
        elif r["turn"] > 0:
            assert r["handed_off_from"] is None and r["rarecache_reused"] == r["baseline_reused"] > 0
    assert out["switches"] == 4 and out["switch_same_answer"] == 4 and "speed-up" in lines[-1]


def test_switch_bench_passages_avoid_calibration_documents(chat, pair_dir):
    from rarecache.bench.serve import SwitchBenchConfig, passages
    from rarecache.transfer.fitting.corpus import load_corpus

    models, maps = chat
    corpus = load_corpus(str(pair_dir / "corpus.txt"))
    info = maps[("small", "large")].info
    assert info.corpus["fingerprint"] == corpus.fingerprint
    used = len(corpus.documents) - 3
    mapper = SimpleNamespace(info=replace(info, calibration={**info.calibration, "documents_used": used}))
    cfg = SwitchBenchConfig(conversations=3, passage_tokens=20, corpus=str(pair_dir / "corpus.txt"))
    got = passages(cfg, models["small"], [mapper])
    tok = models["small"].tokenizer
    assert got == [tok.decode(tok.encode(d)[:20]) for d in corpus.documents[used:][::-1]]
    with pytest.raises(RarecacheError, match="fewer than 4 unused documents"):
        passages(replace(cfg, conversations=4), models["small"], [mapper])
    other = SimpleNamespace(info=replace(info, corpus={**info.corpus, "fingerprint": "another"}))
    assert len(passages(replace(cfg, conversations=5), models["small"], [other])) == 5  # another corpus's map


def events(response) -> list:
    """The data lines of a server-sent-events body, JSON-decoded ([DONE] kept as a string)."""
    import json

    out = [line[len("data: "):] for line in response.text.split("\n") if line.startswith("data: ")]
    return [x if x == "[DONE]" else json.loads(x) for x in out]


def test_streaming_equals_the_whole_answer(chat):
    """Streamed pieces add up to the answer a plain request gets; the last chunk carries the finish
    reason and the handoff record, the usage chunk comes when asked, then [DONE]."""
    messages = [{"role": "user", "content": TURNS[0]}]
    whole = TestClient(create_app(service(chat, rho=0.3)))
    ask(whole, "small", messages, max_tokens=8)
    want = ask(whole, "large", messages, max_tokens=8)
    client = TestClient(create_app(service(chat, rho=0.3)))
    ask(client, "small", messages, max_tokens=8)
    r = client.post("/v1/chat/completions", json={"model": "large", "messages": messages, "max_tokens": 8,
                                                  "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    ev = events(r)
    assert ev[-1] == "[DONE]" and ev[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in ev[:-1] if e["choices"])
    assert text == want["choices"][0]["message"]["content"]
    last = [e for e in ev[:-1] if e["choices"]][-1]
    assert last["choices"][0]["finish_reason"] == want["choices"][0]["finish_reason"]
    assert last["rarecache"]["handed_off_from"] == "small"
    assert last["rarecache"]["recomputed_tokens"] == want["rarecache"]["recomputed_tokens"]
    assert ev[-2]["usage"] == want["usage"] and ev[-2]["choices"] == []


def test_stop_strings_cut_the_answer_streamed_or_not(chat):
    messages = [{"role": "user", "content": TURNS[1]}]
    full = ask(TestClient(create_app(service(chat))), "small", messages, max_tokens=10)["choices"][0]["message"]
    text = full["content"]
    assert len(text) >= 4
    stop = text[len(text) // 2: len(text) // 2 + 2]
    want = text[: text.index(stop)]
    client = TestClient(create_app(service(chat)))
    body = ask(client, "small", messages, max_tokens=10, stop=[stop, "never in it"])
    assert body["choices"][0] == {"index": 0, "message": {"role": "assistant", "content": want},
                                  "finish_reason": "stop"}
    r = client.post("/v1/chat/completions", json={"model": "small", "messages": messages, "max_tokens": 10,
                                                  "stop": stop, "stream": True})
    ev = events(r)[:-1]
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in ev) == want
    assert ev[-1]["choices"][0]["finish_reason"] == "stop"


def test_an_answer_ended_early_leaves_a_consistent_cache(chat):
    """A cancelled answer (or one cut by a stop string) ends before its last token is fed to
    the model: the held entry must not claim that token's row, so the next turn, which keeps
    the entry, still equals the model answering the whole conversation itself."""
    models, _ = chat
    svc = service(chat)
    messages = [{"role": "user", "content": TURNS[0]}]
    calls = []  # asked once at admission, then after each token
    first = svc.complete("large", messages, SamplingConfig(max_new_tokens=6, ignore_eos=True),
                         cancelled=lambda: calls.append(1) or len(calls) >= 4)
    assert len(first.tokens) == 3 and first.finish_reason == "stop"
    assert_rows_held(svc)
    messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": TURNS[1]}]
    reply = svc.complete("large", messages, SAMPLING)
    assert reply.reused > 0 and reply.tokens == fresh_answer(models["large"], messages)
    assert_rows_held(svc)
    svc.complete("large", messages, SamplingConfig(max_new_tokens=6), stop=(reply.text[1:3],))
    assert_rows_held(svc)


def test_oversized_bodies_are_refused_before_they_are_read(chat):
    client = TestClient(create_app(service(chat), max_body=2000))
    big = {"model": "small", "messages": [{"role": "user", "content": "x" * 3000}]}
    r = client.post("/v1/chat/completions", json=big)
    assert r.status_code == 413 and "exceeds 2000 bytes" in r.json()["error"]["message"]

    def chunks():  # no content-length: counted as it arrives
        import json

        data = json.dumps(big).encode()
        for i in range(0, len(data), 500):
            yield data[i: i + 500]

    r = client.post("/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert client.post("/v1/chat/completions", json={**big, "messages": [{"role": "user", "content": "x"}],
                                                     "max_tokens": 2}).status_code == 200


def test_a_full_queue_answers_503_and_frees_up(chat):
    """One request runs and `max_waiting` wait; the next gets a 503 with Retry-After, and once the
    line moves, requests are taken again (streamed ones release their place too)."""
    import threading
    import time

    svc = service(chat, max_batch=1)
    client = TestClient(create_app(svc, max_waiting=1))
    body = {"model": "small", "messages": [{"role": "user", "content": TURNS[0]}], "max_tokens": 2}
    results = []
    svc.lock.acquire()  # the models are busy
    try:
        threads = [threading.Thread(target=lambda: results.append(client.post("/v1/chat/completions", json=body)))
                   for _ in range(2)]
        for t in threads:
            t.start()
        for _ in range(400):  # both admitted: one in the place of the running request, one waiting
            if client.get("/health").json()["requests_in_flight"] == 2:
                break
            time.sleep(0.05)
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 503 and r.headers["retry-after"] == "1" and "busy" in r.json()["error"]["message"]
    finally:
        svc.lock.release()
    for t in threads:
        t.join()
    assert [x.status_code for x in results] == [200, 200]
    assert "[DONE]" in client.post("/v1/chat/completions", json={**body, "stream": True}).text
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    assert client.get("/health").json()["requests_in_flight"] == 0


def test_running_answers_are_decoded_in_one_batch_and_equal_alone(chat):
    """Requests queued together are decoded together (up to max_batch answers per step), and each
    answer, greedy or sampled with its own seed, is the one its model gives alone; the same
    conversation asked twice at once does not share a cache being written."""
    import threading

    models, _ = chat
    svc = service(chat, max_batch=3)
    sizes = {name: [] for name in models}
    originals = {name: llm.runner.decode_step for name, llm in models.items()}

    def spy(name):
        def step(tokens, positions, caches):
            sizes[name].append(len(caches))
            return originals[name](tokens, positions, caches)
        return step

    greedy = SamplingConfig(max_new_tokens=8, ignore_eos=True)
    # the first three run together and ask the same conversation, two of them sampled
    jobs = [("large", [{"role": "user", "content": TURNS[1]}], greedy)]
    jobs += [("large", [{"role": "user", "content": TURNS[1]}],
              SamplingConfig(max_new_tokens=8, temperature=1.0, top_p=0.9, seed=k, ignore_eos=True)) for k in (3, 4)]
    jobs += [("large", [{"role": "user", "content": TURNS[k % 3]}], greedy) for k in range(3)]
    jobs += [("small", [{"role": "user", "content": TURNS[2]}], greedy)]
    got = [None] * len(jobs)

    def ask_(k):
        got[k] = svc.complete(jobs[k][0], jobs[k][1], jobs[k][2])

    for name, llm in models.items():
        llm.runner.decode_step = spy(name)
    try:
        with svc.lock:  # all of them queue before the worker starts
            threads = [threading.Thread(target=ask_, args=(k,)) for k in range(len(jobs))]
            for t in threads:
                t.start()
            while sum(svc.load) < len(jobs) - 1:  # the worker holds one, blocked on the lock
                threading.Event().wait(0.01)
        for t in threads:
            t.join()
    finally:
        for name, llm in models.items():
            del llm.runner.decode_step  # back to the class's method
    for (who, messages, cfg), reply in zip(jobs, got):
        assert reply.tokens == models[who].generate([messages], cfg)[0].tokens
    assert max(sizes["large"]) == 3 and 1 in sizes["large"]
    assert svc.load == (0, 0) and not any(e.busy for es in svc.store.entries.values() for e in es)
    assert_rows_held(svc)


def test_a_failing_request_does_not_stop_the_others(chat):
    """A stream callback that raises fails its own request only; the worker keeps serving."""
    models, _ = chat
    svc = service(chat, max_batch=2)
    messages = [{"role": "user", "content": TURNS[0]}]

    def broken(piece):
        raise OSError("client socket closed")

    with pytest.raises(OSError):
        svc.complete("small", messages, SAMPLING, on_text=broken)
    assert svc.complete("small", messages, SAMPLING).tokens == fresh_answer(models["small"], messages)
    assert_rows_held(svc)
    svc.close()
    with pytest.raises(RarecacheError, match="closed"):
        svc.complete("small", messages, SAMPLING)


def test_load_bench_arms_agree_and_the_batched_arm_batches(chat, tmp_path):
    """The load generator: both arms answer every request, with the same answers, and only the
    batched arm ever decodes more than one answer in a step."""
    from rarecache.bench.load import LoadBenchConfig, run_load_bench

    models, _ = chat
    llm = models["large"]
    (tmp_path / "passages.txt").write_text("\n\n\n".join(f"{t} and {t} again, the lazy dog {k}"
                                                          for k, t in enumerate(TURNS * 3)))
    sizes = []
    original = llm.runner.decode_step
    llm.runner.decode_step = lambda t, p, c: sizes.append(len(c)) or original(t, p, c)
    try:
        lines = []
        out = run_load_bench(llm, LoadBenchConfig(clients=3, requests=2, prompt_tokens=16, max_new_tokens=6,
                                                  corpus=str(tmp_path / "passages.txt")), emit=lines.append)
    finally:
        del llm.runner.decode_step
    assert out["requests"] == 6 and out["same_answers"] == 6
    assert all(out["arms"][a]["tokens"] == 36 for a in out["arms"])
    steps_alone = 6 * 5 + 3  # 5 steps per answer alone, plus the warm-up's
    assert sizes[:steps_alone] == [1] * steps_alone and max(sizes[steps_alone:]) == 3
    assert "throughput" in lines[-1]
    with pytest.raises(RarecacheError):
        LoadBenchConfig(clients=0)


# -- hardening (#18): numerically safe sampling, one error shape, strict types, tenants kept apart


def _no_error_events(response) -> bool:
    return not any(isinstance(e, dict) and "error" in e for e in events(response))


@pytest.mark.parametrize("sampling", [{"temperature": 1e-40}, {"temperature": 5e-324}, {"temperature": 1e-300},
                                      {"temperature": 0.7, "top_p": 1e-300}, {"temperature": 2, "top_p": 5e-324}])
def test_tiny_sampling_values_are_answered(chat, sampling):
    """Temperatures too small to divide by are greedy; a top_p below every probability keeps the top
    token. Streamed or not, the answer is a 200 with no error event."""
    client = TestClient(create_app(service(chat)))
    messages = [{"role": "user", "content": TURNS[0]}]
    body = ask(client, "small", messages, max_tokens=3, **sampling)
    if sampling["temperature"] < 1e-5:
        assert body["choices"][0]["message"]["content"] == ask(client, "small", messages, max_tokens=3)[
            "choices"][0]["message"]["content"]
    r = client.post("/v1/chat/completions", json={"model": "small", "messages": messages, "max_tokens": 3,
                                                  "stream": True, **sampling})
    assert r.status_code == 200 and _no_error_events(r) and events(r)[-1] == "[DONE]"


def _openai_error(r, status: int) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and isinstance(body["error"]["message"], str) and body["error"]["type"]
    return body["error"]["message"]


def test_every_error_has_the_openai_shape(chat):
    client = TestClient(create_app(service(chat)))
    post = "/v1/chat/completions"
    deep = b'{"model": "small", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    json_headers = {"content-type": "application/json"}
    assert "JSON" in _openai_error(client.post(post, content=deep, headers=json_headers), 400)
    bad_utf8 = b'{"model": "small", "messages": [{"role": "user", "content": "\xff\xfe"}]}'
    assert "UTF-8" in _openai_error(client.post(post, content=bad_utf8, headers=json_headers), 400)
    nan = b'{"model": "small", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}'
    assert "temperature" in _openai_error(client.post(post, content=nan, headers=json_headers), 400)
    huge_int = b'{"model": "small", "messages": [], "max_tokens": 1' + b"0" * 5000 + b"}"
    _openai_error(client.post(post, content=huge_int, headers=json_headers), 400)
    _openai_error(client.post(post, content=b"[]", headers=json_headers), 400)
    _openai_error(client.get("/no/such/path"), 404)
    _openai_error(client.get(post), 405)


@pytest.mark.parametrize("field, value", [("max_tokens", True), ("max_tokens", "2"), ("max_tokens", 2.0),
                                          ("stream", "yes"), ("stream", 1), ("temperature", "0.5"),
                                          ("temperature", True), ("seed", 1.5), ("seed", "3"), ("top_p", False),
                                          ("stop", 5), ("stop", ["a", 5]), ("model", 7), ("user", 1),
                                          ("stream_options", {"include_usage": "yes"}), ("cache_salt", 5),
                                          ("cache_salt", ""), ("max_completion_tokens", "4")])
def test_no_silent_coercion(chat, field, value):
    client = TestClient(create_app(service(chat)))
    body = {"model": "small", "messages": [{"role": "user", "content": "hi"}], field: value}
    if field not in ("max_tokens", "max_completion_tokens"):
        body["max_tokens"] = 2
    assert field in _openai_error(client.post("/v1/chat/completions", json=body), 400)
    content = {"model": "small", "messages": [{"role": "user", "content": 5}], "max_tokens": 2}
    assert "content" in _openai_error(client.post("/v1/chat/completions", json=content), 400)


def test_integers_are_numbers_for_float_fields(chat):
    client = TestClient(create_app(service(chat)))
    ask(client, "small", [{"role": "user", "content": "hi"}], max_tokens=2, temperature=1, top_p=1)


def test_cache_salt_keeps_tenants_apart(chat):
    """Prefix-cache entries, and the other model's rows a handoff would reuse, are shared only
    between requests with the same salt; no salt is a salt of its own."""
    svc = service(chat)
    client = TestClient(create_app(svc))
    messages = [{"role": "user", "content": TURNS[0]}]
    ask(client, "small", messages, cache_salt="tenant-a")
    for salt in ("tenant-b", None):
        info = ask(client, "small", messages, **({"cache_salt": salt} if salt else {}))["rarecache"]
        assert info["reused_tokens"] == 0
        info = ask(client, "large", messages, cache_salt=f"tenant-c-{salt}")["rarecache"]
        assert info["handed_off_from"] is None and info["reused_tokens"] == 0
    assert ask(client, "small", messages, cache_salt="tenant-a")["rarecache"]["reused_tokens"] > 0
    assert ask(client, "large", messages, cache_salt="tenant-a")["rarecache"]["handed_off_from"] == "small"
    assert svc.complete("small", messages, SAMPLING, salt="tenant-a").reused > 0
    assert svc.complete("small", messages, SAMPLING, salt="tenant-d").reused == 0


def test_api_key(chat, monkeypatch):
    client = TestClient(create_app(service(chat), api_key="s3cret"))
    body = {"model": "small", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "s3cret"},
                    {"authorization": "Bearer s3cret2"}, {"authorization": "Basic s3cret"}):
        r = client.post("/v1/chat/completions", json=body, headers=headers)
        assert "API key" in _openai_error(r, 401) and r.json()["error"]["code"] == "invalid_api_key"
        assert r.headers["www-authenticate"] == "Bearer"
        _openai_error(client.get("/v1/models", headers=headers), 401)
        _openai_error(client.get("/docs", headers=headers), 401)
    auth = {"authorization": "Bearer s3cret"}
    assert client.post("/v1/chat/completions", json=body, headers=auth).status_code == 200
    assert client.get("/v1/models", headers=auth).status_code == 200
    assert client.get("/health").status_code == 200  # for load balancers; it shows no conversation


def test_serve_cli_api_key_and_public_host_warning(pair_dir, fitted, tmp_path, monkeypatch, capsys):
    import uvicorn

    _, _, mapper, _ = fitted
    path = tmp_path / "m.safetensors"
    mapper.save(path)
    started = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: started.update(app=app, **kw))
    args = ["serve", "--source", str(pair_dir / "src"), "--target", str(pair_dir / "tgt"), "--dtype", "float32",
            "--map", str(path)]
    monkeypatch.delenv("RARECACHE_API_KEY", raising=False)
    assert main([*args, "--host", "0.0.0.0"]) == 0
    assert "without an API key" in capsys.readouterr().err
    assert TestClient(started["app"]).get("/v1/models").status_code == 200
    assert main([*args, "--host", "0.0.0.0", "--api-key", "k1"]) == 0
    assert "without an API key" not in capsys.readouterr().err
    assert TestClient(started["app"]).get("/v1/models").status_code == 401
    monkeypatch.setenv("RARECACHE_API_KEY", "k2")
    assert main(args) == 0
    client = TestClient(started["app"])
    assert client.get("/v1/models", headers={"authorization": "Bearer k2"}).status_code == 200
    assert client.get("/v1/models", headers={"authorization": "Bearer k1"}).status_code == 401
    assert main([*args, "--api-key", ""]) == 2 and "--api-key" in capsys.readouterr().err


def test_soak_on_the_tiny_pair(pair_dir, fitted, tmp_path, capsys):
    """`rarecache bench soak` end to end at tiny settings: a real server subprocess kept full, then
    overloaded (accepted requests complete, refusals are 503 with Retry-After), killed with SIGKILL
    under load and restarted, then answering."""
    pytest.importorskip("psutil")
    import json

    _, _, mapper, _ = fitted
    path = tmp_path / "m.safetensors"
    mapper.save(path)
    out = tmp_path / "soak.json"
    assert main(["bench", "soak", "--source", str(pair_dir / "src"), "--target", str(pair_dir / "tgt"),
                 "--map", str(path), "--dtype", "float32", "--saturation", "1.5", "--duration", "2",
                 "--overload", "10", "--max-requests", "200", "--max-tokens", "4", "--max-batch", "1",
                 "--max-waiting", "0", "--kill-after", "0.5", "--out", str(out)]) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    result = json.loads(printed[-1])
    assert result == json.loads(out.read_text()) and result["ok"] and result["models"] == ["src", "tgt"]
    over = result["overload"]
    assert over["sent"] > 0 and over["answered"] == over["whole"] > 0
    assert over["refused_503"] == over["refused_with_retry_after"] > 0  # 10x the rate overflows one place
    assert over["other_status"] == over["no_answer"] == 0
    assert result["rss_mib"]["max"] > 0 and result["after_restart"] == {"status": 200, "whole": True}
    assert any(line.startswith("result") and line.endswith("ok") for line in printed)


def test_soak_refuses_to_pick_a_host(tmp_path):
    from rarecache.bench.soak import SoakConfig

    with pytest.raises(RarecacheError, match="127.0.0.1"):
        SoakConfig(serve_args=("--host", "0.0.0.0"))


# -- scoring a final assistant message (vLLM's continue_final_message + prompt_logprobs): Conversation.score over HTTP

SCORED = [("the quick brown fox", "jumps over"), ("the lazy dog", "def add return"), ("tokens and", "spaces"),
          ("add return", "the fox")]


def score(client, model, messages, answer, **kw):
    """POST a conversation ending in `answer` to score; the response body (asserted 200)."""
    r = client.post("/v1/chat/completions", json={
        "model": model, "messages": [*messages, {"role": "assistant", "content": answer}],
        "continue_final_message": True, "add_generation_prompt": False, "prompt_logprobs": 0, "max_tokens": 0, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def scored_logprobs(body) -> list[float]:
    n = body["rarecache"]["final_message_tokens"]
    entries = body["prompt_logprobs"]
    assert len(entries) == body["usage"]["prompt_tokens"] and all(e is None for e in entries[:-n])
    return [next(iter(e.values()))["logprob"] for e in entries[-n:]]


def test_scoring_over_http_is_conversation_score_exactly(chat):
    """One model, no switch: per turn, the logprobs the server returns for the final assistant message,
    added up as `Conversation.score` adds them, give its bits per byte bit for bit; the response is
    vLLM's shape (a {token id: {logprob, rank, decoded_token}} per scored token, null before), and the
    server keeps the scored rows as the Conversation does (each next turn reuses as many positions)."""
    import torch

    from rarecache.transfer.conversation import Conversation

    models, _ = chat
    llm = models["large"]
    svc = service(chat)
    client = TestClient(create_app(svc))
    conv = Conversation({"large": llm}, {})
    messages = []
    for user, answer in SCORED:
        messages.append({"role": "user", "content": user})
        body = score(client, "large", messages, answer)
        turn = conv.score(user, answer, "large")
        lps = scored_logprobs(body)
        lp = lps[0] + (torch.tensor(lps[1:]).sum().item() if len(lps) > 1 else 0.0)
        assert -lp / (math.log(2) * len(answer.encode())) == turn.bpb
        tokens = llm.tokenizer.encode(answer, add_special_tokens=False)
        scored = body["prompt_logprobs"][-len(tokens):]
        assert [int(next(iter(e))) for e in scored] == tokens == turn.tokens
        assert "".join(next(iter(e.values()))["decoded_token"] for e in scored) == answer
        assert all(next(iter(e.values()))["rank"] >= 1 for e in scored)
        info = body["rarecache"]
        assert info["final_message_tokens"] == len(tokens) and info["handed_off_from"] is None
        assert info["reused_tokens"] == turn.reused
        assert body["usage"]["prompt_tokens"] == turn.prompt_tokens + len(tokens)
        assert body["choices"][0]["message"]["content"] == "" and body["choices"][0]["finish_reason"] == "length"
        assert body["usage"]["completion_tokens"] == 0
        (entry,) = svc.store.entries["large"]
        assert entry.held.ids == conv.state["large"].ids  # the prompt and all but the answer's last token
        messages.append({"role": "assistant", "content": answer})
    assert conv.turns[-1].reused > 0
    assert_rows_held(svc)


def test_scoring_across_a_switch_at_rho_one_is_the_model_alone(chat):
    """Switching model every turn through the server at ρ = 1: each turn's scored answer equals the
    model reading the whole conversation itself, and each turn after the first was handed off from
    the model that read the turn before."""
    from .test_drift import direct_bpb

    models, _ = chat
    client = TestClient(create_app(service(chat)))
    messages = []
    for k, (user, answer) in enumerate(SCORED):
        who, other = ("small", "large")[k % 2], ("large", "small")[k % 2]
        messages.append({"role": "user", "content": user})
        body = score(client, who, messages, answer)
        bpb = -sum(scored_logprobs(body)) / (math.log(2) * len(answer.encode()))
        assert bpb == pytest.approx(direct_bpb(models[who], messages, answer), abs=1e-4)
        info = body["rarecache"]
        if k == 0:
            assert info["handed_off_from"] is None
        else:
            assert info["handed_off_from"] == other and info["recomputed_tokens"] == info["handed_off_tokens"] > 0
        messages.append({"role": "assistant", "content": answer})
    assert_rows_held(client.app.state.service)


def test_continuing_a_final_message_scores_it_the_same_and_answers_after_it(chat):
    """With max_tokens > 0 (vLLM's way), the answer continues the final message: the logprobs are the
    ones a max_tokens 0 request returns, and the answer, streamed or not, is the model decoding after
    the prompt and the message read in one pass."""
    import torch

    from rarecache.engine.generate import decode

    models, _ = chat
    llm = models["large"]
    messages = [{"role": "user", "content": SCORED[0][0]}]
    answer = SCORED[0][1]
    only = scored_logprobs(score(TestClient(create_app(service(chat))), "large", messages, answer))
    client = TestClient(create_app(service(chat)))
    body = score(client, "large", messages, answer, max_tokens=4)
    assert scored_logprobs(body) == only
    full = llm.encode(messages) + llm.tokenizer.encode(answer, add_special_tokens=False)
    cache, first = llm.runner.prefill([full], max_len=len(full) + 4)
    want = decode(llm.runner, cache, first.logits, torch.tensor([len(full)]),
                  llm.with_eos(SamplingConfig(max_new_tokens=4)))[0]
    text = llm.tokenizer.decode(want.tokens)
    assert body["choices"][0]["message"]["content"] == text
    assert body["usage"]["completion_tokens"] == len(want.tokens)
    r = client.post("/v1/chat/completions", json={
        "model": "large", "messages": [*messages, {"role": "assistant", "content": answer}],
        "continue_final_message": True, "max_tokens": 4, "stream": True})
    assert r.status_code == 200
    ev = events(r)
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in ev[:-1] if e["choices"]) == text
    assert ev[-2]["rarecache"]["final_message_tokens"] == len(full) - len(llm.encode(messages))
    assert_rows_held(client.app.state.service)


def test_scoring_requests_are_validated(chat):
    """Bad combinations of the scoring fields get a 400 in OpenAI's error shape and leave no cache;
    an engine that cannot read a final message refuses it."""
    svc = service(chat)
    client = TestClient(create_app(svc))
    user = [{"role": "user", "content": "the quick brown fox"}]
    final = [*user, {"role": "assistant", "content": "jumps"}]
    base = {"model": "small", "messages": final, "continue_final_message": True, "prompt_logprobs": 0,
            "max_tokens": 0}

    def err(body, status=400):
        return _openai_error(client.post("/v1/chat/completions", json=body), status)

    assert "stream" in err({**base, "stream": True})
    assert "stream" in err({**base, "stream": True, "max_tokens": 2})
    assert "assistant's" in err({**base, "messages": user})
    assert "needs continue_final_message" in err({**base, "continue_final_message": False})
    assert "needs continue_final_message" in err({"model": "small", "messages": user, "prompt_logprobs": 0})
    for k in (1, 5, -1):
        assert "other than 0" in err({**base, "prompt_logprobs": k})
    assert "0 or more" in err({**base, "prompt_logprobs": -2})
    for bad in ("0", True, 0.0):
        assert "prompt_logprobs" in err({**base, "prompt_logprobs": bad})
    assert "continue_final_message" in err({**base, "continue_final_message": "yes"})
    assert "max_tokens 0" in err({"model": "small", "messages": user, "max_tokens": 0})
    assert "max_tokens 0" in err({"model": "small", "messages": final, "continue_final_message": True,
                                  "max_tokens": 0})
    assert "max_tokens 0" in err({"model": "small", "messages": user, "max_completion_tokens": 0})
    assert "disagree" in err({**base, "max_completion_tokens": 2})
    assert "max_tokens" in err({**base, "max_tokens": -1})
    assert "cannot both be true" in err({**base, "add_generation_prompt": True})
    assert "add_generation_prompt false" in err({"model": "small", "messages": user, "add_generation_prompt": False})
    assert "empty" in err({**base, "messages": [*user, {"role": "assistant", "content": ""}]})
    assert "before the final" in err({**base, "messages": [{"role": "assistant", "content": "jumps"}]})
    assert "nothing to answer" in err({"model": "small", "messages": final, "max_tokens": 2})
    assert "unknown model" in err({**base, "model": "huge"}, 404)
    assert "positions" in err({**base, "messages": [*user, {"role": "assistant", "content": "fox " * 300}]})
    assert "at most" in err({**base, "max_tokens": 2000})
    assert err({**base, "logprobs": True}).endswith(": logprobs")  # still not implemented
    assert err({**base, "top_logprobs": 2}).endswith(": top_logprobs")
    assert not svc.store.entries["small"] and not svc.store.entries["large"]
    ok = client.post("/v1/chat/completions", json={**base, "logprobs": False, "top_logprobs": 0})
    assert ok.status_code == 200 and "prompt_logprobs" in ok.json()

    class OtherEngine(ChatService):  # as the vLLM engine's service: it cannot read a final message
        def prepare_continued(self, *args, **kwargs):
            raise RarecacheError("not supported by this server's engine (vllm): continue_final_message")

    models, maps = chat
    other = TestClient(create_app(OtherEngine(models, maps, ServiceConfig(HandoffConfig(rho=1.0)))))
    r = other.post("/v1/chat/completions", json=base)
    assert "engine" in _openai_error(r, 400) and "continue_final_message" in r.json()["error"]["message"]


def test_poisson_bench_on_our_own_server(chat, tmp_path):
    """The paper's serving experiment on our ChatService (`bench load --poisson`), by the driver the
    vLLM bench uses: the baseline arm reads every prompt itself, the handoff arm hands off every
    request (the same conversations come back at each load: the target's caches of them are
    dropped after each answer), and at ρ = 1 a switched turn answers as the target alone."""
    from rarecache.bench.load import PoissonConfig, ServiceArms, load_summary, run_poisson_bench

    models, maps = chat
    fwd = maps[("small", "large")]
    svc = ChatService(models, {("small", "large"): fwd},
                      ServiceConfig(HandoffConfig(rho=1.0), max_batch=2, min_handoff_tokens=0))
    words = "the quick brown fox jumps over the lazy dog and again".split()
    (tmp_path / "docs.txt").write_text("\n\n\n".join(" ".join(words[(i * 7 + j) % len(words)] for j in range(80))
                                                     for i in range(12)))
    cfg = PoissonConfig(loads=(0.5, 1.0), requests=5, discard=1, prompt_tokens=224, answer_tokens=4, rho=1.0,
                        saturation_batches=1, corpus=str(tmp_path / "docs.txt"))
    arms = ServiceArms(svc)
    try:
        lines = []
        result = run_poisson_bench(arms, "small", "large", cfg, [fwd], {"engine": "rarecache"},
                                   emit=lines.append, engine="rarecache")
        assert result["engine"] == "rarecache" and result["bench"] == "rarecache-load"
        assert set(result["saturation_rps"]) == {"rarecache", "rarecache+handoff"}
        for p in result["points"]:
            assert p["rarecache"]["handed_off"] == 0 and p["rarecache+handoff"]["handed_off"] == 5
            assert all(p[a]["counted"] == 4 and 0 < p[a]["ttft_p50_s"] <= p[a]["ttft_p99_s"]
                       for a in ("rarecache", "rarecache+handoff"))
        assert all(v > 0 for v in load_summary(result).values()) and "rarecache+handoff" in lines[-2]
        assert svc.store.entries["large"] == []  # every target turn forgotten after its answer
        # one switched turn, both arms: the same tokens at ρ = 1; the baseline read it all itself
        from rarecache.bench.serve import switched_conversations

        (ids, salt), = switched_conversations(arms, "small", "large", 224, 1, 4, 3, [fwd], str(tmp_path / "docs.txt"))
        sampling = SamplingConfig(max_new_tokens=3, ignore_eos=True)
        alone = arms.answer("large", ids, sampling, salt=salt, reread=True)
        handed = arms.answer("large", ids, sampling, salt=salt, rho=1.0)
        assert alone.prefilled == len(ids) and alone.handed_off_from is None
        assert handed.handed_off_from == "small" and handed.note is None and handed.tokens == alone.tokens
        assert handed.seconds["first_token"] > 0
        from rarecache.transfer.handoff import budget

        half = arms.answer("large", ids, sampling, salt=salt, rho=0.5)  # the request's own budget, as in vLLM
        assert half.handed_off_from == "small" and half.rho == 0.5 and half.recomputed == budget(0.5, half.handed_off)
    finally:
        svc.close()


def _switched_score(svc: ChatService, salt: str, **budget):
    """The small model answers a turn, then the large one scores a given answer to the next: its
    prompt is handed off (with the request's own budget, if given); the reply."""
    first = [{"role": "user", "content": TURNS[0]}]
    reply = svc.complete("small", first, SAMPLING, salt=salt)
    messages = first + [{"role": "assistant", "content": reply.text}, {"role": "user", "content": TURNS[1]},
                        {"role": "assistant", "content": "a given answer to score"}]
    prompt = svc.prepare_continued("large", messages, None, salt=salt)
    return svc.continue_final("large", prompt, None, salt=salt, **budget)


def test_a_request_names_its_own_budget(chat):
    """A request's own ρ and selector replace the server's for that request only: its scores equal a
    server started with that budget, bit for bit, and differ from the server's own budget; ρ = 1 is
    the model's own prefill; the reply says which budget the handoff had."""
    from rarecache.transfer.handoff import budget

    models, maps = chat
    svc = service(chat, rho=0.3)  # the server's budget: 0.3, rank
    default = _switched_score(svc, "a")
    own = _switched_score(svc, "b", rho=0.5, selector="suffix")
    after = _switched_score(svc, "c")  # the next request without one: the server's again
    suffix = ServiceConfig(HandoffConfig(0.5, "suffix"), min_handoff_tokens=0)
    started = _switched_score(ChatService(models, maps, suffix), "b")
    assert (default.rho, default.selector, after.rho, after.selector) == (0.3, "rank", 0.3, "rank")
    assert (own.rho, own.selector) == (0.5, "suffix") and own.handed_off_from == "small"
    assert own.recomputed == budget(0.5, own.handed_off) and default.recomputed == budget(0.3, default.handed_off)
    assert own.prompt_logprobs == started.prompt_logprobs and own.recomputed == started.recomputed
    assert own.prompt_logprobs != default.prompt_logprobs and after.prompt_logprobs == default.prompt_logprobs
    exact = _switched_score(svc, "d", rho=1)
    alone = _switched_score(ChatService(models, {}), "d")  # no map: the large model reads it all itself
    assert exact.rho == 1.0 and exact.recomputed == exact.handed_off and alone.handed_off_from is None
    assert [t for t, *_ in exact.prompt_logprobs] == [t for t, *_ in alone.prompt_logprobs]
    assert [lp for _, lp, *_ in exact.prompt_logprobs] == pytest.approx([lp for _, lp, *_ in alone.prompt_logprobs],
                                                                         abs=1e-5)


def test_the_budget_in_a_request_is_checked_and_reported(chat):
    """Over HTTP: the `rarecache` object's budget is used and reported; every mistake in it is a 400
    before any work is queued."""
    models, _ = chat
    svc = service(chat, rho=0.3)
    client = TestClient(create_app(svc))
    messages = [{"role": "user", "content": TURNS[0]}]
    messages += [{"role": "assistant", "content": ask(client, "small", messages)["choices"][0]["message"]["content"]},
                 {"role": "user", "content": TURNS[1]}]
    body = ask(client, "large", messages, rarecache={"rho": 1, "selector": "random"})
    info = body["rarecache"]
    assert info["handed_off_from"] == "small" and (info["rho"], info["selector"]) == (1.0, "random")
    assert info["recomputed_tokens"] == info["handed_off_tokens"] > 0
    assert body["choices"][0]["message"]["content"] == models["large"].generate(
        [messages], SamplingConfig(max_new_tokens=5))[0].text  # rho 1: the model's own answer

    def err(options):
        r = client.post("/v1/chat/completions", json={"model": "large", "messages": messages, "max_tokens": 5,
                                                      "rarecache": options})
        assert r.status_code == 400, r.text
        return r.json()["error"]["message"]

    held = svc.held_bytes()
    assert "rho must be a number in [0, 1]" in err({"rho": 1.5})
    assert "rho must be a number in [0, 1]" in err({"rho": -0.1})
    assert "needs a server started with --rho auto" in err({"rho": "auto"})
    for wrong in ({"rho": "0.2"}, {"rho": True}, {"rho": None, "budget": 1}, {"selector": 3}, "rank", [0.2]):
        assert err(wrong)
    assert "oracle" in err({"selector": "attn-target"})
    assert "unknown selector 'nope'" in err({"selector": "nope"})
    assert svc.held_bytes() == held  # nothing was queued


def test_an_operator_can_refuse_a_requests_budget(chat):
    """--no-request-budget: a request may name only the server's own budget; oracles are refused as
    a server's budget too (they read the target's own prefill)."""
    from rarecache.serve.service import request_budget

    models, maps = chat
    closed = ServiceConfig(HandoffConfig(0.3, "suffix", seed=7), request_budget=False)
    assert request_budget(closed, 0.3, "suffix") == closed.budget == request_budget(closed)
    assert request_budget(closed, 0.3) == closed.budget  # the server's selector and seed are kept
    for rho, selector in ((0.5, None), (0.3, "rank"), (None, "rank")):
        with pytest.raises(RarecacheError, match="its own budget only"):
            request_budget(closed, rho, selector)
    opened = replace(closed, request_budget=True)
    assert request_budget(opened, 0.5).handoff == HandoffConfig(0.5, "suffix", seed=7)
    layer = ServiceConfig(HandoffConfig.named(0.3, "layer-prefix"))  # a schedule, kept by a rho alone
    assert request_budget(layer, 0.5).handoff == HandoffConfig.named(0.5, "layer-prefix")
    with pytest.raises(RarecacheError, match="oracle"):
        ServiceConfig(HandoffConfig(0.3, "l2-oracle"))
    client = TestClient(create_app(ChatService(models, maps, closed)))
    r = client.post("/v1/chat/completions", json={"model": "large", "messages": [{"role": "user", "content": "hi"}],
                                                  "max_tokens": 2, "rarecache": {"rho": 1}})
    assert r.status_code == 400 and "its own budget only" in r.json()["error"]["message"]
    assert ask(client, "large", [{"role": "user", "content": "hi"}], rarecache={"rho": 0.3})  # its own: fine


@pytest.mark.parametrize("selector", ["attn-source", "suffix+attn"])
def test_a_cascade_re_asking_the_same_turn_hands_off_with_the_sources_attention(chat, selector):
    """The small model answered; the same turn goes to the large one (a cascade escalating). The small
    model holds the whole prompt, so it prefills nothing, yet a selector reading its attention needs
    its last query: it computes its last position again (the same row). ρ = 1 is the large model's
    own answer, ρ = 0.3 recomputes the budget, and the small model keeps its rows."""
    from rarecache.transfer.handoff import budget

    models, maps = chat
    svc = ChatService(models, maps, ServiceConfig(HandoffConfig(1.0, selector), min_handoff_tokens=0))
    first = [{"role": "user", "content": TURNS[0]}]
    for salt, rho in (("a", 1.0), ("b", 0.3)):
        small = svc.complete("small", first, SAMPLING, salt=salt)
        large = svc.complete("large", first, SAMPLING, salt=salt, rho=rho)
        assert large.handed_off_from == "small" and large.selector == selector
        assert large.recomputed == budget(rho, large.handed_off) and large.handed_off == large.prompt_tokens
        if rho == 1.0:
            assert large.tokens == fresh_answer(models["large"], first)
        again = svc.complete("small", first, SAMPLING, salt=salt)
        assert again.tokens == small.tokens and again.reused == again.prompt_tokens - 1
    assert_rows_held(svc)


def test_a_two_pass_selector_serves_a_switch_within_its_budget(chat):
    """`query` through the service: a switched turn (and a later one, handing off only the span the model
    has not seen) recomputes its budget in all, both passes counted in `recomputed`; ρ = 1 is the large
    model's own answer."""
    from rarecache.transfer.handoff import budget

    models, maps = chat
    svc = ChatService(models, maps, ServiceConfig(HandoffConfig(1.0, "query"), min_handoff_tokens=0))
    first = [{"role": "user", "content": TURNS[0]}]
    for salt, rho in (("a", 1.0), ("b", 0.5)):
        svc.complete("small", first, SAMPLING, salt=salt)
        large = svc.complete("large", first, SAMPLING, salt=salt, rho=rho)
        assert large.handed_off_from == "small" and large.selector == "query"
        assert large.recomputed == budget(rho, large.handed_off)
        if rho == 1.0:
            assert large.tokens == fresh_answer(models["large"], first)
    later = [*first, {"role": "assistant", "content": "ok"}, {"role": "user", "content": TURNS[1]}]
    svc.complete("small", later, SAMPLING, salt="b")
    large = svc.complete("large", later, SAMPLING, salt="b", rho=0.5)
    assert large.reused > 0 and large.recomputed == budget(0.5, large.handed_off)
    assert_rows_held(svc)
