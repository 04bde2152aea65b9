"""Fuzzing (#18): generated chat requests, map files, GGUF bytes and config.json files get an answer
or a clear refusal, never a 5xx, a traceback or another exception type.

Deterministic by default (`derandomize`: the same examples every run, so CI does not flake);
RARECACHE_FUZZ_RANDOM=1 draws new ones and RARECACHE_FUZZ_SCALE=10 runs ten times as many.
Every example is counted, and the counts are what docs/RELIABILITY.md reports.
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from pathlib import Path

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from rarecache import SamplingConfig  # noqa: E402
from rarecache.engine.generate import sample  # noqa: E402
from rarecache.errors import RarecacheError  # noqa: E402
from rarecache.serve.app import create_app  # noqa: E402
from rarecache.serve.service import ChatService, ServiceConfig  # noqa: E402
from rarecache.transfer.handoff import HandoffConfig, handoff  # noqa: E402
from rarecache.transfer.mapfile import tensors_sha256  # noqa: E402
from rarecache.transfer.mapper import Mapper  # noqa: E402

SCALE = float(os.environ.get("RARECACHE_FUZZ_SCALE", "1"))
RANDOM = bool(os.environ.get("RARECACHE_FUZZ_RANDOM"))
SEEN: Counter = Counter()  # examples run per test, and outcomes


def fuzz(examples: int):
    return settings(max_examples=max(1, int(examples * SCALE)), deadline=None, derandomize=not RANDOM,
                    database=None, suppress_health_check=list(HealthCheck), print_blob=True)


@pytest.fixture(scope="module", autouse=True)
def _report():
    yield
    print("\nfuzz counts:", json.dumps(dict(sorted(SEEN.items()))))


# ------------------------------------------------------------------------------------------ sampling


@fuzz(400)
@given(temperature=st.one_of(st.floats(0, 2), st.sampled_from([0.0, 5e-324, 1e-300, 1e-40, 1e-5, 2.0])),
       top_p=st.one_of(st.floats(0, 1, exclude_min=True), st.sampled_from([5e-324, 1e-300, 1e-40, 1.0])),
       scale=st.sampled_from([1e-3, 1.0, 30.0, 1e4]), seed=st.integers(0, 2**63 - 1))
def test_sampling_is_safe_for_every_accepted_value(temperature, top_p, scale, seed):
    SEEN["sampling"] += 1
    cfg = SamplingConfig(temperature=temperature, top_p=top_p, seed=seed)
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(seed % 1000)) * scale
    tok = sample(logits, cfg, torch.Generator().manual_seed(seed))
    assert tok.shape == (3,) and ((0 <= tok) & (tok < 50)).all()
    if temperature < 1e-5 or top_p < 1e-30:
        assert torch.equal(tok, logits.argmax(-1))


@fuzz(200)
@given(st.fixed_dictionaries({}, optional={
    "max_new_tokens": st.one_of(st.integers(-3, 10), st.floats(allow_nan=True), st.booleans(), st.text(max_size=3)),
    "temperature": st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-3, 3), st.booleans()),
    "top_p": st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-1, 2)),
    "seed": st.one_of(st.integers(-(2**70), 2**70), st.floats(allow_nan=True))}))
def test_sampling_config_accepts_or_refuses_up_front(kw):
    SEEN["sampling_config"] += 1
    try:
        cfg = SamplingConfig(**kw)
    except RarecacheError:
        SEEN["sampling_config.refused"] += 1
        return
    sample(torch.randn(1, 20), cfg, torch.Generator().manual_seed(0))  # whatever it accepts, it samples


# ------------------------------------------------------------------------------------------ requests

JSON = st.recursive(st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=12),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                                 max_size=3), max_leaves=6)
TEXT = st.text(max_size=40)
MESSAGE = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]), "content": TEXT}),
    st.fixed_dictionaries({"role": st.sampled_from(["user"]), "content": TEXT}),
    st.fixed_dictionaries({"role": st.one_of(st.sampled_from(["tool", "robot", "USER"]), JSON), "content": TEXT}),
    st.fixed_dictionaries({"role": st.just("user"), "content": JSON}),
    st.fixed_dictionaries({"role": st.just("user"), "content": TEXT, "name": TEXT}),
    JSON,
)
GOOD_MESSAGES = st.tuples(
    st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]), "content": TEXT}),
             max_size=3),
    TEXT).map(lambda t: [*t[0], {"role": "user", "content": t[1]}])
GOOD = {  # values a client may send, within this server's limits
    "max_tokens": st.integers(1, 3),
    "max_completion_tokens": st.integers(1, 3),
    "temperature": st.one_of(st.floats(0, 2), st.sampled_from([1e-40, 5e-324, 1e-300, 0, 1, 2])),
    "top_p": st.one_of(st.floats(0, 1, exclude_min=True), st.sampled_from([1e-300, 5e-324, 1])),
    "seed": st.integers(0, 2**63 - 1),
    "stop": st.one_of(st.text(min_size=1, max_size=3), st.lists(st.text(min_size=1, max_size=3), max_size=4)),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "cache_salt": st.sampled_from(["a", "b", "tenant-c"]),
    "user": TEXT,
    "n": st.just(1),
    "logprobs": st.just(False),
    "rarecache": st.fixed_dictionaries({}, optional={  # the request's own handoff budget
        "rho": st.one_of(st.floats(0, 1), st.sampled_from([0, 1])),
        "selector": st.sampled_from(["rank", "random", "suffix", "attn-source", "suffix+attn", "layer-prefix"])}),
}
BAD = {  # values a client should not send
    "max_tokens": st.one_of(st.integers(-2, 2**64), st.sampled_from([True, "2", 2.0, 4]), JSON),
    "max_completion_tokens": st.one_of(st.integers(-2, 9), JSON),
    "temperature": st.one_of(st.floats(), st.sampled_from([-1e-300, 2.0000001, "0.5", True]), JSON),
    "top_p": st.one_of(st.floats(), st.sampled_from([0, -0.0, 1.0000001, "1"]), JSON),
    "seed": st.one_of(st.integers(-(2**70), 2**70), st.sampled_from([1.5, "3", True]), JSON),
    "stop": st.one_of(st.just(""), st.text(min_size=65, max_size=70), st.lists(TEXT, min_size=5, max_size=6), JSON),
    "stream": st.one_of(st.sampled_from(["yes", 1, 0, "true"]), JSON),
    "stream_options": JSON,
    "cache_salt": st.one_of(st.just(""), st.integers(), JSON),
    "user": JSON,
    "n": st.one_of(st.integers(2, 5), JSON),
    "tools": JSON,
    "logprobs": st.one_of(st.just(True), JSON),
    "frequency_penalty": st.one_of(st.floats(), JSON),
    "unknown_field": JSON,
    "rarecache": st.one_of(
        JSON,
        st.fixed_dictionaries({"rho": st.one_of(st.floats(min_value=1.0000001), st.floats(max_value=-1e-300),
                                                st.sampled_from(["auto", "0.5", True, float("nan")]))}),
        st.fixed_dictionaries({"selector": st.one_of(st.sampled_from(["l2-oracle", "attn-target", "nope", ""]),
                                                     st.integers())}),
        st.fixed_dictionaries({"budget": JSON})),
    "model": st.one_of(st.sampled_from(["huge", "", "SMALL"]), JSON),
    "messages": st.one_of(st.lists(MESSAGE, max_size=4), JSON),
}
VALID = st.fixed_dictionaries({"model": st.sampled_from(["small", "large"]), "messages": GOOD_MESSAGES},
                              optional=GOOD)
ONE_BAD = st.tuples(VALID, st.sampled_from(sorted(BAD)).flatmap(lambda k: st.tuples(st.just(k), BAD[k]))).map(
    lambda t: {**t[0], t[1][0]: t[1][1]})
JUNK = st.fixed_dictionaries({"model": st.one_of(st.sampled_from(["small", "large"]), JSON),
                              "messages": st.one_of(st.lists(MESSAGE, max_size=4), JSON)},
                             optional={k: st.one_of(GOOD.get(k, JSON), v) for k, v in BAD.items()
                                       if k not in ("model", "messages")})
REQUEST = st.one_of(VALID, ONE_BAD, JUNK)


@pytest.fixture(scope="module")
def served(chat):
    models, maps = chat
    svc = ChatService(models, maps, ServiceConfig(HandoffConfig(0.3, "rank"), cache_bytes=1 << 20, max_new_tokens=3,
                                                  max_batch=2, min_handoff_tokens=0))
    return svc, TestClient(create_app(svc, default_max_tokens=2))


def check_response(r, svc, label: str) -> None:
    """Never a 5xx; a 4xx is OpenAI's error object; a 200 is a whole answer (streamed: no error event)."""
    SEEN[f"{label}.{r.status_code}"] += 1
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        body = r.json()
        assert set(body) == {"error"}, body
        assert isinstance(body["error"]["message"], str) and isinstance(body["error"]["type"], str), body
    elif r.headers.get("content-type", "").startswith("text/event-stream"):
        data = [line[6:] for line in r.text.split("\n") if line.startswith("data: ")]
        assert data[-1] == "[DONE]" and not any('"error"' in d[:10] for d in data), r.text
        assert json.loads(data[-2]).get("choices") is not None
    else:
        assert r.json()
    assert svc.load == (0, 0) and not any(e.busy for es in svc.store.entries.values() for e in es)


