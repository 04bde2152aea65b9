"""Where does a handoff's time go, against the target's own prefill of the same prompt? (issue 55)

The real pair (0.5B -> 1.5B, the served map), one prompt of random tokens of length T: the target's
prefill, then the handoff at each ρ (the served suffix selector unless --selector), wall times as
`bench handoff` takes them (median of repeats after a warm-up), but on this thread's CPU clock
(`time.thread_time`, with one thread: a machine shared with other work slows the wall clock, not this)
unless --wall. Then one profiled run of each
(torch.profiler, CPU), its self time summed by phase (map, score and recompute of the handoff) and
by what the outermost op is: the linear layers' products, the attention kernel (and which SDPA
kernel ran), the KV-cache writes, copies, the rest (elementwise). A recomputed row should cost
about what a prefill row costs; the table says where it does not.

    OMP_NUM_THREADS=1 python research/scripts/profile_recompute.py --dtype float32 --length 1024 --rhos 0.3 1
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from rarecache.engine import attention
from rarecache.engine.runner import Runner
from rarecache.transfer import handoff as handoff_module
from rarecache.transfer.handoff import HandoffConfig, handoff
from rarecache.transfer.mapper import SIDES, Mapper

MODELS = Path.home() / ".cache/rarecache/models"
CATEGORIES = (  # (category, op-name test), the outermost op that passes one names its subtree
    ("attention", lambda n: "scaled_dot_product" in n or "flash_attention" in n),
    ("linear", lambda n: n in ("aten::linear", "aten::addmm", "aten::mm", "aten::matmul", "aten::bmm")
     or "_linear_pointwise" in n),
    ("cache write", lambda n: "index_put" in n),
    ("copy/cat", lambda n: n in ("aten::copy_", "aten::cat", "aten::to", "aten::_to_copy", "aten::contiguous",
                                 "aten::clone")),
)


def category(event) -> str:
    found, e = "other", event
    while e is not None:  # the outermost matching op wins
        for name, test in CATEGORIES:
            if test(e.name):
                found = name
        e = e.cpu_parent
    return found


def phase(event, default: str) -> str:
    e = event
    while e is not None:
        if e.name.startswith("phase:"):
            return e.name[len("phase:"):]
        e = e.cpu_parent
    return default


def breakdown(prof, default: str) -> tuple[dict, dict]:
    """Self CPU seconds by (phase, category), and the SDPA kernels that ran with their call counts."""
    by = defaultdict(float)
    kernels = defaultdict(int)
    for e in prof.events():
        if e.name.startswith("phase:"):
            continue
        by[(phase(e, default), category(e))] += e.self_cpu_time_total / 1e6
        if "attention" in e.name and e.name != "aten::scaled_dot_product_attention":
            kernels[e.name] += 1
    return dict(by), dict(kernels)


def labelled(fn, label):
    def run(*a, **k):
        with record_function(f"phase:{label}"):
            return fn(*a, **k)
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--rhos", type=float, nargs="+", default=[0.3, 1.0])
    ap.add_argument("--selector", default="suffix")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--pack", choices=["default", "on", "off"], default="default",
                    help="target weight prepacking: the Runner's default, forced on, or off")
    ap.add_argument("--map", default="rarecache/data/general-v4-64k.safetensors")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--blocks-apart", action="store_true",
                    help="also time each rho with the CPU's 32-query blocks never coalesced (the kernel before "
                         "issue 55: MERGE_SLACK -1)")
    ap.add_argument("--wall", action="store_true", help="time on the wall clock (default: this thread's CPU time)")
    args = ap.parse_args()
    clock = time.perf_counter if args.wall else time.thread_time
    handoff_module._now = lambda runner: clock()  # the handoff's phase timer, on the same clock
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    pack = {"default": None, "on": True, "off": False}[args.pack]
    source = Runner.load(MODELS / "qwen2.5-coder-0.5b-instruct", dtype=dtype)
    target = Runner.load(MODELS / "qwen2.5-coder-1.5b-instruct", dtype=dtype, pack=pack)
    mapper = Mapper.load(args.map)
    print(f"cpu {torch.backends.cpu.get_cpu_capability()}, {args.dtype}, threads {torch.get_num_threads()}, "
          f"target packed {target.packed}, scattered-query kernel {target.kernel}, T {args.length}, "
          f"selector {args.selector}, {'wall' if args.wall else 'thread CPU'} clock")
    T = args.length
    prompt = torch.randint(0, 10000, (1, T), generator=torch.Generator().manual_seed(0))
    src_cache, _ = source.prefill(prompt.tolist())
    for side in SIDES:
        mapper.tensors(side, mapper.dtype_for(target), target.device)
    pos = torch.arange(T)[None]

    def prefill():
        target.forward(prompt, pos, target.new_cache(1, T))

    def hand(rho):
        return handoff(source, target, mapper, prompt.tolist(), HandoffConfig(rho=rho, selector=args.selector),
                       source_cache=src_cache, source_kept=[T])[2].timings

    prefill()
    times = []
    for _ in range(args.repeats):
        t = clock()
        prefill()
        times.append(clock() - t)
    pre = statistics.median(times)
    print(f"prefill {pre:.2f} s ({pre / T * 1e3:.2f} ms per row)")
    slacks = [attention.MERGE_SLACK] + ([-1.0] if args.blocks_apart else [])
    for rho, slack in ((rho, slack) for rho in args.rhos for slack in (slacks if rho < 1 else slacks[:1])):
        attention.MERGE_SLACK = slack
        hand(rho)
        runs = [hand(rho) for _ in range(args.repeats)]
        med = {k: statistics.median(r[k] for r in runs) for k in ("map", "score", "recompute")}
        rows = max(1, round(rho * T))
        total = sum(med.values())
        print(f"rho {rho:g}{'' if slack == slacks[0] else ' (32-query blocks apart)'}: map {med['map']:.2f} s, score {med['score']:.3f} s, recompute {med['recompute']:.2f} s "
              f"({med['recompute'] / rows * 1e3:.2f} ms per row, {med['recompute'] / rows / (pre / T):.2f}x a prefill "
              f"row), handoff {total:.2f} s, speed-up {pre / total:.2f}x")
    attention.MERGE_SLACK = slacks[0]
    if args.no_profile:
        return
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        prefill()
    report("prefill", *breakdown(prof, "prefill"))
    forward, apply_scored = target.forward, Mapper.apply_scored
    target.forward = labelled(forward, "recompute")
    Mapper.apply_scored = labelled(apply_scored, "map")
    try:
        for rho in args.rhos:
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                hand(rho)
            report(f"handoff rho {rho:g}", *breakdown(prof, "score/other"))
    finally:
        target.forward, Mapper.apply_scored = forward, apply_scored


def report(title: str, by: dict, kernels: dict) -> None:
    print(f"== {title} (profiled, self CPU s)")
    for ph in sorted({p for p, _ in by}):
        cells = {c: s for (p, c), s in by.items() if p == ph}
        total = sum(cells.values())
        print(f"  {ph:<12} {total:7.2f}  " + "  ".join(f"{c} {s:.2f}" for c, s in sorted(cells.items(),
                                                                                       key=lambda x: -x[1])))
    print("  kernels: " + ", ".join(f"{k} x{n}" for k, n in sorted(kernels.items())))


if __name__ == "__main__":
    main()
