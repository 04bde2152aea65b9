"""The row store the engines share: KV rows of finished requests, keyed by model, salt and tokens.

An engine-independent directory (under /dev/shm or a temp dir; every engine that hands off
to or from another points at the same one). It holds data only, safetensors plus small JSON
files, never pickle, and a reader checks what it reads (shapes, dtypes, finite values, that
an entry's own metadata names the model and tokens it is filed under), since another
process wrote it.

Layout, under the root:

    models/<model key>.json          identity (name, config and weight fingerprints) + ModelConfig
    rows/<bucket>/<entry>.safetensors  one sequence: per layer k.{l}, v.{l} as (Hkv, n, D)
    rows/<bucket>/prefix/<chain>     the entry holding the sequence's first 16·i tokens
    records/<name>.json              what one handoff did, for whoever asked (`put_record`)

A bucket is sha256(model key, salt): rows are only ever found by the model that computed them
(its config and weight fingerprints, as map files carry) and the same cache salt, so one
tenant never reads another's rows. K is stored rotated, exactly as the engine caches it;
the model's RoPE (in models/) lets any reader strip it. `prefix/` files name, for each
16-token chunk boundary, an entry whose tokens start with that prefix (a chained hash of the
chunks, as vLLM's own block hashes are chained): a lookup walks the new request's chunks and
stops at the first miss, O(prompt / 16) stat calls whatever the store holds.

Entries are written to a temporary name and renamed, then their prefix files: a reader sees
whole entries or none. Every file is created 0600. Nothing is ever evicted (a known limit:
point the store at a directory that is cleaned, e.g. per deployment).

A record is the worker's account of one handoff (peer, positions, ρ, or the error), filed
under a name the request chose, because the worker is the only process that knows what its
load did and the request's own output may never come back (an aborted request has none).
The reader takes it (reads and deletes it) and checks it like anything else read here.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ...errors import RarecacheError
from ...models.config import ModelConfig, RopeConfig
from ...models.loader import checkpoint_fingerprint

FORMAT_VERSION = 1
CHUNK = 16  # tokens per prefix-index step; vLLM block sizes are multiples of it
_META = "rarecache.rows"
RECORD_NAME = re.compile(r"[0-9a-f]{32}")  # a record's file name: nothing a path could be made of
MAX_RECORD = 64 << 10  # bytes; a record is a few hundred
RECORD_VERSION = 1  # of the records the worker files (worker.py); whoever reads one checks it


def model_identity(path: str | Path) -> dict[str, str]:
    """Who the model in checkpoint directory `path` is, as `transfer.mapper.identity` says for a
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

    path: Path
    length: int  # tokens in common with the lookup (from the start)
    stored: int  # rows the entry holds