@fuzz(1000)
@given(REQUEST)
def test_generated_chat_requests(served, body):
    svc, client = served
    SEEN["requests"] += 1
    raw = json.dumps(body).encode()  # NaN and Infinity as Python writes them (httpx's json= refuses them)
    check_response(client.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"}),
                   svc, "requests")


BODY = st.one_of(
    st.binary(max_size=300),
    REQUEST.map(lambda b: json.dumps(b).encode()).flatmap(
        lambda raw: st.integers(0, len(raw)).map(lambda k: raw[:k])),  # truncated JSON
    REQUEST.map(lambda b: json.dumps(b, ensure_ascii=False).encode()).flatmap(
        lambda raw: st.tuples(st.integers(0, len(raw)), st.binary(min_size=1, max_size=3)).map(
            lambda t: raw[:t[0]] + t[1] + raw[t[0]:])),  # a few stray bytes, invalid UTF-8 among them
    st.integers(1, 200_000).map(lambda d: b'{"model": "small", "messages": ' + b"[" * d + b"]" * d + b"}"),
    st.integers(4300, 6000).map(lambda d: b'{"model": "small", "messages": [], "seed": 1' + b"0" * d + b"}"),
    st.just(b'{"model": "small", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}'),
)


@fuzz(300)
@given(body=BODY, method=st.sampled_from(["POST", "POST", "POST", "GET", "PUT", "DELETE"]),
       path=st.sampled_from(["/v1/chat/completions"] * 4 + ["/v1/models", "/health", "/v1/", "/nope"]),
       ctype=st.sampled_from(["application/json", "application/json", "text/plain", None]))
