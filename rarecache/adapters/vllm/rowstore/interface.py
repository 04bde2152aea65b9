"""The row store the engines share: KV rows of finished requests, keyed by model, salt and tokens.

Two engines hand a conversation off only through this store, so it is an interface with two
backends chosen by one setting (`store_open.open_store`): a directory (`store_dir.py`: /dev/shm or any
path every engine of one host can reach; bounded by `cap_bytes` with least-recently-used
eviction) and a Redis/Valkey server (`store_redis.py`: `redis://HOST:PORT/DB` or
`unix:///path.sock`, for engines on different hosts; bounded by the server's own `maxmemory`
and LRU policy). Both use one key schema and one entry format, written and checked here.

Keys. A bucket is sha256(format, model key, salt), the model key being the model's config and
weight fingerprints (as map files carry): rows are only ever found by the model that computed
them and the same cache salt, so one tenant never reads another's rows (vLLM #44250 and
LMCache #2960 were keys that missed part of the identity). Prefix keys name, for each 16-token
chunk boundary, an entry whose tokens start with that prefix (a chained hash of the chunks, as
vLLM's block hashes are chained): a lookup walks the request's chunks and stops at the first
miss. K is stored rotated, exactly as the engine caches it; the model's RoPE strips it.

Entries are entry.py's format (safetensors bytes and a JSON header, never pickle), checked on
read: a corrupt entry or another model's is refused with its reason. Any miss is a `Miss` with
its reason (REASONS): the engine then prefills the prompt itself, never fails the request.

Each entry lives `ttl` seconds at most; a handoff that found an entry holds a lease on it until
its load is done, and the directory store never evicts a leased entry (Redis reads an entry in
one command; one evicted between the claim and the load is the reason `evicted`).

A record is the worker's account of one handoff, filed under a name the request chose (the
worker is the only process that knows what its load did); the reader takes it and checks it.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from ....errors import RarecacheError
from ....models.config import ModelConfig, RopeConfig
from ....models.loader import checkpoint_fingerprint
from ....transfer.conversation import common_prefix
from .entry import FORMAT_VERSION, REASONS, EntryGone, decode_meta, decode_rows, encode_entry, header_length

CHUNK = 16  # tokens per prefix-index step; vLLM block sizes are multiples of it
RECORD_NAME = re.compile(r"[0-9a-f]{32}")  # a record's file name: nothing a path could be made of
MAX_RECORD = 64 << 10  # bytes; a record is a few hundred
RECORD_VERSION = 1  # of the records the worker files (connector/worker_side.py); whoever reads one checks it
RECORD_TTL = 600  # seconds a record waits for its reader
LEASE_SECONDS = 120.0  # a lease a handoff never released ends by itself


class StoreDown(RarecacheError):
    """The store cannot be reached (a Redis server down): every lookup is a miss for now."""


def model_identity(path: str | Path) -> dict[str, str]:
    """Who the model in checkpoint directory `path` is, as `transfer.mapcheck.identity` says for a
    Runner loaded from it: directory name, architecture fingerprint, weight fingerprint."""
    path = Path(path)
    return {"name": path.name, "config": ModelConfig.from_dir(path).fingerprint(),
            "weights": checkpoint_fingerprint(path)}


def same_model(a: dict[str, str], b: dict[str, str]) -> bool:
    """The same weights under the same architecture (names may differ)."""
    return a.get("config") == b.get("config") and a.get("weights") == b.get("weights")


def model_key(identity: dict[str, str]) -> str:
    return f"{identity['config']}-{identity['weights']}"


def config_to_json(cfg: ModelConfig) -> dict[str, Any]:
    return asdict(cfg)


def config_from_json(raw: Any) -> ModelConfig:
    """A ModelConfig written by `config_to_json` (another process wrote it: checked, clear errors)."""
    try:
        d = dict(raw)
        d["rope"] = RopeConfig(**d["rope"])
        d["eos_token_ids"] = tuple(d.get("eos_token_ids") or ())
        return ModelConfig(**d)
    except (TypeError, KeyError, ValueError) as e:
        raise RarecacheError(f"not a model config: {e}") from None


@dataclass(frozen=True)
class Hit:
    """A stored sequence that starts with the first `length` tokens of a lookup."""

    entry: str  # "<bucket>/<name>": the backend's key of the entry
    length: int  # tokens in common with the lookup (from the start)
    stored: int  # rows the entry holds


@dataclass(frozen=True)
class Miss:
    """No usable rows, and why (one of REASONS)."""

    reason: str
    detail: str = ""


class RowStore(ABC):
    """The store's interface: the key schema, the entry checks, leases and counters, over a
    backend's few primitives (`_prefixes`, `_head`, `_blob`, `_write`, ...)."""

    url: str

    def __init__(self, ttl: float | None = None):
        if ttl is not None and not ttl > 0:
            raise RarecacheError(f"the store's entry lifetime must be > 0 seconds, not {ttl}")
        self.ttl = ttl
        self._lock = threading.Lock()
        self._counts = {"hits": 0, "misses": 0}
        self._reasons = {r: 0 for r in REASONS}
        self._models: dict[str, str] = {}  # model key -> its record (JSON), refiled with the rows

    # -- keys ----------------------------------------------------------------------------

    @staticmethod
    def bucket(identity: dict[str, str], salt: str | None) -> str:
        return hashlib.sha256(f"{FORMAT_VERSION}\0{model_key(identity)}\0{salt or ''}".encode()).hexdigest()[:32]

    @staticmethod
    def chain(bucket: str, tokens: list[int]) -> list[str]:
        """Chained hash of each whole CHUNK of tokens: entry i names the first (i+1)·CHUNK tokens."""
        h = hashlib.sha256(bucket.encode()).digest()
        out = []
        for i in range(len(tokens) // CHUNK):
            h = hashlib.sha256(h + struct.pack(f"<{CHUNK}q", *tokens[i * CHUNK:(i + 1) * CHUNK])).digest()
            out.append(h.hex()[:32])
        return out

    @staticmethod
    def entry_name(tokens: list[int]) -> str:
        return hashlib.sha256(struct.pack(f"<{len(tokens)}q", *tokens)).hexdigest()[:32]

    # -- models --------------------------------------------------------------------------

    def register_model(self, identity: dict[str, str], cfg: ModelConfig) -> None:
        """Record a model's config, so readers can strip its RoPE and check map fits (refiled with
        every entry of the model, so a store that evicted it learns it again)."""
        if cfg.fingerprint() != identity["config"]:
            raise RarecacheError(f"model {identity['name']}: its config does not match its fingerprint")
        text = json.dumps({"format_version": FORMAT_VERSION, "identity": identity, "config": config_to_json(cfg)})
        self._models[model_key(identity)] = text
        self._model_put(model_key(identity), text)

    def model_config(self, identity: dict[str, str]) -> ModelConfig | None:
        """The config of a model some engine registered; None if none has."""
        raw = self._model_get(model_key(identity))
        if raw is None:
            return None
        try:
            cfg = config_from_json(json.loads(raw)["config"])
        except (ValueError, KeyError, TypeError, RarecacheError) as e:
            raise RarecacheError(f"the store's record of {identity.get('name')} is not a model record: {e}") from None
        if cfg.fingerprint() != identity["config"]:
            raise RarecacheError(f"the store's record of {identity.get('name')} does not match its fingerprint")
        return cfg

    # -- rows ----------------------------------------------------------------------------

    def put(self, identity: dict[str, str], salt: str | None, tokens: list[int], k: torch.Tensor,
            v: torch.Tensor) -> str | None:
        """Store the rows k, v (L, Hkv, n, D) a model computed for `tokens` (n of them) itself.

        Returns the entry's key, or None when the store already holds these tokens' rows (the same
        sequence, or a longer one it starts) or cannot make room for them."""
        L, H, n, D = k.shape
        if v.shape != k.shape or n != len(tokens) or n == 0:
            raise RarecacheError(f"rows {tuple(k.shape)} / {tuple(v.shape)} do not fit {len(tokens)} tokens")
        bucket = self.bucket(identity, salt)
        found = self.find(identity, salt, tokens, count=False)
        if isinstance(found, Hit) and found.length == n:
            return None
        name = self.entry_name(list(tokens))
        blob = encode_entry(identity, tokens, k, v, self.ttl)
        ok = self._write(bucket, name, blob, self.chain(bucket, tokens), self._models.get(model_key(identity)),
                         model_key(identity))
        return f"{bucket}/{name}" if ok else None

    def find(self, identity: dict[str, str], salt: str | None, tokens: list[int], count: bool = True) -> Hit | Miss:
        """The stored sequence of this model and salt sharing the longest prefix with `tokens` (at
        least one CHUNK), or why there is none. A store that is down is a Miss, not an error."""
        try:
            found = self._find(identity, salt, tokens)
        except StoreDown as e:
            found = Miss("store_down", str(e))
        if count:
            with self._lock:
                if isinstance(found, Hit):
                    self._counts["hits"] += 1
                else:
                    self._counts["misses"] += 1
                    self._reasons[found.reason] += 1
        return found

    def _find(self, identity: dict[str, str], salt: str | None, tokens: list[int]) -> Hit | Miss:
        bucket = self.bucket(identity, salt)
        hashes = self.chain(bucket, tokens)
        if not hashes:
            return Miss("no_entry", f"fewer than {CHUNK} tokens")
        names = []  # deepest first, each once
        for name in reversed(self._prefixes(bucket, hashes)):
            if name is not None and name not in names:
                names.append(name)
        if not names:
            return Miss("no_entry", "no rows of this model and salt start with this prompt")
        miss = None
        for name in names:
            if not re.fullmatch(r"[0-9a-f]{32}", name):
                miss = miss or Miss("corrupt_entry", "a prefix key names no entry")
                continue
            head = self._head(bucket, name)
            if head is None:
                miss = miss or Miss("evicted", "the entry the prefix names was evicted")
                continue
            meta = decode_meta(head)
            if meta is None:
                miss = miss or Miss("corrupt_entry", "the entry is not a row entry of this format")
                continue
            if not same_model(meta["identity"], identity):
                miss = miss or Miss("identity_mismatch", "the entry was written by another model")
                continue
            if meta.get("expires") is not None and meta["expires"] <= time.time():
                self._expire(bucket, name)
                miss = miss or Miss("evicted", "the entry outlived its lifetime")
                continue
            length = common_prefix(meta["tokens"], tokens)
            if length == 0:
                miss = miss or Miss("corrupt_entry", "the entry's tokens do not start with its prefix")
                continue
            return Hit(f"{bucket}/{name}", length, len(meta["tokens"]))
        return miss

    def lookup(self, identity: dict[str, str], salt: str | None, tokens: list[int]) -> Hit | None:
        """`find`, None for any miss (counted all the same)."""
        return found if isinstance(found := self.find(identity, salt, tokens), Hit) else None

    def load(self, hit: Hit, n: int, cfg: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The first n rows of an entry as k, v (L, Hkv, n, D), checked; EntryGone with its reason if
        the entry is gone, expired or corrupt."""
        bucket, name = self._split(hit.entry)
        blob = self._blob(bucket, name)
        if blob is None:
            raise EntryGone("evicted", f"the entry {hit.entry} was evicted before it was read")
        size = header_length(blob[:8])
        meta = decode_meta(blob[:size]) if size is not None else None
        if meta is None:
            raise EntryGone("corrupt_entry", f"{hit.entry} is not a row entry")
        if meta.get("expires") is not None and meta["expires"] <= time.time():
            raise EntryGone("evicted", f"{hit.entry} outlived its lifetime")
        return decode_rows(blob, meta, n, cfg, hit.entry)

    @staticmethod
    def _split(entry: str) -> tuple[str, str]:
        parts = entry.split("/")
        if len(parts) != 2 or not all(re.fullmatch(r"[0-9a-f]{32}", p) for p in parts):
            raise EntryGone("corrupt_entry", f"{entry[:80]!r} is not an entry key")
        return parts[0], parts[1]

    # -- leases (the directory store keeps a leased entry from eviction) -------------------

    def lease(self, hit: Hit, seconds: float = LEASE_SECONDS) -> str | None:
        """Keep `hit`'s entry until `release` (or `seconds`); returns the lease's token."""
        return None

    def release(self, token: str | None) -> None: ...

    # -- records -------------------------------------------------------------------------

    def put_record(self, name: str, record: dict[str, Any]) -> None:
        """File `record` (JSON) under `name` (RECORD_NAME), replacing one of that name."""
        self._record_put(_record_name(name), json.dumps(record))

    def take_record(self, name: str) -> dict[str, Any] | None:
        """The record filed under `name`, removed from the store; None if there is none. Only its
        form is checked here (a JSON object of at most MAX_RECORD bytes); its contents are the
        reader's to check."""
        raw = self._record_take(_record_name(name))
        if raw is None:
            return None
        try:
            record = json.loads(raw) if len(raw) <= MAX_RECORD else None
        except (ValueError, RecursionError):
            record = None
        if not isinstance(record, dict):
            raise RarecacheError(f"the record {name} is not a JSON object of at most {MAX_RECORD} bytes")
        return record

    # -- what an operator sees -----------------------------------------------------------

    def counters(self) -> dict[str, Any]:
        """This process's lookups: hits, misses, misses by reason."""
        with self._lock:
            return {**self._counts, "misses_by_reason": dict(self._reasons)}

    def stats(self) -> dict[str, Any]:
        """`counters` and the store's own: bytes held, evictions, entries (a Redis server's bytes are
        its used_memory, its evictions its evicted_keys), cap_bytes (None: unbounded). StoreDown if
        the store cannot be read (serve/metrics.py shows it as rarecache_store_up 0)."""
        return {**self.counters(), **self._backend_stats()}

    def nbytes(self) -> int:
        """Bytes the store holds (0 while it cannot be reached)."""
        try:
            return int(self._backend_stats()["bytes"])
        except StoreDown:
            return 0

    # -- the backend ---------------------------------------------------------------------

    @abstractmethod
    def _prefixes(self, bucket: str, hashes: list[str]) -> list[str | None]:
        """The entry name each prefix key holds, in order, None from the first one missing."""

    @abstractmethod
    def _head(self, bucket: str, name: str) -> bytes | None:
        """The entry's first bytes, its whole header at least (a use, for LRU); None if it is gone."""

    @abstractmethod
    def _blob(self, bucket: str, name: str) -> bytes | None:
        """The entry's bytes (a use, for LRU); None if it is gone."""

    @abstractmethod
    def _write(self, bucket: str, name: str, blob: bytes, hashes: list[str], model: str | None, key: str) -> bool:
        """File the entry, then its prefix keys, and the model's record; False: no room for it."""

    @abstractmethod
    def _expire(self, bucket: str, name: str) -> None: ...

    @abstractmethod
    def _model_put(self, key: str, text: str) -> None: ...

    @abstractmethod
    def _model_get(self, key: str) -> str | None: ...

    @abstractmethod
    def _record_put(self, name: str, text: str) -> None: ...

    @abstractmethod
    def _record_take(self, name: str) -> bytes | None: ...

    @abstractmethod
    def _backend_stats(self) -> dict[str, Any]: ...

    def close(self) -> None:
        return None


def _record_name(name: str) -> str:
    if not (isinstance(name, str) and RECORD_NAME.fullmatch(name)):
        raise RarecacheError("a record name is 32 lowercase hex digits")
    return name


def is_url(spec: str | Path) -> bool:
    return str(spec).startswith(("redis://", "rediss://", "unix://"))


def describe_store(spec: str | Path) -> str:
    """`spec` without a password, for logs."""
    return re.sub(r"//[^@/]*@", "//***@", str(spec))


__all__ = ["RowStore", "Hit", "Miss", "StoreDown", "EntryGone", "REASONS", "CHUNK", "encode_entry",
           "decode_meta", "header_length", "model_identity", "same_model", "describe_store"]