class RowStore:
    def __init__(self, root: str | Path):
        self.root = Path(root)
        try:
            (self.root / "models").mkdir(parents=True, exist_ok=True)
            (self.root / "rows").mkdir(parents=True, exist_ok=True)
            (self.root / "records").mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise RarecacheError(f"cannot use {self.root} as a row store: {e}") from None

    # -- keys ----------------------------------------------------------------------------

    def bucket(self, identity: dict[str, str], salt: str | None) -> Path:
        h = hashlib.sha256(f"{FORMAT_VERSION}\0{model_key(identity)}\0{salt or ''}".encode()).hexdigest()
        return self.root / "rows" / h[:32]

    @staticmethod
    def chain(bucket: Path, tokens: list[int]) -> list[str]:
        """Chained hash of each whole CHUNK of tokens: entry i names the first (i+1)·CHUNK tokens."""
        h = hashlib.sha256(bucket.name.encode()).digest()
        out = []
        for i in range(len(tokens) // CHUNK):
            chunk = torch.tensor(tokens[i * CHUNK:(i + 1) * CHUNK], dtype=torch.int64).numpy().tobytes()
            h = hashlib.sha256(h + chunk).digest()
            out.append(h.hex()[:32])
        return out

    # -- models --------------------------------------------------------------------------

    def register_model(self, identity: dict[str, str], cfg: ModelConfig) -> None:
        """Record a model's config once, so readers can strip its RoPE and check map fits."""
        if cfg.fingerprint() != identity["config"]:
            raise RarecacheError(f"model {identity['name']}: its config does not match its fingerprint")
        path = self.root / "models" / f"{model_key(identity)}.json"
        if not path.is_file():
            _write_text(path, json.dumps({"format_version": FORMAT_VERSION, "identity": identity,
                                          "config": config_to_json(cfg)}))

    def model_config(self, identity: dict[str, str]) -> ModelConfig | None:
        """The config of a model some engine registered; None if none has."""
        path = self.root / "models" / f"{model_key(identity)}.json"
        if not path.is_file():
            return None
        try:
            raw = json.loads(path.read_text())
            cfg = config_from_json(raw["config"])
        except (OSError, ValueError, KeyError, TypeError, RarecacheError) as e:
            raise RarecacheError(f"{path} is not a model record: {e}") from None
        if cfg.fingerprint() != identity["config"]:
            raise RarecacheError(f"{path}: the config does not match the fingerprint it is filed under")
        return cfg

    # -- rows ----------------------------------------------------------------------------

    def put(self, identity: dict[str, str], salt: str | None, tokens: list[int], k: torch.Tensor,
            v: torch.Tensor) -> Path | None:
        """Store the rows k, v (L, Hkv, n, D) a model computed for `tokens` (n of them) itself.

        Returns the entry, or None when the store already holds these tokens' rows (the same
        sequence, or a longer one it starts)."""
        L, H, n, D = k.shape
        if v.shape != k.shape or n != len(tokens) or n == 0:
            raise RarecacheError(f"rows {tuple(k.shape)} / {tuple(v.shape)} do not fit {len(tokens)} tokens")
        bucket = self.bucket(identity, salt)
        hit = self.lookup(identity, salt, tokens)
        if hit is not None and hit.length == n:
            return None
        name = hashlib.sha256(torch.tensor(tokens, dtype=torch.int64).numpy().tobytes()).hexdigest()[:32]
        path = bucket / f"{name}.safetensors"
        (bucket / "prefix").mkdir(parents=True, exist_ok=True)
        tensors = {}
        for layer in range(L):
            tensors[f"k.{layer}"] = k[layer].contiguous()
            tensors[f"v.{layer}"] = v[layer].contiguous()
        meta = {"format_version": FORMAT_VERSION, "identity": identity, "tokens": list(map(int, tokens)),
                "layers": L, "kv_heads": H, "head_dim": D, "dtype": str(k.dtype).removeprefix("torch.")}
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}")
        save_file(tensors, str(tmp), metadata={_META: json.dumps(meta)})
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
        for h in self.chain(bucket, tokens):  # after the entry: a prefix file never names a missing entry
            _write_text(bucket / "prefix" / h, path.name)
        return path

    def lookup(self, identity: dict[str, str], salt: str | None, tokens: list[int]) -> Hit | None:
        """The stored sequence of this model and salt sharing the longest prefix with `tokens`
        (at least one CHUNK), or None."""
        bucket = self.bucket(identity, salt)
        if not (bucket / "prefix").is_dir():
            return None
        best = None
        for h in self.chain(bucket, tokens):
            try:
                name = (bucket / "prefix" / h).read_text().strip()
            except OSError:
                break
            best = name
        if best is None or "/" in best or not best.endswith(".safetensors"):
            return None
        path = bucket / best
        meta = self._meta(path)
        if meta is None or not same_model(meta["identity"], identity):
            return None
        stored = meta["tokens"]
        length = 0
        for a, b in zip(stored, tokens):
            if a != b:
                break
            length += 1
        return Hit(path, length, len(stored)) if length else None

    def load(self, hit: Hit, n: int, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
        """The first n rows of an entry as k, v (L, Hkv, n, D), checked against the model's config."""
        meta = self._meta(hit.path)
        if meta is None:
            raise RarecacheError(f"{hit.path} is not a row entry")
        L, H, D = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
        if (meta["layers"], meta["kv_heads"], meta["head_dim"]) != (L, H, D) or n > len(meta["tokens"]):
            raise RarecacheError(f"{hit.path} holds rows that do not fit its model (or fewer than {n})")
        ks, vs = [], []
        try:
            with safe_open(str(hit.path), framework="pt") as f:
                for layer in range(L):
                    for side, out in (("k", ks), ("v", vs)):
                        t = f.get_slice(f"{side}.{layer}")
                        shape = t.get_shape()
                        if len(shape) != 3 or (shape[0], shape[2]) != (H, D) or shape[1] < n:
                            raise RarecacheError(f"{hit.path}: {side}.{layer} has shape {shape}")
                        out.append(t[:, :n])
        except (OSError, SafetensorError, ValueError) as e:
            raise RarecacheError(f"{hit.path} is not a row entry: {e}") from None
        k, v = torch.stack(ks), torch.stack(vs)  # (L, Hkv, n, D)
        if not k.is_floating_point() or k.dtype != v.dtype or not (torch.isfinite(k).all() and torch.isfinite(v).all()):
            raise RarecacheError(f"{hit.path} holds rows that are not finite floating-point values")
        return k, v

    def nbytes(self) -> int:
        """Bytes of the row entries the store holds (the prefix index and records left out)."""
        total = 0
        for bucket in os.scandir(self.root / "rows"):
            if bucket.is_dir():
                total += sum(e.stat().st_size for e in os.scandir(bucket.path) if e.name.endswith(".safetensors"))
        return total

    # -- records -------------------------------------------------------------------------

    def put_record(self, name: str, record: dict[str, Any]) -> None:
        """File `record` (JSON) under `name` (RECORD_NAME), replacing one of that name."""
        _write_text(self._record_path(name), json.dumps(record))

    def take_record(self, name: str) -> dict[str, Any] | None:
        """The record filed under `name`, removed from the store; None if there is none. Only its
        form is checked here (a JSON object of at most MAX_RECORD bytes); its contents are the
        reader's to check."""
        path = self._record_path(name)
        try:
            with open(path, "rb") as f:
                raw = f.read(MAX_RECORD + 1)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise RarecacheError(f"cannot read the record {name}: {e}") from None
        path.unlink(missing_ok=True)
        try:
            record = json.loads(raw) if len(raw) <= MAX_RECORD else None
        except (ValueError, RecursionError):
            record = None
        if not isinstance(record, dict):
            raise RarecacheError(f"the record {name} is not a JSON object of at most {MAX_RECORD} bytes")
        return record

    def _record_path(self, name: str) -> Path:
        if not (isinstance(name, str) and RECORD_NAME.fullmatch(name)):
            raise RarecacheError("a record name is 32 lowercase hex digits")
        return self.root / "records" / f"{name}.json"

    @staticmethod
    def _meta(path: Path) -> dict[str, Any] | None:
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = json.loads((f.metadata() or {})[_META])
        except (OSError, SafetensorError, ValueError, KeyError, TypeError):
            return None
        ok = (isinstance(meta, dict) and meta.get("format_version") == FORMAT_VERSION
              and isinstance(meta.get("identity"), dict) and isinstance(meta.get("tokens"), list)
              and all(type(t) is int for t in meta["tokens"])
              and all(type(meta.get(key)) is int for key in ("layers", "kv_heads", "head_dim")))
        return meta if ok else None


def _write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)
