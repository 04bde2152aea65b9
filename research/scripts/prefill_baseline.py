"""Is our own prefill a fair baseline? The target's prefill through our Runner against transformers' (SDPA
attention, the implementation a user of transformers gets), same config, random weights, same device and dtype,
timed in the same run (median of repeats after a warm-up; CUDA synchronised). A ratio above 1 means ours is
faster. `bench handoff` divides by our own prefill, so where transformers' is faster the handoff's speed-ups
would have to be read against it instead.

    python research/scripts/prefill_baseline.py --shape qwen3-14b --device cuda --lengths 149 512 2048 --batches 1 4 16
"""

from __future__ import annotations

import argparse
import json

import torch

from rarecache.bench.ablate import median_time
from rarecache.bench.gpu import hf_twin
from rarecache.bench.shapes import CONFIGS, random_model, random_runner


def hf_model(name: str, dtype: torch.dtype, device: str, max_layers: int | None):
    """transformers' model of shape `name` over random weights of its own (`bench gpu` shares ours instead)."""
    return hf_twin(random_model(name, dtype, device, max_layers), name)


def median_ms(fn, repeats: int, device: torch.device) -> float:
    return median_time(fn, repeats, device) * 1e3


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="qwen3-14b", choices=sorted(CONFIGS))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--lengths", type=int, nargs="+", default=[149, 512, 2048])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--max-layers", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    ours = random_runner(args.shape, dtype, args.device, args.max_layers)
    theirs = hf_model(args.shape, dtype, args.device, args.max_layers)
    device = ours.device
    print(f"prefill, {args.shape} (random weights{f', {args.max_layers} layers' if args.max_layers else ''}), "
          f"{args.dtype}, {args.device}: ours (Runner) vs transformers {__import__('transformers').__version__} "
          f"(sdpa), median of {args.repeats} after a warm-up, logits at the last position only")
    print(f"{'T':>6} {'B':>3} {'ours ms':>9} {'transformers ms':>16} {'transformers / ours':>19}")
    rows = []
    g = torch.Generator().manual_seed(0)
    for T in args.lengths:
        for B in args.batches:
            tokens = torch.randint(0, ours.config.vocab_size, (B, T), generator=g).to(device)
            pos = torch.arange(T, device=device).expand(B, T)
            a = median_ms(lambda: ours.forward(tokens, pos, ours.new_cache(B, T)), args.repeats, device)
            b = median_ms(lambda: theirs(input_ids=tokens, use_cache=True, logits_to_keep=1), args.repeats, device)
            rows.append({"T": T, "batch": B, "ours_ms": a, "transformers_ms": b, "transformers_over_ours": b / a})
            print(f"{T:>6} {B:>3} {a:>9.1f} {b:>16.1f} {b / a:>18.2f}x", flush=True)
    print(json.dumps({"bench": "prefill_baseline", "shape": args.shape, "dtype": args.dtype, "device": args.device,
                      "max_layers": args.max_layers, "rows": rows}))


if __name__ == "__main__":
    main()
