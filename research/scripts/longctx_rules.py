"""ADOPTION.md rules 8 and 9 read from long-context result files (written before their runs).

Rule 8: rank the query-aware variants on each screened task by agreement with the target's own greedy answer
(ties by the gold score), then by mean rank over the tasks; the two best go on. Rule 9: the same ranking over
the served arm and rule 8's two across the five tasks, with guard (a): no task's gold score below the 0.5B
alone (paired 95% interval entirely below 0). Guards (b) (the short tasks, McNemar) and (c) (the bench) are
read from their own records: `--short FILE...` reads (b) (agreement with the target on each short task
against the served arm's, exact McNemar on the items where exactly one of the two agrees).

    python research/scripts/longctx_rules.py 8 RESULTS.jsonl[.gz] ...
    python research/scripts/longctx_rules.py 9 RESULTS.jsonl[.gz] ... --served rho=0.3/suffix@v4b \
        --short research/fidelity/f32head/mmlu.jsonl.gz

Only arms present on every item of every file are ranked, on the items where the target, the source and every
ranked arm (`--arms`, else every arm in the file) answered; n is printed per task.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rarecache.eval.answers import agrees
from rarecache.eval.report import summarise
from rarecache.eval.results import load_results
from rarecache.eval.significance import mcnemar_exact, paired_diff_ci
from rarecache.eval.tasks import TASKS

FIXED = ("target", "source")


def task_rows(path: Path) -> tuple[str, list[dict]]:
    rows = load_results(path)
    task = rows[0]["task"]
    length = rows[0].get("length")
    return f"{task}@{length}" if length else task, rows


def complete_items(rows: list[dict]) -> set:
    """Items every arm of the file answered (a run cut mid-item leaves some arms short)."""
    arms = {r["arm"] for r in rows}
    by_item: dict = {}
    for r in rows:
        by_item.setdefault(r["item"], set()).add(r["arm"])
    return {i for i, a in by_item.items() if a == arms}


def ranks(values: dict[str, tuple[float, float]]) -> dict[str, float]:
    """Rank 1 = best by (agreement, gold score), higher better; ties share the mean rank (adopt_rules.py's 4b)."""
    v = list(values.values())
    return {a: 1 + sum(o > x for o in v) + 0.5 * (sum(o == x for o in v) - 1) for a, x in values.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("rule", choices=["8", "9"])
    p.add_argument("files", nargs="+", type=Path)
    p.add_argument("--served", default="rho=0.3/suffix@v4b", help="the served arm's name in the files")
    p.add_argument("--short", nargs="*", type=Path, default=[],
                   help="rule 9 guard (b): short-task result files holding the served arm and the candidates")
    p.add_argument("--arms", nargs="*", help="rule 9: the arms to rank (default: every handoff arm in all files)")
    args = p.parse_args()

    tables = {}
    for path in args.files:
        name, rows = task_rows(path)
        if args.arms:  # an arm run on fewer items than the ranked ones must not shrink their n
            rows = [r for r in rows if r["arm"] in {*FIXED, *args.arms}]
        keep = complete_items(rows)
        rows = [r for r in rows if r["item"] in keep]
        metric = TASKS[rows[0]["task"]].metric
        tables[name] = (metric, rows, {s["arm"]: s for s in summarise(rows, metric, 0.0)})
    common = set.intersection(*(set(t[2]) for t in tables.values())) - set(FIXED)
    arms = sorted(a for a in common if not args.arms or a in args.arms)
    if args.rule == "8":
        arms = [a for a in arms if a != args.served]
    print(f"rule {args.rule}: {len(arms)} arms over {len(tables)} tasks")
    per_task = {}
    for name, (metric, rows, summ) in tables.items():
        vals = {a: (summ[a]["agreement"], summ[a]["mean"]) for a in arms}
        per_task[name] = ranks(vals)
        print(f"\n{name} (n={summ['target']['n']}, {metric}; target {summ['target']['mean']:.3f}, "
              f"source {summ['source']['mean']:.3f}, source agreement {summ['source']['agreement']:.1%})")
        for a in sorted(arms, key=lambda a: per_task[name][a]):
            print(f"  rank {per_task[name][a]:4.1f}  {a:38s} agreement {vals[a][0]:6.1%}  {metric} {vals[a][1]:.3f}")
    mean = {a: sum(per_task[t][a] for t in per_task) / len(per_task) for a in arms}
    print("\nmean rank over tasks (lower is better):")
    for a in sorted(arms, key=lambda a: mean[a]):
        print(f"  {mean[a]:5.2f}  {a}")
    if args.rule == "8":
        print(f"\nrule 8 picks (ties by fewer pass-1 positions, then simpler; read by hand): "
              f"{', '.join(sorted(arms, key=lambda a: mean[a])[:2])}")
        return
    print("\nguard (a): gold score against the 0.5B alone, paired 95% interval (a fails if hi < 0)")
    for name, (metric, rows, _) in tables.items():
        src = {r["item"]: float(r[metric]) for r in rows if r["arm"] == "source"}
        for a in arms:
            mine = {r["item"]: float(r[metric]) for r in rows if r["arm"] == a}
            items = sorted(src.keys() & mine.keys())
            d, lo, hi, _ = paired_diff_ci([mine[i] for i in items], [src[i] for i in items])
            flag = "FAILS" if hi < 0 else "holds"
            print(f"  {name:22s} {a:38s} {d:+.3f} ({lo:+.3f}, {hi:+.3f}) {flag}")
    if args.short:
        print("\nguard (b): agreement with the target against the served arm's (b fails if lower with McNemar p < 0.05)")
    for path in args.short:
        rows = load_results(path)
        metric = TASKS[rows[0]["task"]].metric
        served = agrees(rows, args.served, metric)
        for a in (a for a in arms if a != args.served):
            if not any(r["arm"] == a for r in rows):
                print(f"  {rows[0]['task']:22s} {a:38s} not run")
                continue
            mine = agrees(rows, a, metric)
            items = sorted(served.keys() & mine.keys())
            gained = sum(mine[i] and not served[i] for i in items)
            lost = sum(served[i] and not mine[i] for i in items)
            p_value = mcnemar_exact(gained, lost)
            rate = sum(mine[i] for i in items) / len(items)
            base = sum(served[i] for i in items) / len(items)
            flag = "FAILS" if rate < base and p_value < 0.05 else "holds"
            print(f"  {rows[0]['task']:22s} {a:38s} {rate:.1%} against {base:.1%} (n={len(items)}, +{gained} / "
                  f"-{lost}, McNemar p {p_value:.2g}) {flag}")
    print(f"\nrule 9's default by mean rank (if guards (a)-(c) hold): {min(arms, key=lambda a: mean[a])}")


if __name__ == "__main__":
    main()
