"""Opening a row store by its name: the one place that knows every backend (`store_dir.py`, `store_redis.py`),
apart from `interface.py`, which the backends build on."""

from __future__ import annotations

from pathlib import Path

from ....errors import RarecacheError
from .interface import RowStore, is_url


def open_store(spec: str | Path, cap_bytes: int | None = None, ttl: float | None = None) -> RowStore:
    """The store `spec` names: `redis://HOST:PORT/DB` or `unix:///path.sock` (a Redis/Valkey
    server; its memory is bounded by its own maxmemory), else a directory (bounded by cap_bytes)."""
    if is_url(spec):
        if cap_bytes is not None:
            raise RarecacheError("a Redis store is bounded by the server's own maxmemory (with an allkeys-lru "
                                 "policy), not by --store-gib")
        from .store_redis import RedisStore  # (the Redis client only when one is named)

        return RedisStore(str(spec), ttl=ttl)
    from .store_dir import DirStore

    return DirStore(Path(spec).expanduser(), cap_bytes=cap_bytes, ttl=ttl)
