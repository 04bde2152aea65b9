"""The row store's entry format, one for both backends (interface.py): safetensors bytes with a JSON header.

An entry holds one sequence's rows, per layer k.{l}, v.{l} as (Hkv, n, D), and in the
safetensors metadata a small JSON header: the model's identity, the tokens, the shapes, the
dtype, when it was written and when it expires. Data only, never pickle. Another process (on
another host, through Redis) wrote it, so `decode_meta` and `decode_rows` check everything a
reader relies on and refuse the rest with a reason (`EntryGone.reason`, one of REASONS).
"""

from __future__ import annotations

import json
import struct
import time
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from ....errors import RarecacheError

FORMAT_VERSION = 2  # 2: the header carries its expiry; both backends
_META = "rarecache.rows"
MAX_HEADER = 16 << 20  # bytes of an entry's JSON header at most
# why a lookup or a load found no rows it could use (the handoff's fallback reasons)
REASONS = ("no_entry", "identity_mismatch", "evicted", "store_down", "corrupt_entry")


class EntryGone(RarecacheError):
    """An entry a lookup found could not be loaded: `reason` is one of REASONS."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


def encode_entry(identity: dict[str, str], tokens: list[int], k: torch.Tensor, v: torch.Tensor,
                 ttl: float | None, now: float | None = None) -> bytes:
    """Rows k, v (L, Hkv, n, D) of `tokens` as safetensors bytes with the entry header."""
    L, H, n, D = k.shape
    tensors = {}
    for layer in range(L):
        tensors[f"k.{layer}"] = k[layer].contiguous()
        tensors[f"v.{layer}"] = v[layer].contiguous()
    now = time.time() if now is None else now
    meta = {"format_version": FORMAT_VERSION, "identity": identity, "tokens": list(map(int, tokens)),
            "layers": L, "kv_heads": H, "head_dim": D, "dtype": str(k.dtype).removeprefix("torch."),
            "written": now, "expires": None if ttl is None else now + ttl}
    return st_save(tensors, metadata={_META: json.dumps(meta)})


def header_length(head: bytes) -> int | None:
    """The whole header's length (8 + JSON) from an entry's first 8 bytes, or None."""
    if len(head) < 8:
        return None
    (n,) = struct.unpack("<Q", head[:8])
    return 8 + n if n <= MAX_HEADER else None


def decode_meta(head: bytes) -> dict[str, Any] | None:
    """The entry header from an entry's first bytes (at least `header_length` of them); None if
    they are not an entry of this format."""
    size = header_length(head)
    if size is None or len(head) < size:
        return None
    try:
        header = json.loads(head[8:size])
        meta = json.loads(header["__metadata__"][_META])
    except (ValueError, KeyError, TypeError, RecursionError):
        return None
    ok = (isinstance(meta, dict) and meta.get("format_version") == FORMAT_VERSION
          and isinstance(meta.get("identity"), dict) and isinstance(meta.get("tokens"), list)
          and all(type(t) is int for t in meta["tokens"])
          and all(type(meta.get(key)) is int for key in ("layers", "kv_heads", "head_dim"))
          and (meta.get("expires") is None or isinstance(meta.get("expires"), (int, float))))
    return meta if ok else None


def decode_rows(blob: bytes, meta: dict[str, Any], n: int, cfg: Any, where: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The first n rows of an entry as k, v (L, Hkv, n, D), checked against the model's config."""
    L, H, D = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
    if (meta["layers"], meta["kv_heads"], meta["head_dim"]) != (L, H, D) or n > len(meta["tokens"]):
        raise EntryGone("identity_mismatch", f"{where} holds rows that do not fit its model (or fewer than {n})")
    try:
        tensors = st_load(blob)
    except (SafetensorError, ValueError, OSError) as e:
        raise EntryGone("corrupt_entry", f"{where} is not a row entry: {e}") from None
    ks, vs = [], []
    for layer in range(L):
        for side, out in (("k", ks), ("v", vs)):
            t = tensors.get(f"{side}.{layer}")
            if t is None or t.dim() != 3 or (t.shape[0], t.shape[2]) != (H, D) or t.shape[1] < n:
                raise EntryGone("corrupt_entry", f"{where}: {side}.{layer} has shape "
                                f"{None if t is None else tuple(t.shape)}")
            out.append(t[:, :n])
    k, v = torch.stack(ks), torch.stack(vs)  # (L, Hkv, n, D)
    if not k.is_floating_point() or k.dtype != v.dtype or not (torch.isfinite(k).all() and torch.isfinite(v).all()):
        raise EntryGone("corrupt_entry", f"{where} holds rows that are not finite floating-point values")
    return k, v
