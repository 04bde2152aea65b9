"""What the recorded ladders say about one rule: recompute the request's own text, map only what it shares.

A task's prompts share a prefix (instruction, few-shot exemplars, chat markup); what follows it is the
item's own text. The rule reads, per item, the smallest `suffix` rung (newest positions first) that
recomputes everything after the shared prefix, up to a cap on ρ; an item whose own text does not fit under
the cap falls back to the target's own prefill (recomputed share 1.0). Every figure is read off the ladder
records (`eval run --arms target ladder:suffix@MAP`), as `eval gate report` reads a policy's outcome: the
rung's answer against the target's, paired 95% CI over items. The shared prefix is measured as the
evaluation's template is (`eval.scoring`): the common prefix with another prompt of the task.

    python research/scripts/gate_cover.py ~/.cache/rarecache/runs/eval/ridge-{mmlu,arc_challenge,hellaswag,gsm8k_bpb}.jsonl
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rarecache.eval.gate_report import read_ladders
from rarecache.eval.significance import paired_diff_ci
from rarecache.transfer.conversation import common_prefix
from rarecache.eval.tasks import open_task
from rarecache.models.store import resolve_model
from rarecache.models.tokenizer import Tokenizer


def encode(tok: Tokenizer, prompt) -> list[int]:
    return tok.encode_chat(prompt) if isinstance(prompt, list) else tok.encode(prompt)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", type=Path, nargs="+", help="results files with a target arm and a ladder:suffix arm")
    ap.add_argument("--arm", default=None, help="the ladder arm (default: the file's only one)")
    ap.add_argument("--caps", type=float, nargs="+", default=[0.2, 0.3], help="largest ρ accepted (default: 0.2 0.3)")
    ap.add_argument("--source", default="qwen2.5-coder-0.5b-instruct", help="the tokenizer the prompts were read with")
    args = ap.parse_args()
    tok = Tokenizer.from_dir(resolve_model(args.source))
    print("| file | n | own text, median share of the prompt | cap ρ | Δ vs target (95% CI) | fell back | "
          "recomputed (fallback = 1) | changed answers among accepted |")
    print("|---|---|---|---|---|---|---|---|")
    for path in args.files:
        lad = read_ladders(path, args.arm)
        if lad.selector != "suffix":
            raise SystemExit(f"{path}: the rule reads a suffix ladder, this one is {lad.selector}")
        task = open_task(lad.task, tokenizer=tok)
        prompts = {it.id: it.prompt for it in task.items()}
        ref = encode(tok, task.calibration_items()[0].prompt)  # another prompt of the task, as the evaluation
        ids = {i: encode(tok, prompts[i]) for i in lad.items}
        need = [len(ids[i]) - common_prefix(ids[i], ref) for i in lad.items]  # the item's own text and after
        shares = sorted(n / len(ids[i]) for n, i in zip(need, lad.items))
        for cap in args.caps:
            got, cost, fell, changed = [], [], 0, []
            for k, i in enumerate(lad.items):
                n = len(ids[i])
                rung = next((r for r, rho in enumerate(lad.rungs)
                             if rho <= cap + 1e-9 and lad.cost[k][r] * n >= need[k] - 1e-9), None)
                if rung is None:  # the own text does not fit under the cap: the target prefills it all
                    got.append(lad.target[k])
                    cost.append(1.0)
                    fell += 1
                else:
                    got.append(lad.value[k][rung])
                    cost.append(lad.cost[k][rung])
                    changed.append(lad.changed[k][rung])
            d, lo, hi = paired_diff_ci(got, lad.target)[:3]
            unit = "bpb" if lad.metric == "bpb" else "pp"
            scale = 1 if unit == "bpb" else 100
            fmt = "{:+.4f}" if unit == "bpb" else "{:+.1f}"
            delta = f"{fmt.format(d * scale)} ({fmt.format(lo * scale)}, {fmt.format(hi * scale)}) {unit}"
            ch = f"{sum(changed)} / {len(changed)}" if changed else "—"
            print(f"| {path.name} | {len(lad.items)} | {shares[len(shares) // 2]:.2f} | {cap:g} | {delta} | "
                  f"{fell / len(lad.items):.0%} | {sum(cost) / len(cost):.3f} | {ch} |")


if __name__ == "__main__":
    main()
