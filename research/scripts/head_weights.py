"""Can the 0.5B's attention, weighted per (layer, head), stand in for the 1.5B's exact attention? (a feasibility
proxy, no generation).

The multidoc QA oracle (`attn-target`: the 1.5B's own exact prefill's attention from its last 32 queries, top
quarter of layers, summed) keeps 88% of the 1.5B's answers at ρ 0.3; the served span reads the 0.5B's attention
from its last 32 queries summed over its top quarter of layers and every head (73%). A few heads do the copying
(arXiv 2404.15574), and which of the 0.5B's heads look where the 1.5B's look is a property of the pair, not of a
prompt: fit non-negative weights over the 0.5B's (layer, head) attention that best predict the oracle's score on
the long-context tasks' calibration items (disjoint from the evaluated ones by construction: their own split),
then ask, on evaluated multidoc items, how much of the oracle's set each pick set holds.

    PYTHONPATH=.:research/scripts python research/scripts/head_weights.py --fit 4 --items 30 \
        --out research/fidelity/refine/heads-2048.jsonl
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from multidoc_coverage import S, T, item_parts

from rarecache.defaults import SERVED
from rarecache.engine.llm import LLM
from rarecache.engine.runner import AttnCapture
from rarecache.eval.tasks import open_task
from rarecache.transfer.choice import budget, select_top
from rarecache.transfer.selectors import ATTN_QUERIES, SELECTORS, attention_capture, received

TASKS = ("retrieval", "multidoc_qa", "code_qa", "multiturn", "passage_qa_gen")
WINDOW = 32  # the question's own positions, left out of the fit (every arm recomputes them)


@torch.inference_mode()
def features(source: LLM, target: LLM, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The 0.5B's attention per (layer, head) from its last queries (G, n), and the oracle's score (n,)."""
    n = len(ids)
    tok, pos = torch.tensor([ids]), torch.arange(n)[None]
    rows = (torch.tensor([n])[:, None] + torch.arange(-ATTN_QUERIES, 0)).clamp(min=0)
    src = source.runner
    out = src.forward(tok, pos, src.new_cache(1, n), logits_at=None,
                      capture=AttnCapture(frozenset(range(src.num_layers)), rows))
    x = torch.cat([out.attn[layer][0].float().sum(1) for layer in sorted(out.attn)])  # (L·H, n)
    tgt = target.runner
    o = tgt.forward(tok, pos, tgt.new_cache(1, n), logits_at=None, capture=attention_capture(tgt, torch.tensor([n])))
    return x, received(o.attn, n)[0].float()


def fit(xs: list[torch.Tensor], ys: list[torch.Tensor], steps: int = 3000) -> torch.Tensor:
    """Non-negative w (G,) minimising Σ_items ‖(Xᵀw − y) / Σy‖² over content positions (projected gradient)."""
    X = torch.cat([x[:, 4:-WINDOW] / y[4:-WINDOW].sum() for x, y in zip(xs, ys)], 1)  # (G, N)
    Y = torch.cat([y[4:-WINDOW] / y[4:-WINDOW].sum() for y in ys])  # (N,)
    w = torch.full((X.shape[0],), 1.0 / X.shape[0])
    lr = 1.0 / torch.linalg.matrix_norm(X, 2).square()
    for _ in range(steps):
        w = (w - lr * (X @ (X.T @ w - Y))).clamp(min=0)
    r2 = 1 - (X.T @ w - Y).square().sum() / (Y - Y.mean()).square().sum()
    print(f"fit on {X.shape[1]} positions, {int((w > 0).sum())} of {len(w)} heads weighted, R² {r2:.3f}")
    return w


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--fit", type=int, default=4, help="calibration items per long-context task")
    p.add_argument("--items", type=int, default=30)
    p.add_argument("--rho", type=float, default=SERVED.rho)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    source, target = LLM(S, dtype="auto"), LLM(T, dtype="auto")
    xs, ys = [], []
    for name in TASKS:
        task = open_task(name, tokenizer=target.tokenizer, length=args.length)
        for item in task.calibration_items()[: args.fit]:
            x, y = features(source, target, source.encode(list(item.messages)))
            xs.append(x)
            ys.append(y)
        print(name, "fitted items", args.fit, flush=True)
    w = fit(xs, ys)
    H = source.runner.config.num_heads
    top = w.topk(8)
    print("top heads (layer, head, weight):", [(int(i) // H, int(i) % H, round(float(v), 3))
                                             for v, i in zip(top.values, top.indices)])
    task = open_task("multidoc_qa", tokenizer=target.tokenizer, length=args.length)
    questions = task._questions("eval")
    span_sel = SELECTORS["attn-source-span"]
    rows = []
    with args.out.open("w") as out:
        for k, item in enumerate(task.items()[: args.items]):
            ids, where = item_parts(target, item, questions[k])
            x, y = features(source, target, ids)
            n, K = len(ids), budget(args.rho, len(ids))
            pos = torch.arange(n)[None]
            L = source.runner.num_layers
            quarter = x.view(L, H, n)[L - max(1, L // 4):].sum((0, 1))  # the served arm's score
            weighted = w @ x
            sets = {"oracle": select_top(y, K), "span": select_top(span_sel.order(quarter[None, None], pos)[0], K),
                    "heads": select_top(weighted, K),
                    "heads-span": select_top(span_sel.order(weighted[None, None], pos)[0], K)}
            sets = {k2: set(v.tolist()) for k2, v in sets.items()}
            row = {"item": item.id}
            for name, s in sets.items():
                row[name] = {"oracle_set": len(s & sets["oracle"]) / K,
                             "answer": len(s & where["answer"]) / max(1, len(where["answer"])),
                             "gold": len(s & where["gold"]) / max(1, len(where["gold"]))}
            rows.append(row)
            out.write(json.dumps(row) + "\n")
            out.flush()
            print(item.id, "  ".join(f"{a} {v['oracle_set']:.2f}/{v['answer']:.2f}" for a, v in row.items()
                                    if isinstance(v, dict)), flush=True)
    for name in ("span", "heads", "heads-span"):
        print(f"  {name:10s}" + "  ".join(f"{key} {sum(r[name][key] for r in rows) / len(rows):.3f}"
                                        for key in ("oracle_set", "answer", "gold")))


if __name__ == "__main__":
    main()
