"""Real-model tier inside vLLM: the bundled Qwen2.5-Coder 0.5B -> 1.5B pair, both in vLLM engines
loading RarecacheConnector, as `rarecache serve --engine vllm` runs them.

The fast tier (tests/test_vllm.py) proves the connector on tiny random models; this checks what
only the real pair has: its tokenizer and chat template, head_dim 64 against 128, 2 KV heads
against 2 of another width, 24 source layers mapped onto 28. The map is a small one fitted here
(512 positions), because no general map exists on a fresh machine and ρ = 1, the exactness check,
does not depend on the map's values; ρ = 0.3 then checks the budget on real prompts. Two float32
engines start in about two minutes on 2 cores. Run with `pytest -m "real and vllm"`.
"""

from __future__ import annotations

import importlib.util
from dataclasses import replace

import pytest
import torch

pytestmark = [pytest.mark.real, pytest.mark.vllm,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs the vllm extra")]

SOURCE, TARGET = "qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct"
NEW = 12
PASSAGE = ("The Amazon River in South America is the largest river by discharge volume of water in the world. "
           "It rises in the Andes of Peru, crosses Brazil and reaches the Atlantic near Belém. Its basin covers "
           "about seven million square kilometres, and the rainforest around it holds a tenth of all known "
           "species. ") * 3


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from rarecache.adapters.vllm.server.engines import engine_environment
    from rarecache.adapters.vllm.server.serving import VllmChatService, VllmServeConfig
    from rarecache.engine.runner import Runner
    from rarecache.models.store import pull
    from rarecache.models.tokenizer import Tokenizer
    from rarecache.transfer.fitting.calibrate import Calibration, CalibrationConfig
    from rarecache.transfer.fitting.corpus import load_corpus

    root = tmp_path_factory.mktemp("real-vllm")
    dirs = {"src": pull(SOURCE), "tgt": pull(TARGET)}
    src, tgt = (Runner.load(dirs[n], dtype=torch.float32) for n in ("src", "tgt"))
    cfg = CalibrationConfig(tokens=512, heldout_tokens=0, seq_len=256, k=2, rank=8)
    mapper = Calibration(src, tgt, Tokenizer.from_dir(dirs["src"]), load_corpus("wiki"), cfg,
                         root / "fit").run(progress=False)
    mapper.save(root / "src-tgt.map")
    del src, tgt
    engine_environment()
    svc = VllmChatService(dirs, {("src", "tgt"): root / "src-tgt.map"},
                          VllmServeConfig(store=root / "store", rho=1.0, selector="rank", dtype="float32",
                                          max_new_tokens=NEW, kv_cache_bytes=256 << 20, max_model_len=1024,
                                          block_size=32, min_handoff_tokens=0))
    svc.dirs = dirs  # for the tests' tokenizer
    yield svc
    svc.close()


def _chat(client, model, messages, salt):
    r = client.post("/v1/chat/completions", json={"model": model, "messages": messages, "max_tokens": NEW,
                                                   "cache_salt": salt})
    assert r.status_code == 200, r.text
    body = r.json()
    return body["choices"][0]["message"]["content"], body


@pytest.fixture(scope="module")
def client(served):
    from fastapi.testclient import TestClient

    from rarecache.serve.app import create_app

    return TestClient(create_app(served, default_max_tokens=NEW))


def test_switch_at_rho_1_is_the_target_alone_then_the_budget(served, client):
    """0.5B answers turn 1, the 1.5B turn 2 through the connector: at ρ = 1 the same greedy answer as
    the 1.5B reading the whole conversation itself; at ρ = 0.3 the budget rule on the real prompt."""
    from rarecache.models.tokenizer import Tokenizer
    from rarecache.transfer.handoff import budget

    tok = Tokenizer.from_dir(served.dirs["tgt"])
    msgs = [{"role": "user", "content": PASSAGE + "\nWhere does the Amazon rise?"}]
    text1, body = _chat(client, "src", msgs, "real")
    assert body["rarecache"]["handed_off_from"] is None and text1
    msgs += [{"role": "assistant", "content": text1}, {"role": "user", "content": "Which ocean does it reach?"}]
    text2, body = _chat(client, "tgt", msgs, "real")
    alone, ref = _chat(client, "tgt", msgs, "real-alone")  # another tenant: nothing to hand off
    info = body["rarecache"]
    assert info["handed_off_from"] == "src" and info["handed_off_tokens"] >= 192  # turn 1's 219 tokens, whole blocks
    assert info["recomputed_tokens"] == info["handed_off_tokens"] and info["rho"] == 1.0
    assert ref["rarecache"]["handed_off_from"] is None
    assert text2 == alone and body["usage"] == ref["usage"]

    P = body["usage"]["prompt_tokens"]
    saved = served.cfg
    served.cfg = replace(saved, rho=0.3)
    try:
        _, low = _chat(client, "tgt", msgs, "real")  # the 1.5B filed nothing handed off: handed off again
    finally:
        served.cfg = saved
    info = low["rarecache"]
    n = info["handed_off_tokens"]
    assert info["handed_off_from"] == "src" and info["rho"] == 0.3
    assert info["recomputed_tokens"] == max(0, budget(0.3, P) - (P - n)) > 0 and info["prefilled_tokens"] == P - n
    assert P == len(tok.encode_chat(msgs))  # our template and tokenizer are what vLLM counted
