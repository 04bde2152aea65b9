"""The vLLM connector under tensor parallelism: both engines of the tiny pair at TP = 2 on the CPU.

Each rank holds its share of the KV heads (the target's 2 KV heads: one per rank; the source's
single KV head: replicated on both), so the capture joins the ranks' rows into whole ones, the
handoff writes each rank its own heads, and the recompute runs on both ranks over vLLM's shards
in step (vLLM's row-parallel products do the all-reduces). Checked against our own Runner and
against vLLM alone at the same TP, as tests/test_vllm.py checks one rank. The engines start
once for the module (four worker processes; about two minutes here), and a third, the target
with a map that reads the tokens (token inputs and exact layer 0: each rank computes its own
heads' layer-0 rows, joined into whole rows for the map), when its tests run.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

import pytest
import torch

from .test_vllm import (BS, EXTENSION, HAVE_VLLM, _close, _Engine, _paged_rows, _run, assert_captured,  # noqa: F401
                        vpair)

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed (pip install 'rarecache[vllm]')"),
              pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="TP = 2 on a CPU needs a core per rank")]

TP = 2


@contextmanager
def _tp_environment():
    """vLLM's CPU binding for TP ranks while engines start (`engine_environment`), whatever the module
    before set; restored after."""
    from rarecache.adapters.vllm.server.engines import engine_environment

    keys = ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU", "OMP_NUM_THREADS")
    saved = {k: os.environ.pop(k, None) for k in keys}
    engine_environment(tensor_parallel_size=TP)
    try:
        yield
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None)
            if v is not None:
                os.environ[k] = v


@pytest.fixture(scope="module")
def tp_served(vpair, tmp_path_factory):
    """The pair as `rarecache serve --engine vllm --tensor-parallel-size 2` runs it."""
    from rarecache.adapters.vllm.server.serving import VllmChatService, VllmServeConfig

    store = tmp_path_factory.mktemp("tp-store")
    cfg = VllmServeConfig(store=store, rho=1.0, selector="rank", dtype="float32", max_new_tokens=64,
                          kv_cache_bytes=64 << 20, block_size=BS, max_model_len=512, tensor_parallel_size=TP,
                          min_handoff_tokens=0)
    with _tp_environment():
        svc = VllmChatService({"src": vpair.root / "src", "tgt": vpair.root / "tgt"},
                              {("src", "tgt"): vpair.root / "src-tgt.map"}, cfg,
                              engine_kwargs={"worker_extension_cls": EXTENSION})
    yield svc, store
    svc.close()


@pytest.fixture(scope="module")
def tok_map(vpair):
    """A map src -> tgt that reads the tokens: token inputs and exact layer 0 (tests/test_token_maps.py)."""
    from rarecache.models.tokenizer import Tokenizer
    from rarecache.transfer.fitting.calibrate import Calibration, CalibrationConfig
    from rarecache.transfer.fitting.corpus import load_corpus

    tok, corpus = Tokenizer.from_dir(vpair.root / "src"), load_corpus(str(vpair.root / "corpus.txt"))
    cfg = CalibrationConfig(tokens=700, heldout_tokens=0, seq_len=48, k=2, rank=5, token_inputs=True,
                            exact_layer0=True)
    mapper = Calibration(vpair.src, vpair.tgt, tok, corpus, cfg, vpair.root / "tok").run(progress=False)
    mapper.save(vpair.root / "src-tgt-tok.map")
    assert mapper.needs_tokens
    return mapper


@pytest.fixture(scope="module")
def tp_tok_target(vpair, tp_served, tok_map):
    """The target alone at TP = 2 with the token map from the source, on tp_served's store (whose source
    engine files the rows): a vLLM engine of its own, connector settings as VllmChatService gives them."""
    from vllm import LLM
    from vllm.config import KVTransferConfig

    from rarecache.adapters.vllm.server.engines import CONNECTOR

    maps = {"src": str(vpair.root / "src-tgt-tok.map")}
    extra = {"store": str(tp_served[1]), "rho": 1.0, "selector": "rank", "maps": maps}
    ktc = KVTransferConfig(kv_connector="RarecacheConnector", kv_connector_module_path=CONNECTOR, kv_role="kv_both",
                           kv_connector_extra_config=extra, kv_load_failure_policy="fail")  # a failed load: an error
    with _tp_environment():
        llm = LLM(model=str(vpair.root / "tgt"), dtype="float32", enforce_eager=True, skip_tokenizer_init=True,
                  kv_cache_memory_bytes=64 << 20, seed=0, kv_transfer_config=ktc, tensor_parallel_size=TP,
                  block_size=BS, max_model_len=512, worker_extension_cls=EXTENSION)
    yield llm
    llm.llm_engine.engine_core.shutdown()


@pytest.fixture(scope="module")
def tp_source_run(vpair, tp_served):
    svc, _ = tp_served
    return _run(_Engine(svc, "src"), vpair.prompts, [f"s{i}" for i in range(len(vpair.prompts))])


def test_tp2_capture_joins_the_ranks_rows(vpair, tp_served, tp_source_run):
    """The source at TP = 2 (its one KV head on both ranks) files whole rows: what our Runner
    computes for the same tokens, and its greedy answer is our Runner's."""
    assert_captured(vpair, tp_served[1], tp_source_run)


