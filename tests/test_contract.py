"""The serving contract (serve/contract.py): both engines behind one written interface.

The HTTP front never asks a service what it is (no hasattr/getattr in serve/); both services have every
member `ChatBackend` writes down, with its parameters; and the same requests through either engine give
the same response object, the same outcome and the same headers, our own and semantic-router's. The vLLM
engine runs where vLLM is installed (it starts real engines on the tiny pair), and skips, saying so, where
it is not.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import json
import re
from pathlib import Path

import pytest

from rarecache.serve.contract import ChatBackend
from rarecache.serve.outcome import HEADER, ROUTER_MAPPER, ROUTER_STATUS

from .test_vllm import BS, vpair  # noqa: F401  (the tiny pair vLLM can load, and its maps)

fastapi = pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from rarecache.serve.app import create_app  # noqa: E402

SERVE = Path(__file__).resolve().parents[1] / "rarecache" / "serve"
FLOOR = 48  # the servers' min_handoff_tokens here: the long prompt is above it, the short one below
WORDS = "the quick brown fox jumps over the lazy dog def add return tokens spaces".split()
# what every engine's response object has (serve/app.py `_info`); an engine may add its own (`describe`)
FIELDS = {"engine", "reused_tokens", "reused_approximate_tokens", "handed_off_from", "handed_off_tokens",
          "recomputed_tokens", "rho", "selector", "handoff", "fallback_reason", "approximate_rows_reused",
          "mapper_id", "seconds"}
BODY = {"id", "object", "created", "model", "choices", "usage", "rarecache"}


def test_the_front_never_asks_a_service_what_it_is():
    """No hasattr or getattr anywhere in serve/: app.py and metrics.py call the contract, and nothing else."""
    found = []
    for path in sorted(SERVE.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("hasattr",
                                                                                                  "getattr"):
                found.append(f"{path.name}:{node.lineno} {node.func.id}")
    assert not found, "serve/ asks what it holds:\n" + "\n".join(found)


def _members(cls) -> dict[str, inspect.Signature | None]:
    """A class's methods (their signatures) and attributes (None), as the contract names them."""
    out = {}
    for name in {*cls.__dict__, *getattr(cls, "__annotations__", {})}:
        if name.startswith("_"):
            continue
        value = cls.__dict__.get(name)
        out[name] = inspect.signature(value) if inspect.isfunction(value) else None
    return out


def test_both_engines_have_every_member_of_the_contract():
    """Each member of ChatBackend exists on both services (an attribute may be set in __init__), and each
    method takes the contract's parameters by the contract's names (more may follow, with defaults)."""
    from rarecache.adapters.vllm.server.serving import VllmChatService
    from rarecache.serve.service import ChatService

    wanted = _members(ChatBackend)
    assert {"answer", "check_budget", "describe", "prepare", "store_stats", "engine", "map_ids"} <= set(wanted)
    for cls in (ChatService, VllmChatService):
        init = "".join(inspect.getsource(c.__init__) for c in cls.__mro__[:-1] if "__init__" in c.__dict__)
        for name, sig in wanted.items():
            set_in_init = re.search(rf"self\.{name}\b\s*(:[^=\n]*)?=|self\.{name},", init)
            assert hasattr(cls, name) or set_in_init, (cls.__name__, name)
            if sig is None or sig.parameters.keys() == {"self", "args", "kwargs"}:
                continue
            have = inspect.signature(getattr(cls, name)).parameters
            if set(have) == {"self", "args", "kwargs"}:  # (the vLLM engine refuses continue_final whatever it is given)
                continue
            for p in sig.parameters.values():
                assert p.name in have and have[p.name].kind == p.kind, (cls.__name__, name, p.name)
    from rarecache.adapters.vllm.server.serve_config import VllmServeConfig
    from rarecache.serve.settings import ServiceConfig
    from rarecache.serve.contract import Settings

    for cfg in (ServiceConfig, VllmServeConfig):  # the settings the front reads
        for name in _members(Settings):
            assert name in cfg.__dataclass_fields__ or isinstance(getattr(cfg, name, None), property), (cfg, name)


# ---------------------------------------------------------------------------------------------- conformance


@pytest.fixture(scope="module", params=["rarecache", "vllm"])
def backend(request, vpair, tmp_path_factory):  # noqa: F811
    """One engine's service over the tiny pair, the source handing off to the target through the same map
    file (rho 1, rank), prompts under FLOOR tokens re-prefilled."""
    from rarecache.packages import sha256_file

    root, map_file = vpair.root, vpair.root / "src-tgt.map"
    if request.param == "rarecache":
        from rarecache import LLM
        from rarecache.serve.service import ChatService, ServiceConfig
        from rarecache.transfer.handoff import HandoffConfig
        from rarecache.transfer.mapper import Mapper

        svc = ChatService({m: LLM(root / m) for m in ("src", "tgt")}, {("src", "tgt"): Mapper.load(map_file)},
                          ServiceConfig(HandoffConfig(1.0, "rank"), max_new_tokens=16, min_handoff_tokens=FLOOR),
                          map_ids={("src", "tgt"): sha256_file(map_file)})
    else:
        if importlib.util.find_spec("vllm") is None:
            pytest.skip("vLLM is not installed (pip install 'rarecache[vllm]'; see docs/VLLM.md): only our own "
                        "engine was held to the contract")
        from rarecache.adapters.vllm.server.engines import engine_environment
        from rarecache.adapters.vllm.server.serving import VllmChatService, VllmServeConfig

        engine_environment()
        cfg = VllmServeConfig(store=tmp_path_factory.mktemp("rows"), rho=1.0, selector="rank", dtype="float32",
                              max_new_tokens=16, kv_cache_bytes=64 << 20, block_size=BS, max_model_len=512,
                              min_handoff_tokens=FLOOR)
        svc = VllmChatService({m: root / m for m in ("src", "tgt")}, {("src", "tgt"): map_file}, cfg)
    yield svc, TestClient(create_app(svc)), sha256_file(map_file)
    svc.close()


