"""Should float32 weights be prepacked for oneDNN by default on a CPU? (issue 55)

Times the 1.5B's per-layer products (q, k/v, o, gate/up, down and the LM head) at the row counts a
handoff runs: 1 (a decoded token), the recompute's rows at T 512/2048 ρ 0.3 (154, 614), and a
prefill's (2048), through `F.linear` and through `models.packed.PackedLinear`, on one thread's
CPU clock (`time.thread_time`: a shared machine slows the wall clock, not this), median of repeats.
Random weights: only the shapes matter. Prints the capability, dtype, threads, per shape and row
count both times and their ratio, and per row count the sum over one decoder layer's products.

    OMP_NUM_THREADS=1 python research/scripts/time_packed_products.py --dtypes float32 bfloat16
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from rarecache.models.packed import PackedLinear

SHAPES = {"q/o": (1536, 1536), "k/v": (256, 1536), "gate/up": (8960, 1536), "down": (1536, 8960)}
PER_LAYER = {"q/o": 2, "k/v": 2, "gate/up": 2, "down": 1}  # how many of each product a decoder layer runs


def cpu_time(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.thread_time()
        fn()
        times.append(time.thread_time() - t)
    return statistics.median(times)


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 154, 614, 2048])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"cpu {torch.backends.cpu.get_cpu_capability()}, threads {torch.get_num_threads()}, thread CPU clock, "
          f"median of {args.repeats}")
    for name in args.dtypes:
        dtype = getattr(torch, name)
        layer = {r: [0.0, 0.0] for r in args.rows}
        for shape, (out_f, in_f) in SHAPES.items():
            w = torch.randn(out_f, in_f, dtype=dtype) * in_f**-0.5
            try:
                packed = PackedLinear(w)
            except RuntimeError as e:
                print(f"{name}: cannot pack here ({str(e)[:120]})")
                break
            for rows in args.rows:
                x = torch.randn(1, rows, in_f, dtype=dtype)
                plain_s = cpu_time(lambda: F.linear(x, w), args.repeats)
                packed_s = cpu_time(lambda: packed(x), args.repeats)
                err = (packed(x) - F.linear(x, w)).abs().max().item()
                layer[rows][0] += PER_LAYER[shape] * plain_s
                layer[rows][1] += PER_LAYER[shape] * packed_s
                print(f"{name:>9} {shape:>8} rows {rows:>5}: F.linear {plain_s * 1e3:8.2f} ms, packed "
                      f"{packed_s * 1e3:8.2f} ms, {plain_s / packed_s:5.2f}x, max |diff| {err:.1e}")
        else:
            for rows, (plain_s, packed_s) in layer.items():
                print(f"{name:>9} one layer's products, rows {rows:>5}: F.linear {plain_s * 1e3:8.2f} ms, "
                      f"packed {packed_s * 1e3:8.2f} ms, {plain_s / packed_s:5.2f}x")


if __name__ == "__main__":
    main()
