"""`rarecache bench gpu`: the handoff against the stronger of our prefill and transformers' at the papers'
shapes (bench/gpu.py), writing DIR/handoff-summary.json; `--smoke` runs a toy grid on the CPU."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ..errors import RarecacheError
from .common import add_dtype_option, write_out


def add_gpu(bench) -> None:
    b = bench.add_parser("gpu", help="handoff vs the stronger of our prefill and transformers' SDPA prefill, "
                                     "Qwen3-0.6B -> 14B shapes, random weights (a GPU's run)",
                         description="Time the handoff (rank and suffix, every rho) against both prefills of the "
                                     "same prompts over the same random weights, in the same run; write "
                                     "DIR/handoff-summary.json (device, rows of T, batch, rho, selector, "
                                     "speedup_vs_best_prefill, of_sparse_ceiling, map_score_share_of_prefill) and "
                                     "DIR/handoff-detail.json (every timing).")
    b.add_argument("--out", type=Path, required=True, help="folder for the summary and the detail")
    b.add_argument("--smoke", action="store_true", help="toy shapes and a tiny grid on the CPU (checks the bench)")
    b.add_argument("--device", default=None, help="default: cuda (cpu with --smoke)")
    add_dtype_option(b, device=gpu_device)
    b.add_argument("--lengths", type=int, nargs="+", default=None, help="default: 149 512 2048 8192")
    b.add_argument("--batches", type=int, nargs="+", default=None, help="default: 1 4 16")
    b.add_argument("--rhos", type=float, nargs="+", default=None, help="default: 0.2 0.3 0.5")
    b.add_argument("--selectors", nargs="+", default=None, help="default: rank suffix")
    b.add_argument("--max-tokens", type=int, default=None,
                   help="skip cells of more than T x batch tokens (default: 32768; listed as skipped)")
    b.add_argument("--max-layers", type=int, default=None, help="cut both models to N layers")
    b.add_argument("--repeats", type=int, default=None, help="timed repeats after one warm-up (default: 3; 1 with "
                                                              "--smoke)")
    b.add_argument("--compile", action="store_true", help="the target's layers through torch.compile")
    b.set_defaults(func=cmd_bench_gpu)


def gpu_device(args) -> str:
    return args.device or ("cpu" if args.smoke else "cuda")


def cmd_bench_gpu(args) -> int:
    import dataclasses

    import torch

    from ..bench.gpu import FULL, SMOKE, run
    from ..transfer.handoff import check_rho
    from ..transfer.selectors import SELECTORS

    grid = SMOKE if args.smoke else FULL
    repeats = args.repeats if args.repeats is not None else (1 if args.smoke else 3)
    picked = {"lengths": args.lengths, "batches": args.batches, "selectors": args.selectors,
              "rhos": args.rhos and [check_rho(r, "--rhos") for r in args.rhos], "max_tokens": args.max_tokens}
    grid = dataclasses.replace(grid, **{k: (tuple(v) if isinstance(v, list) else v) for k, v in picked.items()
                                        if v is not None})
    if bad := [s for s in grid.selectors if s not in SELECTORS]:
        raise RarecacheError(f"unknown selector {bad[0]!r}; known: {', '.join(SELECTORS)}")
    if any(n < 1 for n in (*grid.lengths, *grid.batches, repeats)):
        raise RarecacheError("--lengths, --batches and --repeats must be at least 1")
    device = gpu_device(args)
    if device.split(":")[0] == "cuda" and not torch.cuda.is_available():
        raise RarecacheError(f"--device {device}: this machine has no CUDA GPU (--smoke runs on the CPU)")
    print(f"bench gpu: {':'.join(grid.shapes)}, {args.dtype}, {device}, median of {repeats} after a warm-up; "
          f"speed-ups against the stronger of our prefill and transformers' (sdpa), same weights, same run",
          flush=True)
    command = "rarecache " + " ".join(sys.argv[1:]) if sys.argv[1:2] == ["bench"] else None

    def write(got: dict) -> dict:  # after every (T, batch): a run cut short keeps what it measured
        summary = {**{k: v for k, v in got.items() if k != "detail"}, "command": command}
        write_out(args.out / "handoff-summary.json", json.dumps(summary, indent=1) + "\n")
        write_out(args.out / "handoff-detail.json", json.dumps({**summary, "rows": got["detail"]}, indent=1) + "\n")
        return summary

    summary = write(run(grid, device, getattr(torch, args.dtype), repeats, args.compile, args.max_layers,
                        progress=lambda line: print(line, flush=True), write=write))
    for failure in summary["failures"]:
        print(f"recorded: {failure}", file=sys.stderr)
    print(f"summary written to {args.out / 'handoff-summary.json'} ({summary['device']})")
    return 0
