"""The row store in a directory (the interface in interface.py): the embedded default, one host.

Layout, under the root (every file 0600):

    models/<model key>.json            identity + ModelConfig
    rows/<bucket>/<entry>              one sequence (entry.py's format)
    rows/<bucket>/prefix/<chain>       the entry holding the sequence's first 16·i tokens
    leases/<bucket>-<entry>.<token>    a handoff is reading the entry (the file holds its end time)
    records/<name>.json                what one handoff did (`put_record`)
    evictions                          how many entries eviction has removed, all processes together

Entries are written to a temporary name and renamed, then their prefix files: a reader sees
whole entries or none. With `cap_bytes`, a writer first makes room under a lock (flock on
`.lock`, so the engines' processes take turns): expired entries go first, then the least
recently used (a read touches an entry's mtime), never a leased one; an entry that cannot fit
is not written (a future miss, never an error). Prefix files of an evicted entry stay a while
(`DANGLING`) so a lookup can say its rows were `evicted` rather than never there, then go.
"""

from __future__ import annotations

import fcntl
import os
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from ....errors import RarecacheError
from .interface import LEASE_SECONDS, MAX_RECORD, Hit, RowStore, decode_meta, header_length

DANGLING = 600.0  # seconds the prefix files of an evicted entry are kept to report `evicted`
HEAD = 64 << 10  # bytes read for an entry's header (more when it is longer)