def test_generated_raw_bodies(served, body, method, path, ctype):
    svc, client = served
    SEEN["raw_bodies"] += 1
    headers = {"content-type": ctype} if ctype else {}
    check_response(client.request(method, path, content=body, headers=headers), svc, "raw_bodies")


def test_the_server_still_answers_after_fuzzing(served):
    svc, client = served
    r = client.post("/v1/chat/completions", json={"model": "large", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None
    assert client.get("/health").json()["requests_in_flight"] == 0


# ------------------------------------------------------------------------------------------ map files


@pytest.fixture(scope="module")
def map_file(fitted, tmp_path_factory) -> tuple[bytes, dict, dict]:
    """A real map's bytes, its tensors and its header metadata."""
    path = tmp_path_factory.mktemp("fuzzmap") / "m.safetensors"
    fitted[2].save(path)
    with safe_open(str(path), "pt") as f:
        return path.read_bytes(), {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata())


def _edit_tensor(draw, tensors: dict) -> dict:
    tensors = dict(tensors)
    name = draw(st.sampled_from(sorted(tensors)))
    t = tensors[name].clone()
    op = draw(st.sampled_from(["value", "value", "slice", "grow", "dtype", "reshape", "drop", "index"]))
    if op == "value" and t.numel():
        i = draw(st.integers(0, t.numel() - 1))
        v = draw(st.sampled_from([math.nan, math.inf, -math.inf, 1e38, -1e38, 0.0, 1e-45, 99, -1, 2**31]))
        flat = t.reshape(-1)
        flat[i] = v if t.is_floating_point() else int(v) if math.isfinite(v) and abs(v) < 2**62 else 0
    elif op == "slice" and t.dim():
        d = draw(st.integers(0, t.dim() - 1))
        t = t.narrow(d, 0, draw(st.integers(0, t.shape[d])))
    elif op == "grow" and t.dim():
        d = draw(st.integers(0, t.dim() - 1))
        t = torch.cat([t, t.narrow(d, 0, min(1, t.shape[d]))], dim=d)
    elif op == "dtype":
        t = t.to(draw(st.sampled_from([torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64,
                                        torch.uint8, torch.bool, torch.float32])))
    elif op == "reshape":
        t = t.reshape(-1) if draw(st.booleans()) else t.reshape(*t.shape, 1)
    elif op == "drop":
        del tensors[name]
        return tensors, op
    elif op == "index":
        name = draw(st.sampled_from(["k.sources", "v.sources"]))
        t = tensors[name].clone()
        t.reshape(-1)[draw(st.integers(0, t.numel() - 1))] = draw(st.integers(-5, 200))
    tensors[name] = t.contiguous()
    return tensors, op


def _edit_meta(draw, meta: dict) -> dict:
    info = json.loads(meta["rarecache.map"])
    key = draw(st.sampled_from(sorted(info) + ["extra"]))
    if draw(st.booleans()) and key in info:
        del info[key]
    else:
        info[key] = draw(JSON)
    return {**meta, "rarecache.map": json.dumps(info)}


@st.composite
def corrupted_map(draw, base: tuple[bytes, dict, dict]) -> tuple[str, bytes | tuple[dict, dict]]:
    """(what was done, the file's bytes or its tensors and metadata to write)."""
    raw, tensors, meta = base
    kind = draw(st.sampled_from(["truncate", "flip", "tensor", "tensor", "meta", "header"]))
    if kind == "truncate":
        return kind, raw[: draw(st.integers(0, len(raw) - 1))]
    if kind == "flip":  # anywhere: positions uniform (hypothesis would favour the first bytes)
        data, rng = bytearray(raw), draw(st.randoms(use_true_random=False))
        for _ in range(draw(st.integers(1, 8))):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        return kind, bytes(data)
    if kind == "header":  # the safetensors header itself: length, JSON, offsets
        n = int.from_bytes(raw[:8], "little")
        head = bytearray(raw[8: 8 + n])
        for _ in range(draw(st.integers(1, 4))):
            head[draw(st.integers(0, len(head) - 1))] = draw(st.sampled_from(b'0123456789{}[]",:'))
        return kind, raw[:8] + bytes(head) + raw[8 + n:]
    if kind == "tensor":
        tensors, op = _edit_tensor(draw, tensors)
        kind = f"tensor.{op}"
    else:
        meta = _edit_meta(draw, meta)
    checksum = draw(st.sampled_from(["recomputed", "recomputed", "kept", "dropped"]))
    meta = dict(meta)
    if checksum == "recomputed":
        meta["rarecache.map.sha256"] = tensors_sha256(tensors)
    elif checksum == "dropped":
        meta.pop("rarecache.map.sha256")
    return f"{kind}.checksum-{checksum}", (tensors, meta)


@fuzz(400)
@given(data=st.data())
def test_corrupted_map_files(map_file, fitted, tmp_path_factory, data):
    """Loading a corrupted map and checking it against the models either works (and then a handoff through
    it runs) or raises RarecacheError; nothing else."""
    source, target, _, prompts = fitted
    kind, got = data.draw(corrupted_map(map_file))
    SEEN["maps"] += 1
    SEEN[f"maps.{kind.split('.checksum')[0]}"] += 1
    path = tmp_path_factory.getbasetemp() / "fuzzed-map.safetensors"
    if isinstance(got, bytes):
        path.write_bytes(got)
    else:
        try:
            save_file(got[0], str(path), metadata=got[1])
        except Exception:  # safetensors cannot even write it (e.g. no tensors): nothing to load
            SEEN["maps.unwritable"] += 1
            return
    try:
        mapper = Mapper.load(path)
        mapper.check_pair(source, target)
    except RarecacheError:
        SEEN["maps.refused"] += 1
        return
    SEEN["maps.accepted"] += 1
    SEEN[f"maps.accepted.{kind}"] += 1
    mapper.summary()
    handoff(source, target, mapper, [prompts[1]], HandoffConfig(0.3, "rank"))
    handoff(source, target, mapper, [prompts[1]], HandoffConfig(0.0, "rank"))  # through its plain-transfer view


# ------------------------------------------------------------------------------------------ model files


@pytest.fixture(scope="module")
def gguf_bytes(tmp_path_factory) -> tuple[bytes, int]:
    """A tiny real GGUF model's bytes and where its tensor data starts."""
    pytest.importorskip("gguf")
    from gguf import GGUFReader

    from .test_store import make_tiny_gguf

    path = make_tiny_gguf(tmp_path_factory.mktemp("fuzzgguf") / "tiny.gguf", tied=True)
    return path.read_bytes(), GGUFReader(str(path)).data_offset


@fuzz(60)
@given(data=st.data())
def test_bad_gguf_files(gguf_bytes, tmp_path_factory, data):
    """Resolving (converting) and loading a damaged GGUF either works or raises RarecacheError."""
    from rarecache import LLM

    raw, header = gguf_bytes
    kind = data.draw(st.sampled_from(["random", "magic", "truncate", "flip", "flip", "empty"]))
    if kind == "random":
        blob = data.draw(st.binary(max_size=2000))
    elif kind == "magic":
        blob = b"GGUF" + data.draw(st.binary(max_size=2000))
    elif kind == "truncate":
        blob = raw[: data.draw(st.integers(0, len(raw) - 1))]
    elif kind == "flip":  # in the header (key-value metadata, tensor infos): the tensor data is just numbers
        b, rng = bytearray(raw), data.draw(st.randoms(use_true_random=False))
        for _ in range(data.draw(st.integers(1, 4))):
            b[rng.randrange(header)] ^= 1 << rng.randrange(8)
        blob = bytes(b)
    else:
        blob = b""
    SEEN["gguf"] += 1
    SEEN[f"gguf.{kind}"] += 1
    root = tmp_path_factory.mktemp("g")
    (root / "m.gguf").write_bytes(blob)
    try:
        llm = LLM(root / "m.gguf", cache_dir=root / "cache")
        llm.generate(["the"], SamplingConfig(max_new_tokens=2))
    except RarecacheError:
        SEEN["gguf.refused"] += 1
        return
    SEEN["gguf.accepted"] += 1
    SEEN[f"gguf.accepted.{kind}"] += 1


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from .conftest import build_tokenizer, make_tiny

    path = build_tokenizer(tmp_path_factory.mktemp("fuzzcfg"))
    make_tiny("qwen2", path, vocab_size=400)
    return path


CONFIG_KEYS = ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings", "rms_norm_eps",
               "rope_parameters", "rope_theta", "rope_scaling", "tie_word_embeddings", "attention_bias",
               "model_type", "eos_token_id", "bos_token_id", "use_sliding_window", "mlp_bias"]


@fuzz(250)
@given(data=st.data())
def test_bad_config_json(tiny_model, tmp_path_factory, data):
    """A model folder with a generated config.json loads (and runs) or raises RarecacheError."""
    from rarecache.engine.runner import Runner

    raw = json.loads((tiny_model / "config.json").read_text())
    kind = data.draw(st.sampled_from(["edit", "edit", "edit", "bytes", "json"]))
    if kind == "bytes":
        text = data.draw(st.binary(max_size=200))
    elif kind == "json":
        text = json.dumps(data.draw(JSON)).encode()
    else:
        for _ in range(data.draw(st.integers(1, 3))):
            key = data.draw(st.sampled_from(CONFIG_KEYS))
            value = data.draw(st.one_of(JSON, st.integers(-2, 2**20), st.sampled_from(
                [0, 1, 2, 3, 8, 16, 24, 64, 10**9, 10**30, 1.5, -1.0, math.nan, math.inf, "qwen2", "llama", True])))
            if data.draw(st.booleans()) and key in raw:
                del raw[key]
            else:
                raw[key] = value
        text = json.dumps(raw).encode()
    SEEN["configs"] += 1
    SEEN[f"configs.{kind}"] += 1
    root = tmp_path_factory.mktemp("c")
    for f in tiny_model.iterdir():
        (root / f.name).symlink_to(f)
    (root / "config.json").unlink()
    (root / "config.json").write_bytes(text)
    try:
        runner = Runner.load(root)
        cache, out = runner.prefill([[1, 2, 3]])
    except RarecacheError:
        SEEN["configs.refused"] += 1
        return
    SEEN["configs.accepted"] += 1
    assert out.logits.shape[-1] == runner.config.vocab_size
