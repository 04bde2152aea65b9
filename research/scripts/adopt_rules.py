"""Issue #41 item 4: research/fidelity/ADOPTION.md's rules 2-4, checked in code on the adoption runs'
files (research/scripts/adopt_v4.sh, adopt_v4_rule4.sh), so the decision is the rule written before the runs
and not a reading of tables afterwards. Rule 1 (300 items, GSM8K 100) is the files' item counts; rule 5
(map + score <= 3% at T = 2048) is research/fidelity/bench/handoff-2048-*-v4b.txt; rule 6 is the bf16 file.

  python research/scripts/adopt_rules.py [DIR] > research/fidelity/adopt/rules.md
DIR: where the runs are (default research/fidelity/adopt, the committed copies; RUNS/adopt while running).
Every comparison is paired over the items (stories, for CoQA) on which every compared arm has a record; a
right/wrong or agree/disagree difference prints McNemar's exact p beside its bootstrap interval (10,000
resamples, rarecache.eval.significance.N_BOOT); arms are printed with their map's sha256 prefix (v4b[7145adb2]).
Rule 2b reads κ over the multiple-choice tasks only (MC_TASKS), as ADOPTION.md words it (note of 2026-12-07).
A later candidate against the map served then (v8 against v4 at suffix 0.3, research/scripts/fidelity_v8.sh):
  python research/scripts/adopt_rules.py RUNS/v8 --candidate v8 --served rho=0.3/suffix@v4b \
      --served-drift research/fidelity/adopt/drift-coqa-v4b-50.jsonl.gz
New selectors for the served map (rule 7: their arms join 4a's in the ranking; research/scripts/selectors_v4.sh):
  python research/scripts/adopt_rules.py RUNS/sel --served rho=0.3/suffix@v4b \
      --served-drift research/fidelity/adopt/drift-coqa-v4b-50.jsonl.gz \
      --extra-arms rho=0.3/attn-source@v4b rho=0.3/suffix+attn@v4b --drift RUNS/sel/drift-coqa-attn-v4-50.jsonl
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from rarecache.eval.answers import agrees, kappa
from rarecache.eval.significance import mcnemar, paired_diff_ci
from rarecache.eval.report import display, format_p
from rarecache.eval.results import load_results, map_shas
from rarecache.eval.summary import read_task

SERVED = "rho=0.2/suffix@v3"  # the served map as it was served (--served)
ARMS = ["rho=0.2/suffix@v4b", "rho=0.3/suffix@v4b", "rho=0.2/rank@v4b", "rho=0.3/rank@v4b"]  # rule 4a (--candidate)
ANSWER_TASKS = ["mmlu", "arc_challenge", "hellaswag", "gsm8k"]
MC_TASKS = ["mmlu", "arc_challenge", "hellaswag"]  # rule 2b: "on the multiple-choice tasks"
BPB_TASKS = ["coqa_passage"]
SHAS: dict[str, str] = {}  # map label -> sha256, from the records' meta files (arm labels carry its prefix)


def find(d: Path, stem: str) -> Path | None:
    for name in (f"{stem}.jsonl", f"{stem}.jsonl.gz"):
        if (d / name).is_file():
            return d / name
    return None


def agree(rows: list[dict], arm: str, metric: str) -> dict[str, float]:
    """Per item: 1 where `arm`'s answer is the target's own (eval/report.py's rule)."""
    return {i: float(same) for i, same in agrees(rows, arm, metric).items()}


def fmt(d: float, lo: float, hi: float, scale: float = 100.0, f: str = "{:+.1f}",
        exact: tuple[float, int, int] | None = None) -> str:
    """A paired difference with its interval, and McNemar's exact p where the outcomes are binary (`exact`)."""
    mc = f"; McNemar p {format_p(exact[0], floor=False)}" if exact is not None else ""
    return f"{f.format(scale * d)} ({f.format(scale * lo)}, {f.format(scale * hi)}{mc})"


def name(arm: str) -> str:
    """An arm as printed: its map label with the map file's sha256 prefix."""
    return display(arm, SHAS)


def coqa(files: list[tuple[Path | None, str]]) -> dict[str, dict[str, float]]:
    """Per arm: story -> mean bpb delta over the target's handed-off turns (drift.report's per-story means);
    `files`: (drift file, the label of the map it ran through)."""
    out: dict[str, dict[str, float]] = {}
    for path, label in files:
        rename = "@" + label
        if path is None:
            continue
        rows = load_results(path)
        alone = {(r["story"], r["turn"]): r["bpb"] for r in rows if r["arm"] == "alone" and r["model"] == "target"}
        per: dict[str, dict[str, list[float]]] = {}
        for r in rows:
            if r["arm"].startswith("switch/") and r["model"] == "target" and "handed_off" in r \
                    and (r["story"], r["turn"]) in alone:
                arm = "rho=" + r["arm"].removeprefix("switch/").replace(":", "/") + rename
                per.setdefault(arm, {}).setdefault(r["story"], []).append(r["bpb"] - alone[r["story"], r["turn"]])
        for arm, stories in per.items():
            out[arm] = {s: float(np.mean(v)) for s, v in stories.items()}
    return out


def main() -> None:
    global SERVED, ARMS
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir", nargs="?", type=Path, default=Path("research/fidelity/adopt"))
    ap.add_argument("--candidate", default="v4b", help="the candidate map's label in the files (default v4b)")
    ap.add_argument("--served", default=SERVED, help=f"the served map's arm in the files (default {SERVED})")
    ap.add_argument("--served-drift", type=Path, default=Path("research/gate/drift-coqa-v3-50.jsonl.gz"),
                    help="the served map's CoQA drift file (default v3's)")
    ap.add_argument("--extra-arms", nargs="+", default=[], metavar="ARM",
                    help="arms of other selectors that join 4a's in the ranking (rule 7)")
    ap.add_argument("--drift", nargs="+", type=Path, default=[], metavar="FILE",
                    help="more CoQA drift files through the candidate (the extra arms' stories)")
    args = ap.parse_args()
    d, SERVED = args.dir, args.served
    ARMS = [a.replace("@v4b", "@" + args.candidate) for a in ARMS] + args.extra_arms
    served_label = SERVED.rsplit("@", 1)[1]
    drifts = [(find(d, f"drift-coqa-{args.candidate}-50"), args.candidate), (args.served_drift, served_label)]
    drifts += [(f, args.candidate) for f in args.drift]
    print(f"# Adoption rules 2-4 on {d} (research/fidelity/ADOPTION.md)\n")
    print("Paired 95% bootstrap intervals over items (CoQA: stories), with McNemar's exact p on right/wrong and "
          "agree/disagree differences. Agreement: the share of items whose answer is the 1.5B's own (an exact tie "
          f"of choices agrees only with the same tie). Candidate {args.candidate}; the served map at its served "
          f"arm, {SERVED}; maps by sha256 at the end.\n")
    figures: dict[str, dict[str, float]] = {}  # task -> arm -> the figure rule 4 ranks by
    kappas: dict[str, dict[str, float]] = {}  # answer task -> arm -> Cohen's κ against the target (rule 2b)
    rule3: list[str] = []
    print(f"| task | n | arm | metric | agreement | Δ vs the 1.5B (CI) | arm − {SERVED}: metric (CI) | agreement (CI) |")
    print("|---|---|---|---|---|---|---|---|")
    for task in ANSWER_TASKS + BPB_TASKS:
        path = find(d, task)
        if path is None:
            print(f"| {task} | — | not run yet | | | | | |")
            continue
        t = read_task(path)
        bpb = t.metric == "bpb"
        scale, f = (1.0, "{:+.3f}") if bpb else (100.0, "{:+.1f}")
        arms = [a for a in ARMS if a in t.vals and a != SERVED]
        figures[task] = {}
        for arm in [SERVED] + arms:
            items = sorted(set(t.vals["target"]) & set(t.vals[SERVED]) & set(t.vals[arm]))
            a = [t.vals[arm][i] for i in items]
            dt = paired_diff_ci(a, [t.vals["target"][i] for i in items])
            SHAS.update({k: v for k, v in map_shas(path).items() if k not in SHAS})
            row = [task, str(len(items)), name(arm),
                   f"{scale * np.mean(a):.3f}" if bpb else f"{scale * np.mean(a):.1f}%"]
            if bpb:
                row.append("—")
                figures[task][arm] = dt[0]
            else:
                ag = agree(t.rows, arm, t.metric)
                row.append(f"{np.mean([ag[i] for i in items]):.1%}")
                figures[task][arm] = float(np.mean([ag[i] for i in items]))
                kappas.setdefault(task, {})[arm] = kappa(t.rows, arm, t.metric, set(items))
            target_vals = [t.vals["target"][i] for i in items]
            row.append(fmt(*dt[:3], scale=scale, f=f, exact=None if bpb else mcnemar(a, target_vals)))
            if arm == SERVED:
                row += ["—", "—"]
            else:
                served_vals = [t.vals[SERVED][i] for i in items]
                dv = paired_diff_ci(a, served_vals)
                row.append(fmt(*dv[:3], scale=scale, f=f, exact=None if bpb else mcnemar(a, served_vals)))
                if bpb:
                    row.append("—")
                    worse = dv[1] > 0  # rule 3 for bpb: the lower end must be below 0
                else:
                    ag3 = agree(t.rows, SERVED, t.metric)
                    mine, theirs = [ag[i] for i in items], [ag3[i] for i in items]
                    da = paired_diff_ci(mine, theirs)
                    row.append(fmt(*da[:3], exact=mcnemar(mine, theirs)))
                    worse = dv[2] < 0  # rule 3: the upper end must be above 0
                if worse:
                    rule3.append(f"{task} {arm}")
            print("| " + " | ".join(row) + " |")
    per_story = coqa(drifts)
    served_c = per_story.get(SERVED, {})
    if served_c:
        figures["coqa_bpb"] = {}
        for arm in [SERVED] + [a for a in ARMS if a in per_story and a != SERVED]:
            stories = sorted(set(per_story[arm]) & set(served_c))
            vals = [per_story[arm][s] for s in stories]
            m = float(np.mean(vals))
            figures["coqa_bpb"][arm] = m
            row = ["coqa_bpb", f"{len(stories)} stories", name(arm), "—", "—", f"{m:+.3f}"]
            if arm == SERVED:
                row += ["—", "—"]
            else:
                dv = paired_diff_ci(vals, [served_c[s] for s in stories])
                row += [fmt(*dv[:3], scale=1.0, f="{:+.3f}"), "—"]
                if dv[1] > 0:
                    rule3.append(f"coqa_bpb {arm}")
            print("| " + " | ".join(row) + " |")

    print("\n## Rule 4: the default arm (4b: mean rank over the tasks; answer tasks by agreement, bpb by Δ)\n")
    # 4a: GSM8K (the slowest task) joins the ranking only where every contender ran it
    contenders = [a for a in ARMS if all(a in figures[t] for t in figures if t != "gsm8k")]
    ranked = {t: f for t, f in figures.items() if all(a in f for a in contenders)}
    ranks: dict[str, list[float]] = {a: [] for a in contenders}
    print("| task | " + " | ".join(name(a) for a in contenders) + " |")
    print("|---" * (len(contenders) + 1) + "|")
    for task, figs in ranked.items():
        lower_better = task in BPB_TASKS or task == "coqa_bpb"
        vals = [figs[a] for a in contenders]
        order = [-v if not lower_better else v for v in vals]
        r = [1 + sum(o < x for o in order) + 0.5 * (sum(o == x for o in order) - 1) for x in order]
        for a, k in zip(contenders, r):
            ranks[a].append(k)
        cells = [f"{v:+.3f} ({k:g})" if lower_better else f"{v:.1%} ({k:g})" for v, k in zip(vals, r)]
        print(f"| {task} | " + " | ".join(cells) + " |")
    mean_rank = {a: float(np.mean(r)) for a, r in ranks.items()}
    print("| **mean rank** | " + " | ".join(f"**{mean_rank[a]:.2f}**" for a in contenders) + " |")
    rho = lambda a: float(a.split("/")[0].removeprefix("rho="))  # noqa: E731
    best = min(contenders, key=lambda a: (mean_rank[a], rho(a), "suffix" not in a)) if contenders else None
    print(f"\nTasks ranked: {', '.join(ranked)}; arms on every one of them: "
          f"{', '.join(name(a) for a in contenders) or 'none'}.")
    print(f"Default arm by rule 4: **{name(best)}**, picked after the fact on these records (the best mean rank "
          f"of {len(contenders)} arms): its figures in rules 2 and 3 below are read on the same records that "
          "picked it and lean its way" if best else "Rule 4: no arm ran on every task yet")

    print("\n## Rules 2 and 3\n")
    if best:
        have = [t for t in ANSWER_TASKS if t in figures and best in figures[t]]
        missing = [t for t in ANSWER_TASKS if t in figures and t not in have]
        if missing:
            print(f"{best} has not run on every answer task yet ({', '.join(missing)} missing): rules 2 and 3 "
                  "are not decided.")
        new = float(np.mean([figures[t][best] for t in have]))
        old = float(np.mean([figures[t][SERVED] for t in have]))
        print(f"Rule 2, mean agreement over {', '.join(have)}: {name(best)} {new:.1%} against the served arm "
              f"{old:.1%}: {'rises' if new > old else 'does NOT rise'}.")
        mc = [t for t in MC_TASKS if t in have]
        ks = [(kappas[t][best], kappas[t][SERVED]) for t in mc]
        if not ks or any(k is None for pair in ks for k in pair):
            print("Rule 2b: κ is undecided on a task (not run, no item, or one answer throughout).")
        else:
            new_k, old_k = (float(np.mean(col)) for col in zip(*ks))
            print(f"Rule 2b (candidates after v8), mean κ over the multiple-choice tasks ({', '.join(mc)}): "
                  f"{name(best)} {new_k:.3f} against the served arm {old_k:.3f}: "
                  f"{'does not fall' if new_k >= old_k else 'FALLS'}.")
    worse = [w for w in rule3 if best and w.endswith(best)]
    print(f"Rule 3, a task significantly worse than the served arm at the default arm: "
          f"{', '.join(worse) if worse else 'none'} (any arm: {', '.join(rule3) or 'none'}).")
    print(f"\nMaps: {', '.join(f'{k} sha256 {v[:12]}' for k, v in sorted(SHAS.items())) or 'no record'}.")


if __name__ == "__main__":
    main()
