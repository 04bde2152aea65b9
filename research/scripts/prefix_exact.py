"""Issue #41 probe: how much of a 0-shot MMLU handoff's changed answers come from the mapped chat-template
prefix (system prompt and the task's fixed instruction), which a serving target holds exactly in its prefix
cache. For items START..START+N: the 1.5B's own answer; the served handoff (suffix at rho over the whole
prompt); and the same handoff with the first K positions taken from the 1.5B's own prefill (K = the system
turn, then K = the longest token prefix every item shares), the budget rho over the rest (and, `_same`, as many positions as the
plain handoff recomputes). Prints agreement
with the 1.5B and accuracy per arm; writes one JSON line per item to --out.
  python research/scripts/prefix_exact.py --map ~/.cache/rarecache/maps/general-v3-64k.safetensors --n 100 --out F
"""

import argparse
import json
import os
from types import SimpleNamespace

import torch

torch.set_num_threads(int(os.environ.get("THREADS", "1")))  # beside another run on 2 cores

from rarecache.commands.common import load_pair
from rarecache.eval.tasks import open_task
from rarecache.transfer.handoff import HandoffConfig, handoff


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--map", required=True)
    ap.add_argument("--task", default="mmlu")
    ap.add_argument("--start", type=int, default=0)
    ap.add_argument("--n", type=int, default=100)
    ap.add_argument("--rho", type=float, default=0.2)
    ap.add_argument("--selector", default="suffix")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    args = SimpleNamespace(source="qwen2.5-coder-0.5b-instruct", target="qwen2.5-coder-1.5b-instruct",
                           cache_dir=None, dtype=a.dtype, map=a.map)
    source, target, mapper, tok = load_pair(args)
    task = open_task(a.task, None, tok)
    items = task.items()[a.start: a.start + a.n]
    prompts = [tok.encode_chat(list(it.messages)) for it in items]
    system = len(tok.encode_chat([{"role": "system", "content": "You are Qwen, created by Alibaba Cloud. You are "
                                   "a helpful assistant."}], add_generation_prompt=False))
    assert all(p[:system] == prompts[0][:system] for p in prompts), "the system turn is not shared"
    common = min(next((i for i, (x, y) in enumerate(zip(p, prompts[0])) if x != y), len(p)) for p in prompts[1:])
    print(f"shared system turn {system} tokens, longest shared prefix {common}; "
          f"mean prompt {sum(map(len, prompts)) / len(prompts):.0f} tokens", flush=True)
    cfg = HandoffConfig.named(a.rho, a.selector)
    done = set()
    if os.path.exists(a.out):
        done = {json.loads(line)["id"] for line in open(a.out)}

    def answer(logits, cont_ids):  # logprob of each one-token continuation -> the pick
        lp = torch.log_softmax(logits.float(), -1)
        return int(max(range(len(cont_ids)), key=lambda j: lp[cont_ids[j]].item()))

    with open(a.out, "a") as f, torch.inference_mode():
        for it, ids in zip(items, prompts):
            if it.id in done:
                continue
            conts = [tok.encode(c, add_special_tokens=False) for c in it.continuations]
            assert all(len(c) == 1 for c in conts)
            conts = [c[0] for c in conts]
            n = len(ids)
            row = {"id": it.id, "gold": it.gold, "n": n}
            cache = target.new_cache(1, n)
            lg = target.forward(torch.tensor([ids]), torch.arange(n)[None], cache).logits
            row["target"] = answer(lg[0, -1] if lg.dim() == 3 else lg[0], conts)
            for name, k, same in (("handoff", 0, False), ("exact_system", system, False),
                                  ("exact_shared", common, False), ("exact_shared_same", common, True)):
                # same: as many positions recomputed as the plain handoff (rho scaled to the shorter span)
                c = HandoffConfig.named(min(1.0, a.rho * n / (n - k)), a.selector) if same else cfg
                tc = target.new_cache(1, n)
                if k:
                    target.forward(torch.tensor([ids[:k]]), torch.arange(k)[None], tc, logits_at=None)
                _, logits, res = handoff(source, target, mapper, [ids], c, target_cache=tc if k else None,
                                         target_kept=[k] if k else None)
                row[name] = answer(logits[0], conts)
                row[name + "_recomputed"] = len(res.positions[0])
            f.write(json.dumps(row) + "\n")
            f.flush()
    rows = [json.loads(line) for line in open(a.out)]
    for name in ("target", "handoff", "exact_system", "exact_shared", "exact_shared_same"):
        agree = sum(r[name] == r["target"] for r in rows) / len(rows)
        acc = sum(r[name] == r["gold"] for r in rows) / len(rows)
        rec = sum(r.get(name + "_recomputed", r["n"]) for r in rows) / sum(r["n"] for r in rows)
        print(f"{name:14s} accuracy {acc:.1%} agreement {agree:.1%} recomputed share of prompt {rec:.3f}")


if __name__ == "__main__":
    main()