class DirStore(RowStore):
    def __init__(self, root: str | Path, cap_bytes: int | None = None, ttl: float | None = None):
        super().__init__(ttl)
        if cap_bytes is not None and cap_bytes <= 0:
            raise RarecacheError(f"the store's capacity must be > 0 bytes, not {cap_bytes}")
        self.root = Path(root)
        self.url = str(self.root)
        self.cap_bytes = cap_bytes
        try:
            for sub in ("models", "rows", "records", "leases"):
                (self.root / sub).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise RarecacheError(f"cannot use {self.root} as a row store: {e}") from None

    def _entry(self, bucket: str, name: str) -> Path:
        return self.root / "rows" / bucket / name

    # -- rows ----------------------------------------------------------------------------

    def _prefixes(self, bucket: str, hashes: list[str]) -> list[str | None]:
        out: list[str | None] = []
        folder = self.root / "rows" / bucket / "prefix"
        for h in hashes:
            try:
                out.append((folder / h).read_text().strip())
            except OSError:
                break
        return out + [None] * (len(hashes) - len(out))

    def _head(self, bucket: str, name: str) -> bytes | None:
        path = self._entry(bucket, name)
        try:
            with open(path, "rb") as f:
                head = f.read(HEAD)
                size = header_length(head)
                if size is not None and size > len(head):
                    head += f.read(size - len(head))
            os.utime(path)  # a use: least recently used goes first
        except OSError:
            return None
        return head

    def _blob(self, bucket: str, name: str) -> bytes | None:
        path = self._entry(bucket, name)
        try:
            data = path.read_bytes()
            os.utime(path)
        except OSError:
            return None
        return data

    def _write(self, bucket: str, name: str, blob: bytes, hashes: list[str], model: str | None, key: str) -> bool:
        folder = self.root / "rows" / bucket
        (folder / "prefix").mkdir(parents=True, exist_ok=True)
        if model is not None and not (self.root / "models" / f"{key}.json").is_file():
            _write_bytes(self.root / "models" / f"{key}.json", model.encode())
        with self._locked():
            if self.cap_bytes is not None and not self._make_room(len(blob), keep=(bucket, name)):
                return False
            _write_bytes(folder / name, blob)
        for h in hashes:  # after the entry: a prefix file never names an entry not yet written
            _write_bytes(folder / "prefix" / h, name.encode())
        return True

    def _expire(self, bucket: str, name: str) -> None:
        with self._locked():
            if not self._leased(bucket, name):
                self._remove(self._entry(bucket, name))

    # -- capacity ------------------------------------------------------------------------

    @contextmanager
    def _locked(self) -> Iterator[None]:
        fd = os.open(self.root / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock

    def _entries(self) -> list[tuple[float, int, str, str]]:
        """(last use, bytes, bucket, name) of every entry."""
        out = []
        for bucket in os.scandir(self.root / "rows"):
            if not bucket.is_dir():
                continue
            for e in os.scandir(bucket.path):
                if e.is_file() and not e.name.startswith("."):
                    try:
                        st = e.stat()
                    except OSError:
                        continue
                    out.append((st.st_mtime, st.st_size, bucket.name, e.name))
        return out

    def _make_room(self, need: int, keep: tuple[str, str]) -> bool:
        """Evict (under the lock) until `need` more bytes fit under the cap; False if they cannot."""
        if need > self.cap_bytes:
            return False
        entries = self._entries()
        total = sum(size for _, size, b, n in entries if (b, n) != keep)
        now = time.time()
        evicted = 0
        for _, size, bucket, name in sorted(entries, key=lambda e: (not self._expired(e, now), e[0])):
            if total + need <= self.cap_bytes and not self._expired((0, size, bucket, name), now):
                break
            if (bucket, name) == keep or self._leased(bucket, name):
                continue
            if self._remove(self._entry(bucket, name)):
                total -= size
                evicted += 1
        if evicted:
            self._count_evictions(evicted)
            self._sweep(now)
        return total + need <= self.cap_bytes

    def _expired(self, e: tuple[float, int, str, str], now: float) -> bool:
        if self.ttl is None:
            return False
        head = None
        try:
            with open(self._entry(e[2], e[3]), "rb") as f:
                head = f.read(HEAD)
        except OSError:
            return False
        meta = decode_meta(head)
        return meta is not None and meta.get("expires") is not None and meta["expires"] <= now

    def _remove(self, path: Path) -> bool:
        try:
            path.unlink()
            return True
        except FileNotFoundError:
            return False

    def _count_evictions(self, n: int) -> None:
        path = self.root / "evictions"
        try:
            before = int(path.read_text() or 0)
        except (OSError, ValueError):
            before = 0
        _write_bytes(path, str(before + n).encode())

    def _sweep(self, now: float) -> None:
        """Remove prefix files older than DANGLING that name no entry (an evicted one's)."""
        for bucket in os.scandir(self.root / "rows"):
            prefix = Path(bucket.path) / "prefix"
            if not prefix.is_dir():
                continue
            for p in os.scandir(prefix):
                try:
                    named = Path(bucket.path) / Path(p.path).read_text().strip()
                    if now - p.stat().st_mtime > DANGLING and not named.is_file():
                        os.unlink(p.path)
                except OSError:
                    pass

    # -- leases --------------------------------------------------------------------------

    def lease(self, hit: Hit, seconds: float = LEASE_SECONDS) -> str | None:
        bucket, name = self._split(hit.entry)
        token = f"{bucket}-{name}.{uuid.uuid4().hex}"
        _write_bytes(self.root / "leases" / token, repr(time.time() + seconds).encode())
        return token

    def release(self, token: str | None) -> None:
        if token is not None and "/" not in token and not token.startswith("."):
            (self.root / "leases" / token).unlink(missing_ok=True)

    def _leased(self, bucket: str, name: str) -> bool:
        now = time.time()
        for p in (self.root / "leases").glob(f"{bucket}-{name}.*"):
            try:
                if float(p.read_text()) > now:
                    return True
                p.unlink(missing_ok=True)  # ended
            except (OSError, ValueError):
                pass
        return False

    # -- models and records --------------------------------------------------------------

    def _model_put(self, key: str, text: str) -> None:
        path = self.root / "models" / f"{key}.json"
        if not path.is_file():
            _write_bytes(path, text.encode())

    def _model_get(self, key: str) -> str | None:
        try:
            return (self.root / "models" / f"{key}.json").read_text()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise RarecacheError(f"cannot read the store's record of a model: {e}") from None

    def _record_put(self, name: str, text: str) -> None:
        _write_bytes(self.root / "records" / f"{name}.json", text.encode())

    def _record_take(self, name: str) -> bytes | None:
        path = self.root / "records" / f"{name}.json"
        try:
            with open(path, "rb") as f:
                raw = f.read(MAX_RECORD + 1)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise RarecacheError(f"cannot read the record {name}: {e}") from None
        path.unlink(missing_ok=True)
        return raw

    def _backend_stats(self) -> dict[str, Any]:
        entries = self._entries()
        try:
            evictions = int((self.root / "evictions").read_text() or 0)
        except (OSError, ValueError):
            evictions = 0
        return {"bytes": sum(e[1] for e in entries), "entries": len(entries), "evictions": evictions,
                "cap_bytes": self.cap_bytes, "backend": "directory"}


def _write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
