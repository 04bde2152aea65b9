"""The vLLM connector under tensor parallelism: both engines of the tiny pair at TP = 2 on the CPU.

Each rank holds its share of the KV heads (the target's 2 KV heads: one per rank; the source's
single KV head: replicated on both), so the capture joins the ranks' rows into whole ones, the
handoff writes each rank its own heads, and the recompute runs on both ranks over vLLM's shards
in step (vLLM's row-parallel products do the all-reduces). Checked against our own Runner and
against vLLM alone at the same TP, as tests/test_vllm.py checks one rank. The engines start
once for the module (four worker processes; about two minutes here).
"""

from __future__ import annotations

import os

import pytest
import torch

from .test_vllm import (BS, EXTENSION, HAVE_VLLM, _close, _Engine, _paged_rows, _run, assert_captured,  # noqa: F401
                        vpair)

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed (pip install 'rarecache[vllm]')"),
              pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="TP = 2 on a CPU needs a core per rank")]

TP = 2


@pytest.fixture(scope="module")
def tp_served(vpair, tmp_path_factory):
    """The pair as `rarecache serve --engine vllm --tensor-parallel-size 2` runs it."""
    from rarecache.adapters.vllm.engines import engine_environment
    from rarecache.adapters.vllm.serving import VllmChatService, VllmServeConfig

    keys = ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU", "OMP_NUM_THREADS")
    saved = {k: os.environ.pop(k, None) for k in keys}  # the ranks' own binding, whatever the module before set
    engine_environment(tensor_parallel_size=TP)
    store = tmp_path_factory.mktemp("tp-store")
    cfg = VllmServeConfig(store=store, rho=1.0, selector="rank", dtype="float32", max_new_tokens=64,
                          kv_cache_bytes=64 << 20, block_size=BS, max_model_len=512, tensor_parallel_size=TP)
    try:
        svc = VllmChatService({"src": vpair.root / "src", "tgt": vpair.root / "tgt"},
                              {("src", "tgt"): vpair.root / "src-tgt.map"}, cfg,
                              engine_kwargs={"worker_extension_cls": EXTENSION})
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None)
            if v is not None:
                os.environ[k] = v
    yield svc, store
    svc.close()


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
    from rarecache.adapters.vllm.core import hand_rows
    from rarecache.adapters.vllm.store import model_identity
    from rarecache.adapters.vllm.store_open import open_store

    svc, root = tp_served
    target = _Engine(svc, "tgt")
    prompt = vpair.prompts[0]
    (h,) = _run(target, [prompt], f"tp-{rho}", {"scope": "s0", "rho": rho, "selector": "rank", "debug": True})
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
    ref = hand_rows(vpair.tgt, vpair.map, vpair.src.config, k_src, v_src, prompt[:n], k_re, "rank")
    torch.testing.assert_close(k, ref.k, atol=1e-4, rtol=0)
    torch.testing.assert_close(v, ref.v, atol=1e-4, rtol=0)
