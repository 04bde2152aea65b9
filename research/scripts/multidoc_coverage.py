"""Which positions a selector recomputes on multidoc_qa items, against where the answer is read (a diagnostic).

HotpotQA's two gold paragraphs sit together at the item's depth among distractors, and no distractor holds the
answer string (rarecache/eval/tasks/documents.py). Per item: of the gold paragraphs' tokens, of the answer's own
tokens inside them, of the distractors' and of the question, what share did the handoff recompute? It runs the
handoff the eval runs (same prompt tokens, map, selector and ρ) with one generated token, and joins each item to
its committed record to split the items whose answer agreed with the 1.5B's from the ones that did not.

    python research/scripts/multidoc_coverage.py --length 2048 --items 100 \
        --records research/fidelity/longctx/multidoc_qa-2048.jsonl.gz --out research/fidelity/mdceil/coverage-2048.jsonl
    python research/scripts/multidoc_coverage.py --summarise research/fidelity/mdceil/coverage-2048.jsonl
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from code_qa_coverage import arm_label, recomputed_shares, token_spans, tokens_in

from rarecache.defaults import SERVED
from rarecache.engine.llm import LLM
from rarecache.eval.results import load_results
from rarecache.eval.tasks import open_task
from rarecache.transfer.pipeline import Pipeline

S, T = "qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct"
PARTS = ("gold", "answer", "distractors", "question")


def spans(text: str, gold: list[tuple[str, str]], answer: str) -> dict[str, list[tuple[int, int]]]:
    """Character spans of the gold documents, of the answer inside them, of every other document and of the
    question."""
    ask = text.rindex("\n\nQuestion: ")
    starts = [i for i in range(len(text)) if text.startswith("Document [", i) and (i == 0 or text[i - 2:i] == "\n\n")]
    docs = [(a, b) for a, b in zip(starts, [*starts[1:], ask])]
    bodies = {x for _, x in gold}
    is_gold = [any(text.find(x, a, b) >= 0 for x in bodies) for a, b in docs]
    if sum(is_gold) != len(gold):
        raise SystemExit(f"found {sum(is_gold)} gold documents, expected {len(gold)}")
    low, ans = text.lower(), answer.lower()  # the task finds the answer normalised, so case may differ here
    found = [(i, i + len(ans)) for a, b in (d for d, g in zip(docs, is_gold) if g)
             for i in range(a, b) if low.startswith(ans, i)]
    if not found:
        raise SystemExit(f"the answer {answer!r} is not in the gold documents as written")
    return {"gold": [d for d, g in zip(docs, is_gold) if g], "answer": found,
            "distractors": [d for d, g in zip(docs, is_gold) if not g], "question": [(ask, len(text))]}


def item_parts(target: LLM, item, question) -> tuple[list[int], dict[str, set[int]]]:
    """An item's prompt ids and the token indices of each of its parts (`spans`), `question` its HotpotQA
    question (the task's `_questions("eval")`, in item order)."""
    ids, text, offsets = token_spans(target, list(item.messages))
    parts = spans(text, list(question.gold), item.gold[0])
    return ids, {part: set().union(*(tokens_in(offsets, lo, hi) for lo, hi in v)) for part, v in parts.items()}


def summarise(path: Path) -> None:
    """Mean share recomputed per selector and outcome (agreed: the handoff's answer is the 1.5B's)."""
    rows = [json.loads(line) for line in path.open()]
    sels = [k for k in rows[0] if isinstance(rows[0][k], dict)]
    print(f"{path} ({len(rows)} items): share of each part's tokens recomputed")
    for sel in sels:
        for agreed in (True, False):
            g = [r for r in rows if r[sel].get("agreed") is agreed]
            if g:
                means = "  ".join(f"{k} {sum(r[sel][k] for r in g) / len(g):.2f}" for k in PARTS)
                print(f"  {sel:18s} {'agreed' if agreed else 'moved':6s} n={len(g):3d}  {means}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--summarise", type=Path, help="print the table of a finished --out file and stop")
    p.add_argument("--length", type=int)
    p.add_argument("--items", type=int, default=100)
    p.add_argument("--selectors", nargs="+", default=[SERVED.selector])
    p.add_argument("--rho", type=float, default=SERVED.rho)
    p.add_argument("--records", type=Path, help="the multidoc_qa records of this length, to split agreed from moved")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    if args.summarise:
        return summarise(args.summarise)
    if args.length is None or args.out is None:
        p.error("--length and --out are required to run")

    source, target = LLM(S, dtype="auto"), LLM(T, dtype="auto")
    pipe = Pipeline(source, target, str(SERVED.path))
    task = open_task("multidoc_qa", tokenizer=target.tokenizer, length=args.length)
    questions = task._questions("eval")  # the item's HotpotQA question: its gold paragraphs
    pred, prompt_tokens = {}, {}
    if args.records:
        for r in load_results(args.records):
            pred[(r["item"], r["arm"])] = r["prediction"]  # normalised as the records are
            prompt_tokens[r["item"]] = r.get("prompt_tokens")
    done = {json.loads(line)["item"] for line in args.out.open()} if args.out.exists() else set()
    with args.out.open("a") as out:
        for k, item in enumerate(task.items()[: args.items]):
            if item.id in done:
                continue
            ids, where = item_parts(target, item, questions[k])
            if ids != source.encode(list(item.messages)):
                raise SystemExit(f"{item.id}: the prompt's tokens differ from the handoff's")
            if prompt_tokens.get(item.id) not in (None, len(ids)):  # the records' prompt is this one
                raise SystemExit(f"{item.id}: {len(ids)} tokens here, {prompt_tokens[item.id]} in the records")
            row = {"item": item.id, "depth": item.extra["depth"], "tokens": len(ids),
                   **{f"{part}_tokens": len(v) for part, v in where.items()}}
            for sel in args.selectors:
                arm = arm_label(args.rho, sel)
                row[sel] = recomputed_shares(pipe, list(item.messages), where, sel, args.rho)
                if (item.id, arm) in pred and (item.id, "target") in pred:
                    row[sel]["agreed"] = pred[(item.id, arm)] == pred[(item.id, "target")]
            out.write(json.dumps(row) + "\n")
            out.flush()
            print(json.dumps(row))
    summarise(args.out)


if __name__ == "__main__":
    main()
