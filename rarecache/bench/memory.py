"""Peak memory of one phase (a prefill, a handoff) above what the process held before it.

On a CPU this is resident memory (RSS), not tracemalloc: tracemalloc sees only
Python's own allocator, and a tensor's storage comes from torch's C++ allocator,
which it never sees. Linux resets the peak-RSS mark when "5" is written to
/proc/self/clear_refs, so each phase gets its own peak: collect garbage and hand
glibc's free pages back (malloc_trim) first, so the phase's "before" is live
memory only, reset the mark, run the phase, read VmHWM. What a phase allocates
without touching (torch.empty never written) is not counted, which is right: it
costs no memory. Elsewhere (macOS) the figure is None. On a GPU it is torch's own
peak-allocation counter.

Alongside the measurement, `footprint` gives the sizes that explain it, from the
shapes: the source cache and the mapped (target) cache grow with T and with the
pair's layers x KV width, the map with the pair only.
"""

from __future__ import annotations

import ctypes
import gc
from contextlib import contextmanager
from pathlib import Path

import torch

MIB = 2**20
_STATUS = Path("/proc/self/status")
_CLEAR = Path("/proc/self/clear_refs")


def _status_kib(field: str) -> int | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def _trim() -> None:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class Peak:
    """The peak, in MiB above the memory held at the start, of what ran inside `measure` (None if unknown)."""

    mib: float | None = None


@contextmanager
def measure(device: torch.device | str = "cpu"):
    peak = Peak()
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
        start = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        yield peak
        torch.cuda.synchronize()
        peak.mib = (torch.cuda.max_memory_allocated() - start) / MIB
        return
    _trim()
    start = _status_kib("VmRSS")
    try:
        _CLEAR.write_text("5")  # reset VmHWM to the current RSS
        ok = start is not None
    except OSError:
        ok = False
    yield peak
    high = _status_kib("VmHWM") if ok else None
    peak.mib = None if high is None else max(0.0, (high - start) / 1024)


def nbytes(*tensors: torch.Tensor) -> int:
    """Bytes of distinct storages among `tensors`."""
    seen, total = set(), 0
    for t in tensors:
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def footprint(source, target, mapper, T: int, batch: int) -> dict[str, float]:
    """What a handoff of `batch` prompts of T tokens holds besides the weights, in MiB, from the shapes."""
    cs, ct = source.config, target.config
    size = torch.empty((), dtype=target.dtype).element_size()
    src_size = torch.empty((), dtype=source.dtype).element_size()
    maps = [t for side in ("k", "v") for n, t in mapper.tensors(side, mapper.dtype_for(target), target.device).items()
            if isinstance(t, torch.Tensor) and n != "sources"]
    return {"source_cache_mib": 2 * cs.num_layers * batch * cs.kv_dim * (T + 1) * src_size / MIB,
            "target_cache_mib": 2 * ct.num_layers * batch * ct.kv_dim * (T + 1) * size / MIB,
            "map_mib": nbytes(*maps) / MIB,
            # (a token-input map also holds the token block, B·T·2·kv_t: `Mapper.extra_width`)
            "map_buffer_mib": batch * T * (cs.num_layers * cs.kv_dim + ct.kv_dim + mapper.extra_width) * size / MIB}


def formula(source, target, mapper) -> str:
    """The growth law behind `footprint`, with this pair's numbers in it."""
    cs, ct, k = source.config, target.config, mapper.info.k
    r = mapper.info.rank
    return (f"source cache 2·Ls·B·(T+1)·kv_s = 2·{cs.num_layers}·B·(T+1)·{cs.kv_dim} elements; "
            f"mapped cache 2·Lt·B·(T+1)·kv_t = 2·{ct.num_layers}·B·(T+1)·{ct.kv_dim}; "
            f"map 2·Lt·(K·kv_s·kv_t + kv_t·r) = 2·{ct.num_layers}·({k}·{cs.kv_dim}·{ct.kv_dim} + {ct.kv_dim}·{r}), "
            f"not growing with T; map working set B·T·(Ls·kv_s + kv_t) = B·T·({cs.num_layers}·{cs.kv_dim} + "
            f"{ct.kv_dim}) (one side at a time)")


def memory_kind(device: torch.device | str) -> str:
    """How `measure` measures on this device, for the printed header."""
    if torch.device(device).type == "cuda":
        return "torch.cuda peak allocated"
    return "peak RSS (VmHWM after clear_refs)" if _CLEAR.exists() else "not measured (no /proc/self/clear_refs)"