def _messages(tokens_at_least: int, seed: int) -> list[dict]:
    words = [WORDS[(seed * 7 + 3 * i) % len(WORDS)] for i in range(tokens_at_least)]
    return [{"role": "user", "content": " ".join(words)}]


def _post(client, model, messages, salt, headers=None, **kw):
    r = client.post("/v1/chat/completions", headers=headers or {},
                    json={"model": model, "messages": messages, "max_tokens": 4, "cache_salt": salt, **kw})
    assert r.status_code == 200, r.text
    return r


def _check(r, status: str, reason: str | None, mapper: str | None = None) -> dict:
    """The response object and headers every engine gives, with this outcome."""
    body = r.json()
    info = body["rarecache"]
    assert BODY <= set(body) and FIELDS <= set(info), sorted(FIELDS - set(info))
    assert (info["handoff"], info["fallback_reason"], info["mapper_id"]) == (status, reason, mapper)
    assert r.headers[HEADER].startswith(status + (f"; reason={reason}" if reason else "") + "; approximate=")
    assert r.headers[ROUTER_STATUS] == status
    assert r.headers.get(ROUTER_MAPPER) == mapper
    return info


def test_the_same_requests_give_the_same_responses_on_every_engine(backend):
    """A conversation read by the source, then sent to the target: handed off through the map (its id named
    in the body and semantic-router's header); through a map the router names only if it is the server's
    (else the target reads it, identity_mismatch); a prompt under the floor read by the target (short_prompt);
    the source, which nothing maps into, unsupported. The same in each engine."""
    svc, client, map_id = backend
    long, short = _messages(FLOOR + 40, 1), _messages(4, 2)
    assert len(svc.prepare("tgt", long, _sampling())) >= FLOOR + BS > len(svc.prepare("tgt", short, _sampling()))
    assert svc.prepare("tgt", short, _sampling()).__len__() < FLOOR

    info = _check(_post(client, "src", long, "a"), "unsupported", None)
    assert info["handed_off_from"] is None and info["engine"] == svc.engine
    info = _check(_post(client, "tgt", long, "a"), "applied", None, map_id)
    assert info["handed_off_from"] == "src" and info["handed_off_tokens"] > 0 and info["rho"] == 1.0

    _post(client, "src", long, "b")
    info = _check(_post(client, "tgt", long, "b", headers={ROUTER_MAPPER: "f" * 64}), "fallback_reprefill",
                  "identity_mismatch")
    assert info["handed_off_from"] is None
    _post(client, "src", long, "c")
    _check(_post(client, "tgt", long, "c", headers={ROUTER_MAPPER: map_id}), "applied", None, map_id)

    _post(client, "src", short, "d")
    info = _check(_post(client, "tgt", short, "d"), "fallback_reprefill", "short_prompt")
    assert info["handed_off_from"] is None and info["recomputed_tokens"] is None

    _post(client, "src", long, "e")  # streamed: the last chunk carries the same object
    r = client.post("/v1/chat/completions", json={"model": "tgt", "messages": long, "max_tokens": 4,
                                                  "cache_salt": "e", "stream": True})
    last = json.loads([x[6:] for x in r.text.split("\n") if x.startswith("data: {")][-1])["rarecache"]
    assert FIELDS <= set(last) and (last["handoff"], last["mapper_id"]) == ("applied", map_id)
    if svc.streams_outcome:  # headers that waited for the outcome
        assert r.headers[ROUTER_STATUS] == "applied" and r.headers[ROUTER_MAPPER] == map_id

    health = client.get("/health").json()
    assert health["handoff"] == {"rho": 1.0, "selector": "rank", "gate": False, "request_budget": True,
                                 "min_handoff_tokens": FLOOR}
    assert health["heal"] is svc.healing and health["max_batch"] == svc.cfg.max_batch
    bad = client.post("/v1/chat/completions", headers={ROUTER_MAPPER: "two words"},
                      json={"model": "tgt", "messages": long, "max_tokens": 2})
    assert bad.status_code == 400 and "x-vsr-kv-mapper-id" in bad.json()["error"]["message"]


def _sampling():
    from rarecache.engine.generate import SamplingConfig

    return SamplingConfig(max_new_tokens=4)


def test_an_engine_says_what_it_cannot_do():
    """The vLLM engine cannot read a final message: the contract's call refuses it in one line (a 400 at the
    front), before any engine is asked."""
    from rarecache.adapters.vllm.server.serving import VllmChatService
    from rarecache.errors import RarecacheError

    svc = object.__new__(VllmChatService)  # no engine starts
    for call in (lambda: svc.prepare_continued("tgt", [], None), lambda: svc.continue_final("tgt", None, None)):
        with pytest.raises(RarecacheError, match="not supported by this server's engine .vllm.: continue_final"):
            call()
