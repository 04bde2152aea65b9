"""How fast one 512 x 1536 x 2048 product runs in float32 and bf16 under this process's ISA caps (a probe).

Run it plain and under the caps that make an AVX-512/AMX machine run AVX2 code paths, to see what
`--dtype auto` must read (rarecache/dtypes.py) and what an "emulated AVX2" bench does and does not cap:
    AVX2="ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2"
    for env in "" ONEDNN_MAX_CPU_ISA=AVX2 "$AVX2"; do env $env python research/scripts/isa_caps.py; done
"""

from __future__ import annotations

import os
import time

import torch

from rarecache.dtypes import resolve_dtype

torch.set_num_threads(1)
caps = " ".join(f"{v}={os.environ[v]}" for v in ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY",
                                                  "MKL_ENABLE_INSTRUCTIONS") if os.environ.get(v)) or "no caps"
rates = []
for dt in (torch.float32, torch.bfloat16):
    a, b = torch.randn(512, 1536, dtype=dt), torch.randn(1536, 2048, dtype=dt)
    a @ b  # warm-up
    t, n = time.perf_counter(), 0
    while time.perf_counter() - t < 2:
        a @ b
        n += 1
    rates.append(f"{str(dt).split('.')[1]} {2 * 512 * 1536 * 2048 * n / (time.perf_counter() - t) / 1e9:.1f} GFLOP/s")
print(f"{caps}: capability {torch.backends.cpu.get_cpu_capability()}, one thread, {', '.join(rates)}; "
      f"auto -> {resolve_dtype().line()}")
