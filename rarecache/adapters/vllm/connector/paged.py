"""Rows in and out of vLLM's paged KV cache, with the layout left to vLLM's own kernel.

vLLM's cache (0.32, CPU and GPU backends alike) is one tensor per layer, (num_blocks, Hkv,
block_size, 2·D), and how a token's K and V sit inside a block depends on the backend (on the
CPU, on the attention ISA: for `vec`, K is stored transposed as (D, block_size) and V as
(block_size, D); other ISAs pack differently; FlashAttention keeps (block_size, D) rows). We
never hard-code it. Writing goes through the backend's own cache update
(`do_kv_cache_update`, the op vLLM's forward calls), so the bytes are exactly what the engine
itself would write. Reading uses the inverse of that
op, found once by asking the op: it writes numbered elements into a scratch block, and
where each number lands is where that element lives (`Layout.probe`). The numbers are
written a base-16 digit per pass, so they are exact in any cache dtype (bf16 holds
integers to 256 exactly).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ....errors import RarecacheError

BASE = 16


@dataclass
class Layout:
    """Where each K and V element of a block lives: flat offsets (block_size, Hkv, D) into one block."""

    block_size: int
    kv_heads: int
    head_dim: int
    k_at: torch.Tensor
    v_at: torch.Tensor

    @classmethod
    def probe(cls, write, kv_heads: int, block_size: int, head_dim: int, dtype: torch.dtype,
              device: torch.device | str = "cpu") -> "Layout":
        """`write(key, value, kv_block, slots)` stores key / value (T, Hkv, D) at `slots` of a cache
        shaped like vLLM's, (1, Hkv, block_size, 2·D) here. Returns where every element lands."""
        T, H, D = block_size, kv_heads, head_dim
        n = T * H * D
        idx = torch.arange(n).view(T, H, D)
        passes = max(1, math.ceil(math.log(n, BASE)))
        slots = torch.arange(T, dtype=torch.int64, device=device)
        found = {}
        for side in ("k", "v"):
            code = torch.zeros(H * T * 2 * D, dtype=torch.long)
            seen = None
            for j in range(passes):
                digit = (idx // BASE**j) % BASE + 1  # 1..16: zero marks the other side
                block = torch.zeros(1, H, T, 2 * D, dtype=dtype, device=device)
                data = digit.to(device=device, dtype=dtype)
                zero = torch.zeros_like(data)
                write(data if side == "k" else zero, zero if side == "k" else data, block, slots)
                got = block.reshape(-1).float().round().long().cpu()
                here = got > 0
                seen = here if seen is None else seen
                if not torch.equal(here, seen) or got.max() > BASE:
                    raise RarecacheError("vLLM's cache kernel does not store elements at fixed places in a block "
                                         "(an unknown layout); the adapter cannot read its rows")
                code[here] += (got[here] - 1) * BASE**j
            where = seen.nonzero().flatten()
            at = torch.full((n,), -1, dtype=torch.long)
            at[code[where]] = where
            if len(where) != n or (at < 0).any():
                raise RarecacheError("vLLM's cache kernel does not keep every K and V element of a block "
                                     "(an unknown layout); the adapter cannot read its rows")
            found[side] = at.view(T, H, D).to(device)
        return cls(block_size, kv_heads, head_dim, found["k"], found["v"])

    def read(self, kv: torch.Tensor, block_ids: list[int], n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of positions [0, n) held in blocks `block_ids` (in order) of one layer's cache
        -> k, v (Hkv, n, D)."""
        need = math.ceil(n / self.block_size)
        if len(block_ids) < need:
            raise RarecacheError(f"{n} positions need {need} blocks, {len(block_ids)} given")
        ids = torch.tensor(block_ids[:need], dtype=torch.long, device=kv.device)
        blocks = kv[ids].reshape(need, -1)  # (nb, H·bs·2D)
        out = []
        for at in (self.k_at, self.v_at):
            x = blocks[:, at.reshape(-1)].view(need * self.block_size, self.kv_heads, self.head_dim)  # (nb·bs, H, D)
            out.append(x[:n].transpose(0, 1).contiguous())  # (H, n, D)
        return out[0], out[1]


def slots(block_ids: list[int], positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Slot of each position (T,) in a request holding blocks `block_ids`: block · bs + offset."""
    table = torch.tensor(block_ids, dtype=torch.int64)
    return table[positions // block_size] * block_size + positions % block_size