def test_tp2_rho_1_equals_vllm_alone(vpair, tp_served, tp_source_run):
    """ρ = 1 on the target at TP = 2: the recompute on both ranks in step gives vLLM alone's tokens."""
    svc, _ = tp_served
    target = _Engine(svc, "tgt")
    alone = _run(target, vpair.prompts)
    handed = _run(target, vpair.prompts, ["tp-a", "tp-b"], [{"scope": "s0", "rho": 1.0}, {"scope": "s1", "rho": 1.0}])
    for prompt, a, h in zip(vpair.prompts, alone, handed):
        n = (len(prompt) - 1) // BS * BS
        assert h.info["handoff"]["tokens"] == n and h.info["handoff"]["recomputed"] == n and h.cached == n
        assert h.tokens == a.tokens
        assert all(_close(x, y) for x, y in zip(h.logprobs, a.logprobs))


@pytest.mark.parametrize("rho", [0.0, 0.5])
def test_tp2_each_rank_holds_its_heads_of_the_transfer(vpair, tp_served, tp_source_run, tmp_path, rho):
    """ρ = 0 and 0.5 (rank): rank r's paged cache holds KV head r of the rows our own (whole,
    one-process) Runner computes by the same rule from the same stored rows."""
    svc, root = tp_served
    _assert_ranks_hold_the_transfer(vpair, _Engine(svc, "tgt"), root, vpair.map, rho, f"tp-{rho}", tmp_path)


@pytest.mark.parametrize("rho", [0.0, 0.5])
def test_tp2_each_rank_holds_its_heads_of_a_token_map_transfer(vpair, tp_served, tp_source_run, tp_tok_target,
                                                                tok_map, tmp_path, rho):
    """A map that reads the tokens at TP = 2: each rank computes its own head's layer-0 rows, the ranks
    join them for the map's token block, and rank r's paged cache holds KV head r of what our whole,
    one-process Runner hands off (layer 0 exact) at ρ = 0 and 0.5."""
    _assert_ranks_hold_the_transfer(vpair, tp_tok_target, tp_served[1], tok_map, rho, f"tok-{rho}", tmp_path)


def _assert_ranks_hold_the_transfer(vpair, target, root, mapper, rho, salt, tmp_path) -> None:
    """Prompt 0 handed off from the source's stored rows (scope s0) at `rho` (rank): each rank's paged rows
    are its heads of `hand_rows` in one process over our Runner."""
    from rarecache.adapters.vllm.connector.core import hand_rows
    from rarecache.adapters.vllm.rowstore.interface import model_identity
    from rarecache.adapters.vllm.rowstore.store_open import open_store

    prompt = vpair.prompts[0]
    (h,) = _run(target, [prompt], salt, {"scope": "s0", "rho": rho, "selector": "rank", "debug": True})
    info = h.info["handoff"]
    n, k_re = info["tokens"], info["recomputed"]
    assert len(prompt) == 100 and k_re == (0 if rho == 0 else 50 - (len(prompt) - n))  # ρ·P, less vLLM's tail
    paths = target.collective_rpc("rarecache_dump_blocks", args=(info["all_block_ids"], str(tmp_path / "b")))
    assert paths == [f"{tmp_path / 'b'}.rank{r}" for r in range(TP)]
    per_rank = [_paged_rows(p, info["all_block_ids"], n) for p in paths]  # each (L, 1, n, D)
    assert all(k.shape[1] == vpair.tgt.config.num_kv_heads // TP for k, _ in per_rank)
    k, v = torch.cat([k for k, _ in per_rank], dim=1), torch.cat([v for _, v in per_rank], dim=1)
    store = open_store(root)
    k_src, v_src = store.load(store.lookup(model_identity(vpair.root / "src"), "s0", prompt), n, vpair.src.config)
    ref = hand_rows(vpair.tgt, mapper, vpair.src.config, k_src, v_src, prompt[:n], k_re, "rank", rho=rho)
    torch.testing.assert_close(k, ref.k, atol=1e-4, rtol=0)
    torch.testing.assert_close(v, ref.v, atol=1e-4, rtol=0)
