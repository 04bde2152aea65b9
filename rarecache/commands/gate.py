"""`rarecache eval gate fit` (a gate policy from held-apart ladders) and `rarecache eval gate report`
(what a policy does on evaluated ladders; writes the summary file)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ..errors import RarecacheError
from ..registry import COQA_BPB

SIGNALS = ("js", "js_views", "nll")  # gate.policy.SIGNALS (tested equal), named here so --help imports no torch


def register(ev) -> None:
    p = ev.add_parser("gate", help="the quality gate: fit a policy on held-apart items, report it on evaluated ones",
                      description="Runs on results files that hold the target arm and a ladder arm "
                                  "(`eval run --arms target ladder:SELECTOR ...`): every rung of the gate's budget "
                                  "ladder with its signal and answer. The policy's decisions are read off the "
                                  "record (the online gate is tested equal to it); a fallback answers with the "
                                  "target's own prefill.")
    g = p.add_subparsers(dest="gate", required=True, metavar="ACTION")
    f = g.add_parser("fit", help="fit a gate policy on held-apart results files (one per task)")
    f.add_argument("results", type=Path, nargs="+",
                   help="results JSONL (or .jsonl.gz) of held-apart items, one per task")
    f.add_argument("--max-changed", type=float, default=0.01,
                   help="multiple-choice tasks: most changed answers (share of items) the gate may accept "
                        "(default: 0.01)")
    f.add_argument("--max-bpb", type=float, default=0.0025,
                   help="bits-per-byte tasks: most mean bpb increase the gate may accept (default: 0.0025)")
    f.add_argument("--loss", choices=("changed", "accuracy"), default="changed",
                   help="multiple-choice tasks: what --max-changed bounds: the share of changed answers "
                        "(default), or the mean accuracy lost against the target (a change between two wrong "
                        "answers costs nothing; right to wrong and wrong to right offset)")
    f.add_argument("--arm", default=None, help="the ladder arm, if a file has several (e.g. ladder/rank@general)")
    f.add_argument("--signal", choices=SIGNALS, default="js",
                   help="what the policy thresholds: js, the divergence of each rung from the one below "
                        "(default), or js_views, of each rung from the same rung with the rows still mapped "
                        "taken from the map's plain-transfer view (maps with one; recorded by ladders since "
                        "2026-12-04), or nll, the target's surprisal (bits per token) at the prompt's own tokens "
                        "each rung recomputed (recorded by ladders since 2026-12-05)")
    f.add_argument("--out", type=Path, required=True, help="policy file to write (JSON)")
    f.set_defaults(func=cmd_gate_fit)
    r = g.add_parser("report", help="what a policy does on evaluated results files")
    r.add_argument("results", type=Path, nargs="+",
                   help="results JSONL (or .jsonl.gz) of evaluated items, one per task")
    r.add_argument("--policy", type=Path, required=True, help="policy file from `eval gate fit`")
    r.add_argument("--arm", default=None, help="the ladder arm, if a file has several")
    r.add_argument("--summary", type=Path, default=None,
                   help="write the summary JSON here (e.g. docs/artifacts/gate-summary.json)")
    r.add_argument("--drift", type=Path, default=None,
                   help="an `eval drift run` file whose gate arm ran with this policy: adds CoQA (coqa_bpb, "
                        "Δ over stories against the target alone)")
    r.set_defaults(func=cmd_gate_report)


def _ladders(paths: list[Path], arm: str | None, loss: str = "changed", signal: str = "js"):
    from ..eval.gate_report import read_ladders

    return [read_ladders(p, arm, loss, signal) for p in paths]


def cmd_gate_fit(args) -> int:
    from ..eval.gate_report import fit

    if not 0 <= args.max_changed <= 1 or args.max_bpb < 0:
        raise RarecacheError("--max-changed must be in [0, 1] and --max-bpb >= 0")
    policy = fit(_ladders(args.results, args.arm, args.loss, args.signal), args.max_changed, args.max_bpb)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(policy.to_json())
    floor = "" if policy.min_margin is None else f", top-2 margin >= {policy.min_margin:.3g} nats"
    most = "" if policy.max_rungs is None else f", at most {policy.max_rungs} rung(s) before falling back"
    most += "" if not policy.first_rung else f", starting at rho {policy.rungs[policy.first_rung]:g}"
    does = "always falls back" if policy.always_falls_back else "accepts"
    print(f"{policy.signal} threshold {policy.threshold:.4g} bits{floor}{most} ({does})")
    ci = lambda a, c: f"{a:.3f} ({c[0]:.3f}-{c[1]:.3f})"  # noqa: E731
    for task, o in policy.fitted["tasks"].items():
        print(f"  {task}: n={o['n']} loss {o['loss']:.4f} mean recomputed {o['cost']:.3f} (fallback = 1; with the "
              f"rungs climbed first {o['work']:.3f}) fell back {o['fallback']:.1%} "
              f"signal AUC {ci(o['auc'], o['auc_ci'])}")
    pooled = policy.fitted["auc_pooled"]
    print(f"  signal AUC over every task's (item, rung) pairs: {ci(pooled['auc'], pooled['ci'])} "
          "(95% CI: items resampled within each task)")
    print("each recorded signal's AUC for a changed answer, pooled over tasks (every rung; then within each rung, "
          "where a signal must separate requests of the same budget):")
    table = policy.fitted["signals"]
    cell = lambda c: "-" if c["auc"] is None else ci(c["auc"], c["ci"])  # noqa: E731
    some = next(iter(table["pooled"]), None)
    if some is not None:
        print("  changed answers: " + "  ".join(f"rho {rho}: {r[some]['changed']} of {r[some]['n']}"
                                                for rho, r in table["rungs"].items()))
    for name, c in table["pooled"].items():
        per = "  ".join(f"{rho}: {cell(r[name])}" for rho, r in table["rungs"].items())
        print(f"  {name}: {cell(c)}  [{per}]")
    what = "changed" if args.loss == "changed" else "accuracy lost"
    print("other loss levels stored (serve --rho auto --max-loss SHARE):")
    for lv in policy.fitted["levels"]:
        cost = sum(t["cost"] for t in lv["tasks"].values()) / len(lv["tasks"])
        fell = sum(t["fallback"] for t in lv["tasks"].values()) / len(lv["tasks"])
        print(f"  <= {lv['max_changed']:g} {what}, <= {lv['max_bpb']:g} bpb: threshold {lv['threshold']:.4g}, "
              f"max rungs {'all' if lv['max_rungs'] is None else lv['max_rungs']}, "
              f"mean recomputed {cost:.3f}, fell back {fell:.1%}")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


def cmd_gate_report(args) -> int:
    from ..eval.gate_report import evaluate, markdown
    from ..transfer.gate.policy import GatePolicy, gate_rule

    if not args.policy.is_file():
        raise RarecacheError(f"no policy file {args.policy}")
    policy = GatePolicy.load(args.policy)
    ladders = _ladders(args.results, args.arm, signal=policy.signal)
    results = {lad.task: evaluate(lad, policy) for lad in ladders}
    shas = {lad.map_sha256 for lad in ladders}
    if len(shas) > 1:
        raise RarecacheError(f"the results files went through different maps: {shas}")
    if args.drift is not None:
        from ..eval.drift import gate_figures

        results[COQA_BPB] = gate_figures(args.drift, policy, next(iter(shas)))
    print(markdown(results, policy))
    if args.summary:
        keys = ("unit", "delta", "ci", "n", "fallback_share", "mean_recomputed_share", "expected_speedup")
        summary = {"map": shas.pop(), "policy": {**gate_rule(policy), "loss": policy.fitted.get("loss", "changed")},
                   "tasks": {t: {k: r[k] for k in keys} | {"auc": r["auc"], "auc_ci": r["auc_ci"]}
                             | {"agreement": r.get("agreement"), "signals": r.get("signals")}
                             for t, r in results.items()},
                   "held_auc": policy.fitted.get("auc_pooled"),  # the signal on the items it was fitted on
                   "held_signals": policy.fitted.get("signals")}  # every recorded signal's, there
        args.summary.parent.mkdir(parents=True, exist_ok=True)
        args.summary.write_text(json.dumps(summary, indent=1) + "\n")
        print(f"wrote {args.summary}", file=sys.stderr)
    return 0
