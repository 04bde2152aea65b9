"""Which positions a selector recomputes on code_qa items, against where the answer is written (LOG 19).

The eval records say how many positions an arm recomputed, not which. On code_qa the served arm loses only
`function` items (the name of the function that does a described thing), so this asks, per item: of the
asked name's tokens in `settings.py` (`def NAME(`, or the constant's `NAME = value` line) and of the asked
function's body, what share did the handoff recompute? It runs the handoff the eval runs (the same prompt
tokens, map, selector and ρ) with one generated token, and joins each item to its committed record to split
the items the arm got right from the ones it lost.

    python research/scripts/code_qa_coverage.py --length 1024 --items 20 \
        --records research/fidelity/longctx/code_qa-1024.jsonl.gz --out research/fidelity/longctx/coverage-1024.jsonl
    python research/scripts/code_qa_coverage.py --summarise research/fidelity/longctx/coverage-1024.jsonl
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rarecache.defaults import SERVED
from rarecache.engine.generate import SamplingConfig
from rarecache.engine.llm import LLM
from rarecache.eval.results import load_results
from rarecache.eval.tasks import open_task
from rarecache.transfer.handoff import HandoffConfig
from rarecache.transfer.pipeline import Pipeline

S, T = "qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct"


def token_spans(target: LLM, messages: list[dict]) -> tuple[list[int], str, list[tuple[int, int]]]:
    """The prompt's ids, its text and each token's character span in it (the tokenizer's own offsets: one
    encode, where decoding every prefix would be quadratic)."""
    text = target.tokenizer.render_chat(messages)
    enc = target.tokenizer.tokenizer.encode(text, add_special_tokens=False)
    return list(enc.ids), text, list(enc.offsets)


def tokens_in(offsets: list[tuple[int, int]], lo: int, hi: int) -> set[int]:
    """Token indices whose text overlaps characters [lo, hi)."""
    return {i for i, (a, b) in enumerate(offsets) if a < hi and b > lo}


def spans(item, text: str) -> dict[str, tuple[int, int]]:
    """Character spans of the asked name, of the asked function's whole definition (or constant line), of all of
    settings.py and of the question."""
    name = item.gold[0]
    kind = item.extra["kind"]
    settings = text.index("### settings.py")
    whole = {"settings": (settings, text.index("\n### file_", settings)),
             "question": (text.rindex("Question: "), len(text))}
    if kind == "function":
        at = text.index(f"def {name}(", settings)
        end = text.find("\n\n\n", at)
        end = text.find("\n###", at) if end < 0 else end
        return {"name": (at + 4, at + 4 + len(name)), "definition": (at, end), **whole}
    line = next(ln for ln in text[settings:].split("\n") if ln.endswith((f"= {name}", f'= "{name}"')))
    at = text.index(line, settings)  # (the constant's line: its value is the answer)
    return {"name": (at + line.index("=") + 2, at + len(line)), "definition": (at, at + len(line)), **whole}


def recomputed_shares(pipe: Pipeline, messages: list[dict], where: dict[str, set[int]], selector: str,
                      rho: float) -> dict[str, float]:
    """Run the handoff the eval runs (one generated token) and return, per part of the prompt (`where`: its token
    indices), the share of its tokens either pass recomputed."""
    _, result = pipe.generate([messages], HandoffConfig(rho=rho, selector=selector), SamplingConfig(max_new_tokens=1))
    chosen = set(result.positions[0]) | set(result.first_pass[0] if result.first_pass else [])
    return {part: len(v & chosen) / max(len(v), 1) for part, v in where.items()}


def arm_label(rho: float, selector: str) -> str:
    """The arm's name in the committed eval records (through v4, labelled v4b)."""
    return f"rho={rho:g}/{selector}@v4b"


def summarise(path: Path) -> None:
    """Mean share recomputed per selector, item kind and outcome (lost: F1 below the target's)."""
    rows = [json.loads(line) for line in path.open()]
    parts = [k for k in ("name", "definition", "settings", "question") if f"{k}_tokens" in rows[0]]
    sels = [k for k in rows[0] if isinstance(rows[0][k], dict)]
    print(f"{path} ({len(rows)} items): share of each span's tokens recomputed")
    for sel in sels:
        for kind in ("constant", "function"):
            for lost in (True, False):
                g = [r for r in rows if r["kind"] == kind and r[sel]["lost"] == lost]
                if g:
                    means = "  ".join(f"{k} {sum(r[sel][k] for r in g) / len(g):.2f}" for k in parts)
                    print(f"  {sel:18s} {kind:9s} {'lost' if lost else 'kept':5s} n={len(g):2d}  {means}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--summarise", type=Path, help="print the table of a finished --out file and stop")
    p.add_argument("--length", type=int)
    p.add_argument("--items", type=int, default=20)
    p.add_argument("--selectors", nargs="+", default=[SERVED.selector, "query-w8"])
    p.add_argument("--rho", type=float, default=SERVED.rho)
    p.add_argument("--records", type=Path, help="the code_qa records of this length, to split right from lost")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    if args.summarise:
        return summarise(args.summarise)
    if args.length is None or args.out is None:
        p.error("--length and --out are required to run")

    source, target = LLM(S, dtype="auto"), LLM(T, dtype="auto")
    pipe = Pipeline(source, target, str(SERVED.path))
    task = open_task("code_qa", tokenizer=target.tokenizer, length=args.length)
    f1, prompt_tokens = {}, {}
    if args.records:
        for r in load_results(args.records):
            f1[(r["item"], r["arm"])] = float(r["f1"])
            prompt_tokens[r["item"]] = r.get("prompt_tokens")
    with args.out.open("w") as out:
        for item in task.items()[: args.items]:
            ids, text, offsets = token_spans(target, list(item.messages))
            if ids != source.encode(list(item.messages)):
                raise SystemExit(f"{item.id}: the prompt's tokens differ from the handoff's")
            where = {k: tokens_in(offsets, *v) for k, v in spans(item, text).items()}
            if prompt_tokens.get(item.id) not in (None, len(ids)):  # the records' prompt is this one
                raise SystemExit(f"{item.id}: {len(ids)} tokens here, {prompt_tokens[item.id]} in the records")
            row = {"item": item.id, "kind": item.extra["kind"], "gold": item.gold[0], "tokens": len(ids),
                   **{f"{k}_tokens": len(v) for k, v in where.items()}}
            for sel in args.selectors:
                arm = arm_label(args.rho, sel)
                row[sel] = recomputed_shares(pipe, list(item.messages), where, sel, args.rho)
                row[sel]["lost"] = (f1.get((item.id, arm)) is not None
                                    and f1[(item.id, arm)] < f1.get((item.id, "target"), 0.0))
            out.write(json.dumps(row) + "\n")
            out.flush()
            print(json.dumps(row))
    summarise(args.out)


if __name__ == "__main__":
    main()
