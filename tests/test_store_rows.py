"""The row store's conformance suite (adapters/vllm/rowstore/interface.py), run on both backends: the directory
and a real redis-server (started here on a private unix socket; skipped, saying why, only when
the binary is missing: .ci/run installs it). Write, read, prefix walk, eviction, lifetime, salt
isolation, corrupt and foreign entries refused, records, counters, concurrent writers; then
what only one backend has (leases and the cap in a directory, a server that is down)."""

from __future__ import annotations

import multiprocessing
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from rarecache.adapters.vllm.rowstore.interface import CHUNK, EntryGone, Hit, Miss, RowStore, StoreDown, encode_entry
from rarecache.adapters.vllm.rowstore.store_open import open_store
from rarecache.errors import RarecacheError

from .redis_server import REDIS, SKIP_REASON, RedisServer

ID_A = {"name": "a", "config": "c" * 16, "weights": "w" * 16}
ID_B = {"name": "b", "config": "c" * 16, "weights": "x" * 16}  # same architecture, other weights
CFG = SimpleNamespace(num_layers=2, num_kv_heads=1, head_dim=8)


def _rows(L=2, H=1, n=40, D=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(L, H, n, D, generator=g), torch.randn(L, H, n, D, generator=g)


@pytest.fixture(scope="module")
def redis_server():
    if REDIS is None:
        pytest.skip(SKIP_REASON)
    server = RedisServer(maxmemory="256mb").start()
    yield server
    server.close()


@pytest.fixture(params=["dir", "redis"])
def make(request, tmp_path):
    """make(ttl=None, cap_bytes=None) -> a fresh, empty store of the backend."""
    made = []

    def _make(ttl=None, cap_bytes=None):
        if request.param == "dir":
            store = open_store(tmp_path / "rows", cap_bytes=cap_bytes, ttl=ttl)
        else:
            server = request.getfixturevalue("redis_server")
            store = open_store(server.url, ttl=ttl)
            if not made:
                store.client.flushdb()
        made.append(store)
        return store

    _make.backend = request.param
    yield _make
    for store in made:
        store.close()


def _raw_put(store: RowStore, entry: str, data: bytes) -> None:
    """Overwrite an entry's bytes behind the store's back (another process, a bad disk)."""
    bucket, name = entry.split("/")
    if hasattr(store, "root"):
        (store.root / "rows" / bucket / name).write_bytes(data)
    else:
        store.client.set(f"rc2:e:{bucket}:{name}", data)


def test_round_trip_and_prefix_walk(make):
    store = make()
    tokens = list(range(100, 140))  # 40 tokens: two whole chunks and a bit
    k, v = _rows()
    assert store.put(ID_A, "s", tokens, k, v) is not None
    hit = store.lookup(ID_A, "s", tokens + [7, 8, 9])  # a longer prompt that starts with them
    assert (hit.length, hit.stored) == (40, 40)
    k2, v2 = store.load(hit, 33, CFG)
    assert torch.equal(k2, k[:, :, :33]) and torch.equal(v2, v[:, :, :33])
    assert store.lookup(ID_A, "s", tokens[:20] + [1] * 30).length == 20  # diverging: the common prefix
    assert store.find(ID_A, "s", tokens[: CHUNK - 1]).reason == "no_entry"  # less than a chunk
    assert store.find(ID_A, "s", [1] + tokens[1:]).reason == "no_entry"
    assert store.put(ID_A, "s", tokens[:32], k[:, :, :32], v[:, :, :32]) is None  # already covered
    # a longer sequence through the same prefix is found for prompts that follow it
    longer = tokens + list(range(500, 530))
    store.put(ID_A, "s", longer, *_rows(n=70, seed=1))
    assert store.lookup(ID_A, "s", longer).length == 70
    assert store.lookup(ID_A, "s", tokens + [1] * 20).length == 40  # both hold these 40; either serves
    bf = store.put(ID_A, "bf", tokens, k.bfloat16(), v.bfloat16())
    assert bf is not None and store.load(store.lookup(ID_A, "bf", tokens), 40, CFG)[0].dtype == torch.bfloat16


def test_salt_and_model_isolation(make):
    store = make()
    tokens = list(range(50))
    store.put(ID_A, "s", tokens, *_rows(n=50))
    assert store.lookup(ID_A, "s", tokens).length == 50
    assert store.find(ID_B, "s", tokens).reason == "no_entry"  # same architecture, other weights
    assert store.find(ID_A, "t", tokens).reason == "no_entry"  # another tenant's salt
    assert store.find(ID_A, None, tokens).reason == "no_entry"  # no salt is its own scope
    assert make().lookup(ID_A, "s", tokens).length == 50  # another client of the same store


def test_corrupt_and_foreign_entries_are_refused(make):
    store = make()
    tokens = list(range(32))
    entry = store.put(ID_A, "s", tokens, *_rows(n=32))
    hit = store.lookup(ID_A, "s", tokens)
    with pytest.raises(EntryGone, match="do not fit") as e:
        store.load(hit, 32, SimpleNamespace(num_layers=3, num_kv_heads=1, head_dim=8))
    assert e.value.reason == "identity_mismatch"
    _raw_put(store, entry, b"not safetensors")
    assert store.find(ID_A, "s", tokens).reason == "corrupt_entry"
    with pytest.raises(EntryGone, match="not a row entry") as e:
        store.load(hit, 32, CFG)
    assert e.value.reason == "corrupt_entry"
    # another model's rows filed under this model's key: refused on the identity in its header
    _raw_put(store, entry, encode_entry(ID_B, tokens, *_rows(n=32), ttl=None))
    assert store.find(ID_A, "s", tokens).reason == "identity_mismatch"
    # a header that promises more rows than the tensors hold
    k, v = _rows(n=32)
    good = encode_entry(ID_A, tokens + list(range(8)), k, v, ttl=None)
    _raw_put(store, entry, good)
    with pytest.raises(EntryGone, match="has shape"):
        store.load(store.lookup(ID_A, "s", tokens), 40, CFG)
    k[0, 0, 3, 1] = float("nan")  # a NaN written by someone is refused on read
    _raw_put(store, entry, encode_entry(ID_A, tokens, k, v, ttl=None))
    with pytest.raises(EntryGone, match="not finite"):
        store.load(store.lookup(ID_A, "s", tokens), 32, CFG)
    with pytest.raises(EntryGone, match="not an entry key"):
        store.load(Hit("../../etc/passwd", 1, 1), 1, CFG)


def test_lifetime(make):
    store = make(ttl=1)
    tokens = list(range(48))
    store.put(ID_A, "s", tokens, *_rows(n=48))
    assert store.lookup(ID_A, "s", tokens).length == 48
    time.sleep(2.2)
    miss = store.find(ID_A, "s", tokens)
    assert isinstance(miss, Miss) and miss.reason in ("evicted", "no_entry")
    with pytest.raises(RarecacheError, match="lifetime"):
        make(ttl=0)


def test_eviction_keeps_the_store_bounded_and_the_newest_rows(make):
    entry_bytes = len(encode_entry(ID_A, list(range(256)), *_rows(n=256), ttl=None))
    if make.backend == "dir":
        store = make(cap_bytes=int(3.5 * entry_bytes))
    else:  # the server's maxmemory bounds it: room for some entries above what it needs to run
        store = make()
        store.put(ID_B, "s", list(range(256)), *_rows(n=256))  # the server's buffers grow to an entry's size
        store.client.config_set("maxmemory", store.client.info("memory")["used_memory"] + 12 * entry_bytes)
    try:
        seqs = [list(range(1000 * i, 1000 * i + 256)) for i in range(12 if make.backend == "dir" else 40)]
        for i, seq in enumerate(seqs):
            store.put(ID_A, "s", seq, *_rows(n=256, seed=i))
            stats = store.stats()
            if make.backend == "dir":
                assert stats["bytes"] <= store.cap_bytes  # never above the cap
        assert stats["evictions"] > 0 and stats["entries"] < len(seqs)
        found = [store.find(ID_A, "s", seq) for seq in seqs]
        assert all(f.length == 256 if isinstance(f, Hit) else f.reason in ("evicted", "no_entry") for f in found)
        assert any(isinstance(f, Hit) for f in found) and isinstance(found[0], Miss)
        if make.backend == "redis":  # the server's LRU is approximate (1 s clock, sampled): its bound only
            assert stats["bytes"] <= int(store.client.config_get("maxmemory")["maxmemory"]) + entry_bytes
        else:
            assert isinstance(found[-1], Hit)  # the newest is kept
            assert found[0].reason == "evicted"  # its prefix keys remember it was there
            # least recently used goes first: read the oldest survivor, write two more, it stays
            alive = [s for s in seqs if store.lookup(ID_A, "s", s) is not None]
            store.load(store.lookup(ID_A, "s", alive[0]), 256, CFG)
            for i in range(2):
                store.put(ID_A, "s", list(range(50_000 + 1000 * i, 50_256 + 1000 * i)), *_rows(n=256))
            assert store.lookup(ID_A, "s", alive[0]) is not None
            assert store.lookup(ID_A, "s", alive[1]) is None
    finally:
        if make.backend == "redis":
            store.client.config_set("maxmemory", "256mb")


def test_records_and_counters(make):
    store = make()
    store.put_record("a" * 32, {"status": "handed_off", "tokens": 32})
    assert store.take_record("a" * 32) == {"status": "handed_off", "tokens": 32}
    assert store.take_record("a" * 32) is None  # taken once
    with pytest.raises(RarecacheError, match="32 lowercase hex"):
        store.put_record("../x", {})
    tokens = list(range(64))
    store.put(ID_A, "s", tokens, *_rows(n=64))
    before = store.stats()
    store.lookup(ID_A, "s", tokens)
    store.lookup(ID_A, "other", tokens)
    after = store.stats()
    assert after["hits"] == before["hits"] + 1 and after["misses"] == before["misses"] + 1
    assert after["misses_by_reason"]["no_entry"] == before["misses_by_reason"]["no_entry"] + 1
    assert after["entries"] == 1 and after["bytes"] > 64 * 2 * 2 * 8 * 4 and after["evictions"] == before["evictions"]
    assert store.nbytes() == after["bytes"]


def _write_many(spec, ttl, worker, n, out):
    store = open_store(spec, ttl=ttl)
    for i in range(n):
        seq = list(range(100_000 + 10_000 * worker + 100 * i, 100_048 + 10_000 * worker + 100 * i))
        store.put(ID_A, "s", seq, *_rows(n=48, seed=worker * 100 + i))
        store.put(ID_A, "s", list(range(48)), *_rows(n=48, seed=7))  # everyone writes this one too
    if out is not None:
        out.put(worker)


def test_concurrent_writers(make):
    store = make()
    spec = store.url
    threads = [threading.Thread(target=_write_many, args=(spec, None, w, 6, None)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=_write_many, args=(spec, None, w, 4, q)) for w in (10, 11)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0] and sorted(q.get(timeout=5) for _ in procs) == [10, 11]
    for w, n in [(w, 6) for w in range(4)] + [(10, 4), (11, 4)]:
        for i in range(n):
            seq = list(range(100_000 + 10_000 * w + 100 * i, 100_048 + 10_000 * w + 100 * i))
            hit = store.lookup(ID_A, "s", seq)
            assert hit is not None and hit.length == 48
            assert torch.equal(store.load(hit, 48, CFG)[0], _rows(n=48, seed=w * 100 + i)[0])
    assert torch.equal(store.load(store.lookup(ID_A, "s", list(range(48))), 48, CFG)[0], _rows(n=48, seed=7)[0])
    assert store.stats()["entries"] == 4 * 6 + 2 * 4 + 1


# -- one backend's own ---------------------------------------------------------------------


def test_directory_never_evicts_a_leased_entry(tmp_path):
    entry_bytes = len(encode_entry(ID_A, list(range(256)), *_rows(n=256), ttl=None))
    store = open_store(tmp_path, cap_bytes=int(2.5 * entry_bytes))
    first = list(range(256))
    store.put(ID_A, "s", first, *_rows(n=256))
    token = store.lease(store.lookup(ID_A, "s", first))
    for i in range(1, 5):
        store.put(ID_A, "s", list(range(1000 * i, 1000 * i + 256)), *_rows(n=256, seed=i))
        assert store.stats()["bytes"] <= store.cap_bytes
    assert store.lookup(ID_A, "s", first) is not None  # oldest, but being read
    store.release(token)
    store.put(ID_A, "s", list(range(9000, 9256)), *_rows(n=256))
    store.put(ID_A, "s", list(range(9500, 9756)), *_rows(n=256))
    assert store.find(ID_A, "s", first).reason == "evicted"  # released: evicted like any other
    # every entry leased: a new one is not written (a future miss), the cap holds
    tokens = [store.lease(store.lookup(ID_A, "s", s)) for s in (list(range(9000, 9256)), list(range(9500, 9756)))]
    assert store.put(ID_A, "s", list(range(7000, 7256)), *_rows(n=256)) is None
    assert store.stats()["bytes"] <= store.cap_bytes
    for t in tokens:
        store.release(t)
    assert store.put(ID_A, "s", list(range(7000, 7256)), *_rows(n=256)) is not None
    assert store.put(ID_A, "s", list(range(4000, 4000 + 900)), *_rows(n=900)) is None  # bigger than the cap
    with pytest.raises(RarecacheError, match="capacity"):
        open_store(tmp_path, cap_bytes=0)


def test_redis_down_is_a_miss_with_its_reason():
    if REDIS is None:
        pytest.skip(SKIP_REASON)
    server = RedisServer(maxmemory="64mb").start()
    try:
        store = open_store(server.url)
        tokens = list(range(64))
        store.put(ID_A, "s", tokens, *_rows(n=64))
        hit = store.lookup(ID_A, "s", tokens)
        server.stop()
        miss = store.find(ID_A, "s", tokens)
        assert miss.reason == "store_down" and "down" in miss.detail
        assert store.counters()["misses_by_reason"]["store_down"] == 1 and store.nbytes() == 0
        with pytest.raises(StoreDown):  # a scrape of /metrics shows rarecache_store_up 0
            store.stats()
        with pytest.raises(StoreDown):
            store.load(hit, 64, CFG)
        with pytest.raises(StoreDown):
            store.put(ID_A, "s", list(range(100, 164)), *_rows(n=64))
    finally:
        server.close()


def test_store_setting_picks_the_backend(tmp_path):
    from rarecache.adapters.vllm.rowstore.store_dir import DirStore

    assert isinstance(open_store(tmp_path / "d"), DirStore)
    with pytest.raises(RarecacheError, match="maxmemory"):
        open_store("redis://127.0.0.1:1/0", cap_bytes=1 << 20)
    with pytest.raises(RarecacheError, match="not a Redis address"):
        open_store("redis://127.0.0.1:notaport/0")
    nowhere = open_store("redis://127.0.0.1:1/0")  # nothing listens: a miss that says so, never an error
    assert nowhere.find(ID_A, "s", list(range(32))).reason == "store_down"


class _SoakStandIn:
    """The vLLM service as `bench store-soak` drives it, without engines: each answer hands off from
    the other model's rows when the store has them (read under a lease) and files its own, on a real
    capped store."""

    def __init__(self, store):
        self.store, self.ids = store, {"small": ID_A, "large": ID_B}

    def store_stats(self):
        return self.store.stats()

    def prepare(self, model, messages, sampling, salt=None):
        return [sum(map(ord, w)) % 997 for m in messages for w in m["content"].split()]

    def answer(self, model, ids, sampling, salt=None):
        peer = "large" if model == "small" else "small"
        found = self.store.find(self.ids[peer], salt, ids)
        status = "fallback_reprefill"
        if isinstance(found, Hit):
            token = self.store.lease(found)
            try:
                self.store.load(found, found.length, CFG)
                status = "applied"
            except EntryGone:
                pass
            finally:
                self.store.release(token)
        answer = [(t * 31) % 997 for t in ids[-sampling.max_new_tokens:]]
        seq = ids + answer
        self.store.put(self.ids[model], salt, seq, *_rows(n=len(seq)))
        return SimpleNamespace(text=" ".join(f"w{t}" for t in answer), handoff={"status": status})


def test_store_soak_driver_keeps_the_store_under_its_cap(tmp_path):
    """`bench store-soak`'s driver, a few seconds on a stand-in service over a capped directory store:
    bytes never above the cap, evictions, no failure, handoffs applied, every field written."""
    from rarecache.bench.store_soak import StoreSoakConfig, run_store_soak

    cap = 120_000  # a few entries of up to ~300 rows of 128 bytes
    svc = _SoakStandIn(open_store(tmp_path, cap_bytes=cap))
    lines = []
    cfg = StoreSoakConfig(duration_s=3.0, conversations=3, turn_words=24, max_new_tokens=8, max_prompt_tokens=300,
                          max_rss_growth=1.0)
    result = run_store_soak(svc, ("small", "large"), cfg, emit=lines.append)
    assert result["store_cap_bytes"] == cap and 0 < result["store_bytes_max"] <= cap
    assert result["samples_over_cap"] == 0 and result["failed"] == 0 and result["evictions"] > 0
    assert result["outcomes"].get("applied", 0) > 0 and result["conversations_restarted"] > 0
    assert isinstance(result["rss_growth"], float) and result["ok"] and "ok" in lines[-1]
    with pytest.raises(RarecacheError, match="bounded store"):
        run_store_soak(_SoakStandIn(open_store(tmp_path / "unbounded")), ("small", "large"), cfg)
