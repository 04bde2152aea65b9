"""The row store on a Redis or Valkey server (the interface in interface.py): engines on different hosts.

`redis://[:password@]HOST:PORT/DB` or `unix:///path/redis.sock?db=N`, through the `redis`
client (the vllm extra). The keys are interface.py's schema under a versioned namespace:

    rc2:e:<bucket>:<entry>    an entry's bytes (entry.py: safetensors + JSON header)
    rc2:p:<bucket>            a hash: chain -> the entry holding a sequence's first 16·i tokens
    rc2:m:<model key>         a model's record (refiled with each of its entries)
    rc2:r:<name>              one handoff's record (RECORD_TTL, taken with GETDEL)

An entry is written with one SET, then its prefix fields (pipelined, not MULTI: the server evicts
before each command, never inside a transaction), with the store's lifetime (`EX` on the entry,
EXPIRE on the bucket's prefix hash, renewed by each write). The prefix index of a bucket is one
hash, not a key per chunk: an LRU server evicts keys, and a surviving entry whose first chunk's
key was evicted could never be found again; the hash is used by every lookup of its tenant, so
it is the last thing the LRU drops while the tenant is active. Memory is the server's to bound:
run it with `maxmemory` and an LRU policy (`allkeys-lru`); an entry it evicted is a miss with the
reason `evicted` (the prefix hash still names it). A lookup reads an entry's header with
GETRANGE, a load reads it in one GET: nothing is half-read. A server that is down or slow
(timeouts of a few seconds) is `StoreDown`: the lookup misses with the reason `store_down`, never an error to the
request. Counters for `stats()` come from the server (INFO) and SCAN.
"""

from __future__ import annotations

from typing import Any

from ....errors import RarecacheError
from .interface import RECORD_TTL, RowStore, StoreDown, describe_store, header_length

NS = "rc2"
HEAD = 64 << 10  # bytes of an entry read for its header (more when it is longer)
TIMEOUT = 5.0  # seconds a command may take before the store counts as down


class RedisStore(RowStore):
    def __init__(self, url: str, ttl: float | None = None):
        super().__init__(ttl)
        try:
            import redis
        except ImportError:
            raise RarecacheError("a redis:// store needs the redis client: pip install 'rarecache[vllm]' "
                                 "(or pip install redis)") from None
        self._errors = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)
        self._redis_error = redis.exceptions.RedisError
        self.url = url
        try:
            self.client = redis.Redis.from_url(url, socket_timeout=TIMEOUT, socket_connect_timeout=TIMEOUT)
        except ValueError as e:
            raise RarecacheError(f"--store {describe_store(url)} is not a Redis address: {e}") from None

    def _call(self, fn, *args, **kw):
        """One command; a server that cannot be reached is StoreDown."""
        try:
            return fn(*args, **kw)
        except self._errors as e:
            raise StoreDown(f"the Redis store {describe_store(self.url)} is down: {e}") from None
        except self._redis_error as e:
            raise StoreDown(f"the Redis store {describe_store(self.url)} refused: {e}") from None

    def _ex(self) -> dict[str, Any]:
        return {} if self.ttl is None else {"ex": max(1, int(round(self.ttl)))}

    # -- rows ----------------------------------------------------------------------------

    def _prefixes(self, bucket: str, hashes: list[str]) -> list[str | None]:
        raw = self._call(self.client.hmget, f"{NS}:p:{bucket}", hashes)
        out: list[str | None] = []
        for value in raw:
            if value is None:
                break
            out.append(value.decode("ascii", "replace"))
        return out + [None] * (len(hashes) - len(out))

    def _head(self, bucket: str, name: str) -> bytes | None:
        key = f"{NS}:e:{bucket}:{name}"
        head = self._call(self.client.getrange, key, 0, HEAD - 1)
        if not head:
            return None
        size = header_length(head)
        if size is not None and size > len(head):
            head = self._call(self.client.getrange, key, 0, size - 1)
        return head

    def _blob(self, bucket: str, name: str) -> bytes | None:
        return self._call(self.client.get, f"{NS}:e:{bucket}:{name}")

    def _write(self, bucket: str, name: str, blob: bytes, hashes: list[str], model: str | None, key: str) -> bool:
        try:  # the entry first, then its prefix keys: a reader never finds a prefix before its entry
            self._call(self.client.set, f"{NS}:e:{bucket}:{name}", blob, **self._ex())
        except StoreDown as e:
            if "maxmemory" in str(e):  # a noeviction policy and no room: a future miss
                return False
            raise
        # pipelined, not MULTI: the server evicts before each command, never inside a transaction
        pipe = self.client.pipeline(transaction=False)
        pipe.hset(f"{NS}:p:{bucket}", mapping={h: name for h in hashes})
        if self.ttl is not None:
            pipe.expire(f"{NS}:p:{bucket}", self._ex()["ex"])
        if model is not None:
            pipe.set(f"{NS}:m:{key}", model)
        self._call(pipe.execute)
        return True

    def _expire(self, bucket: str, name: str) -> None:
        return None  # the server expires entries itself (EX)

    # -- models and records --------------------------------------------------------------

    def _model_put(self, key: str, text: str) -> None:
        self._call(self.client.set, f"{NS}:m:{key}", text)

    def _model_get(self, key: str) -> str | None:
        raw = self._call(self.client.get, f"{NS}:m:{key}")
        return None if raw is None else raw.decode("utf-8", "replace")

    def _record_put(self, name: str, text: str) -> None:
        self._call(self.client.set, f"{NS}:r:{name}", text, ex=RECORD_TTL)

    def _record_take(self, name: str) -> bytes | None:
        return self._call(self.client.getdel, f"{NS}:r:{name}")

    # -- stats ---------------------------------------------------------------------------

    def _backend_stats(self) -> dict[str, Any]:
        memory = self._call(self.client.info, "memory")
        info = self._call(self.client.info, "stats")
        entries = self._call(lambda: sum(1 for _ in self.client.scan_iter(match=f"{NS}:e:*", count=1000)))
        cap = int(memory.get("maxmemory", 0)) or None
        return {"bytes": int(memory.get("used_memory", 0)), "entries": entries,
                "evictions": int(info.get("evicted_keys", 0)), "cap_bytes": cap, "backend": "redis",
                "policy": memory.get("maxmemory_policy")}

    def close(self) -> None:
        try:
            self.client.close()
        except self._redis_error:
            pass
