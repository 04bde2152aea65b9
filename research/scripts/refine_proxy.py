"""How close a selector's picks come to the multidoc QA oracle's, without generating (a proxy, a diagnostic).

The `attn-target` oracle (the 1.5B's own exact prefill's attention from its last 32 queries) keeps 88% of the
1.5B's multidoc answers at ρ 0.3 where the deployable arms keep 73-79% (research/fidelity/mdceil/mdceil.md).
Per item this runs the handoff's map once and asks, of each candidate's pick set at ρ 0.3 (every choosing pass
counted in the budget): what share of the oracle's attention mass over the content (positions 4 .. n-32, the
sinks and the question left out) does it recompute, how much of the oracle's own set does it hold, and what
share of the answer's tokens? Candidates:
- `span`: the served `attn-source-span`; `w8`, `w32`: two-pass `query-w8` / `query`;
- `staged-F` (w 8): a middle pass recomputes the top F of the pick budget (by pass 1's attention) and the window
  over the mapped cache, the window's attention is read again, the rest is picked from it; those rows stay
  (3w + picks = the budget);
- `exact-F` (w 8): the same middle pass on a copy, then the whole final set recomputed from the mapped cache
  (w + (w + m) + (w + k) = the budget, m = F·k: a smaller final set, but a direct sparse recompute);
- `w8+span`: `query-w8`'s order and the span's in turn;
- `-all`, `-low`, `-high` after `w8` / `w32`: pass 1's attention read over every layer, the lower or the upper
  half (the default: the top quarter).

    PYTHONPATH=. python research/scripts/refine_proxy.py --length 2048 --items 30 --out research/fidelity/refine/proxy-2048.jsonl
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from multidoc_coverage import S, T, item_parts

from rarecache.defaults import SERVED
from rarecache.engine.llm import LLM
from rarecache.engine.runner import AttnCapture
from rarecache.eval.tasks import open_task
from rarecache.transfer.choice import budget, in_turn, select_top, subset
from rarecache.transfer.handoff import HandoffConfig, map_and_score
from rarecache.transfer.pipeline import Pipeline
from rarecache.transfer.query import captured_layers, first_pass, newest, received_by
from rarecache.transfer.selectors import SELECTORS, SelectionContext

FRACTIONS = (0.25, 0.5)


def top_order(sel, att, positions, forced):
    return sel.order(att, positions, forced)[0]


@torch.inference_mode()
def candidates(pipe: Pipeline, ids: list[int], rho: float) -> tuple[dict[str, set[int]], torch.Tensor]:
    """Each candidate's recomputed set (final pass), and the oracle's attention (n,)."""
    src, tgt = pipe.source.runner, pipe.target.runner
    n = len(ids)
    K = budget(rho, n)
    m = map_and_score(src, tgt, pipe.mapper, [ids], HandoffConfig(rho, "attn-source-span"))
    ctx = SelectionContext(src, tgt, pipe.mapper, m.whole, m.positions, m.cache, None, m.source_attn)
    oracle = ctx.target_prefill()[1][0]  # (n,)
    out = {"oracle": set(select_top(oracle, K).tolist()),
           "span": set(select_top(SELECTORS["attn-source-span"].scores(ctx)[0], K).tolist())}
    pos = m.positions  # (1, n)
    layers = captured_layers(tgt, 0.25)

    def read(sel, w):
        window = newest(pos, [n], [w])
        cache = tgt.new_cache(1, n)
        cache.copy_prefix(m.cache, n)
        attn, valid = first_pass(tgt, cache, m.whole, window, layers)
        forced = torch.zeros_like(pos, dtype=torch.bool)
        forced[0, n - w:] = True
        return top_order(sel, received_by(sel, attn, valid, cache, pos), pos, forced), forced

    L = tgt.num_layers
    bands = {"": layers, "-all": frozenset(range(L)), "-low": frozenset(range(L // 2)),
             "-high": frozenset(range(L // 2, L))}
    for name, sel, w in (("w8", SELECTORS["query-w8"], 8), ("w32", SELECTORS["query"], 32)):
        window = newest(pos, [n], [w])
        cache = tgt.new_cache(1, n)
        cache.copy_prefix(m.cache, n)
        attn, valid = first_pass(tgt, cache, m.whole, window, frozenset(range(L)))
        forced = torch.zeros_like(pos, dtype=torch.bool)
        forced[0, n - w:] = True
        for band, ls in bands.items():
            att = received_by(sel, {i: attn[i] for i in ls}, valid, cache, pos)
            out[name + band] = set(select_top(top_order(sel, att, pos, forced), K - w).tolist())
    sel, w = SELECTORS["query-w8"], 8
    order1, forced = read(sel, w)
    out["w8+span"] = set(select_top(in_turn(order1[None], SELECTORS["attn-source-span"].scores(ctx), pos < 0)[0],
                                    K - w).tolist())

    def middle(first: list[int]) -> torch.Tensor:
        """Recompute `first` (ascending, the window last) on a copy of the mapped cache, read the window's
        attention again -> the order over positions."""
        cache = tgt.new_cache(1, n)
        cache.copy_prefix(m.cache, n)
        toks, p = subset(m.whole, [torch.tensor(first)])
        rows = torch.arange(len(first) - w, len(first))[None]  # (1, w): the window's queries
        attn = tgt.forward(toks, p, cache, logits_at=None, capture=AttnCapture(layers, rows)).attn
        valid = torch.ones(1, w, dtype=torch.bool)
        return top_order(sel, received_by(sel, attn, valid, cache, pos), pos, forced)

    win = list(range(n - w, n))
    ranked1 = [i for i in order1.argsort(descending=True).tolist() if i < n - w]
    for f in FRACTIONS:
        picks = K - 3 * w  # staged: 3w + picks = K
        s1 = sorted(ranked1[: int(f * picks)])
        order2 = middle(s1 + win)
        rest = [i for i in order2.argsort(descending=True).tolist() if i < n - w and i not in set(s1)]
        out[f"staged-{f:g}"] = set(s1) | set(rest[: picks - len(s1)]) | set(win)
        k = math.floor((K - 3 * w) / (1 + f))  # exact: w + (w + f·k) + (w + k) = K
        s1 = sorted(ranked1[: int(f * k)])
        order2 = middle(s1 + win)
        rest = [i for i in order2.argsort(descending=True).tolist() if i < n - w and i not in set(s1)]
        out[f"exact-{f:g}"] = set(s1) | set(rest[: k - len(s1)]) | set(win)
    return out, oracle.float()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--items", type=int, default=30)
    p.add_argument("--rho", type=float, default=SERVED.rho)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    source, target = LLM(S, dtype="auto"), LLM(T, dtype="auto")
    pipe = Pipeline(source, target, str(SERVED.path))
    task = open_task("multidoc_qa", tokenizer=target.tokenizer, length=args.length)
    questions = task._questions("eval")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    done = {json.loads(line)["item"] for line in args.out.open()} if args.out.exists() else set()
    with args.out.open("a") as out:
        for k, item in enumerate(task.items()[: args.items]):
            if item.id in done:
                continue
            ids, where = item_parts(target, item, questions[k])
            sets, oracle = candidates(pipe, ids, args.rho)
            n = len(ids)
            content = torch.zeros(n, dtype=torch.bool)
            content[4 : n - 32] = True
            mass = oracle * content
            row = {"item": item.id, "tokens": n}
            for name, s in sets.items():
                idx = torch.tensor(sorted(s))
                row[name] = {"size": len(s), "mass": float(mass[idx].sum() / mass.sum()),
                             "oracle_set": len(s & sets["oracle"]) / len(sets["oracle"]),
                             "answer": len(s & where["answer"]) / max(1, len(where["answer"])),
                             "gold": len(s & where["gold"]) / max(1, len(where["gold"]))}
            out.write(json.dumps(row) + "\n")
            out.flush()
            print(item.id, "  ".join(f"{k} {v['mass']:.2f}/{v['answer']:.2f}" for k, v in row.items()
                                    if isinstance(v, dict)), flush=True)
    rows = [json.loads(line) for line in args.out.open()]
    names = [k for k in rows[0] if isinstance(rows[0][k], dict)]
    print(f"{len(rows)} items, means: size, oracle's content mass, share of the oracle's set, answer, gold")
    for name in names:
        print(f"  {name:12s}" + "  ".join(f"{key} {sum(r[name][key] for r in rows) / len(rows):.3f}"
                                          for key in ("size", "mass", "oracle_set", "answer", "gold")))


if __name__ == "__main__":
    main()
