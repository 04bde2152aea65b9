"""The fidelity probe: how far a handoff moves the target's own next-token distributions, in minutes.

Task runs take hours on this machine; a map design needs an answer sooner. The probe hands off a fixed
set of prompts (`build_set`: passages with a question, 0-shot multiple choice, few-shot chains, multi-turn
chat) through each map and arm, appends a reference answer, and measures at every answer position the KL
divergence in bits from the target's distribution over its own cache to its distribution over the
handoff's cache (the target's own is the reference: KL(own ‖ handoff)), how often the top token is the
same, and per layer the attention-output cosine of the target's own queries over the two caches
(`transfer.diagnostics.attention_cosines`; the mapping paper finds that cosine predicts retention where R²
does not). A map is only worth a task run if it lowers these; whether the probe's ranking of maps predicts
their task agreement is measured, not assumed.

The prompts come from the benchmark data `eval/data.py` reads, from the tail of each task's evaluation
list: past the first EVALUATED items (stories) that every evaluation reads from, and disjoint from the
task's calibration pool, both checked in code (`check_probe_items`). The general mix is disjoint from every
evaluation item by construction (`eval/mix.py`), so from these too.

One JSON line per (prompt, map, arm) in `--out`, a prompt's lines written together: a killed run resumes
at the next prompt and ends with the same file. `<out>.summary.json` holds the means per map and arm,
overall and per category.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import RarecacheError
from ..registry import ARC_CHALLENGE, COQA_BPB, COQA_PASSAGE, GSM8K_BPB, MMLU
from .arms import Arm
from .report import arm_name
from .tasks.multiple_choice import QUESTION

EVALUATED = 300  # every evaluation reads a task's first items (stories): acceptance runs take n <= 300
PLAN = (("passage", 8), (MMLU, 6), ("arc", 6), ("chain", 4), ("chat", 8))  # category, prompts: 32 in all
CHAT_TURN = 4  # the chat prompts switch at this turn of a CoQA conversation (or the story's last)
MAX_ANSWER = 32  # reference-answer tokens measured at most (a GSM8K solution runs to ~100)
ARC_INSTRUCTION = "Answer the question with the text of the correct answer.\n\n"
SOURCES = {"passage": COQA_PASSAGE, MMLU: MMLU, "arc": ARC_CHALLENGE, "chain": GSM8K_BPB,
           "chat": COQA_BPB}  # the task each category is drawn from


@dataclass(frozen=True)
class ProbePrompt:
    id: str
    category: str
    messages: tuple[dict[str, str], ...]  # the chat prompt, ending in a user turn
    reference: str  # the answer appended after the assistant header


def check_probe_items(task, picked: list, index: list[int], key=lambda item: item.id) -> None:
    """Refuse probe items inside the evaluated range (`index`: their places in the evaluation list, or
    their stories' places) or sharing a key (`key`: the id, or a CoQA story) with the calibration pool."""
    inside = [i for i in index if i < EVALUATED]
    if inside:
        raise RarecacheError(f"probe: {task.name} has too few items: its probe items would start at {min(inside)}, "
                             f"inside the first {EVALUATED} that evaluations read")
    pool = {key(i) for i in task.calibration_items()}
    shared = sorted(key(i) for i in picked if key(i) in pool)
    if shared:
        raise RarecacheError(f"probe: {task.name} item(s) {', '.join(shared[:3])} are in its calibration pool")


def _tail(task, k: int) -> list:
    items = task.items()
    picked = items[len(items) - k:]
    check_probe_items(task, picked, list(range(len(items) - k, len(items))))
    return picked


def _subjects(task, k: int) -> list:
    """MMLU: the last test item of each of k subjects spread over the subject list (the list's own tail
    is one subject's: it interleaves subjects round robin, and the largest runs longest)."""
    items = task.items()
    last: dict[str, int] = {}
    for index, item in enumerate(items):
        last[item.extra["subject"]] = index
    names = sorted(last)
    index = [last[names[(2 * j + 1) * len(names) // (2 * k)]] for j in range(min(k, len(names)))]
    picked = [items[i] for i in index]
    check_probe_items(task, picked, index)
    return picked


def _stories(task) -> list[list]:
    """A CoQA task's items grouped by story, in story order."""
    stories: dict[str, list] = {}
    for item in task.items():
        stories.setdefault(item.extra["story"], []).append(item)
    return list(stories.values())


def build_set(tasks: dict[str, object]) -> list[ProbePrompt]:
    """The probe's prompts from `tasks` (SOURCES' task names -> Task objects), PLAN's counts per category."""
    count = dict(PLAN)
    out: list[ProbePrompt] = []
    for item in _tail(tasks[COQA_PASSAGE], count["passage"]):
        out.append(ProbePrompt(f"passage-{item.id}", "passage", item.messages, item.continuations[0]))
    for item in _subjects(tasks[MMLU], count[MMLU]):
        out.append(ProbePrompt(f"{MMLU}-{item.id}", MMLU, item.messages, item.continuations[item.gold]))
    for item in _tail(tasks[ARC_CHALLENGE], count["arc"]):  # 0-shot: the question alone, no exemplars
        messages = ({"role": "user", "content": ARC_INSTRUCTION + item.extra[QUESTION]},)
        out.append(ProbePrompt(f"arc-{item.id}", "arc", messages, item.continuations[item.gold]))
    for item in _tail(tasks[GSM8K_BPB], count["chain"]):
        out.append(ProbePrompt(f"chain-{item.id}", "chain", item.messages, item.continuations[0]))
    chat = tasks[COQA_BPB]
    stories = _stories(chat)
    # stories before the passage prompts' (those are the last of the same story list)
    first = len(stories) - count["passage"] - count["chat"]
    picked = [s[min(CHAT_TURN, len(s)) - 1] for s in stories[first: first + count["chat"]]]
    check_probe_items(chat, picked, list(range(first, first + len(picked))), key=lambda i: i.extra["story"])
    out += [ProbePrompt(f"chat-{i.id}", "chat", i.messages, i.continuations[0]) for i in picked]
    if len({p.id for p in out}) < len(out):
        raise RarecacheError("probe: two prompts share an id")
    return out


def set_digest(prompts: list[ProbePrompt]) -> str:
    """What identifies the prompt set in the run record (a resumed run must probe the same prompts)."""
    text = json.dumps([[p.id, p.category, list(p.messages), p.reference] for p in prompts])
    return hashlib.sha256(text.encode()).hexdigest()


def _answer_logprobs(target, cache, first: torch.Tensor, n: int, answer: list[int]) -> torch.Tensor:
    """Log-probabilities (A, m, V) at each answer position: from the last prompt position's logits
    `first` (A, V), then the answer's own tokens run over each row of `cache` (its prompt rows end at n)."""
    parts = [first.float().log_softmax(-1)[:, None]]
    if len(answer) > 1:
        A = first.shape[0]
        toks = torch.tensor([answer[:-1]], device=target.device).expand(A, -1)  # the last token is only predicted
        pos = torch.arange(n, n + len(answer) - 1)[None].expand(A, -1)
        parts.append(target.forward(toks, pos, cache, logits_at="all").logits.float().log_softmax(-1))
    return torch.cat(parts, 1)


@torch.inference_mode()
def probe_prompt(source, target, maps: dict, variants: list[tuple[str, Arm]], ids: list[int], answer: list[int]
                 ) -> list[dict]:
    """Every (map label, arm) of `variants` on one prompt `ids` with reference answer `answer` (token ids,
    cut to MAX_ANSWER): KL in bits from the target's own distribution, top-1 agreement and per-layer
    attention-output cosine at the answer positions. Runners, not LLMs; `maps` by label."""
    from ..transfer.diagnostics import attention_cosines
    from ..transfer.handoff import handoff_variants
    from ..transfer.selectors import forward_received

    answer = answer[:MAX_ANSWER]
    n, m = len(ids), len(answer)
    if m == 0:
        raise RarecacheError("probe: a reference answer has no tokens")
    prompt = torch.tensor([ids], device=target.device)
    ends = torch.tensor([n], device=target.device)
    own = target.new_cache(1, n + m)
    out, own_attn = forward_received(target, prompt, torch.arange(n)[None], own, ends, n)
    target_prefill = (own, own_attn)  # the oracles' reference (they read rows before n only)
    src = source.new_cache(1, n)
    _, src_attn = forward_received(source, prompt, torch.arange(n)[None], src, ends, n, logits_at=None)
    cache, first, _ = handoff_variants(source, target, maps, ids, [(label, arm.config) for label, arm in variants],
                                       src, source_attn=src_attn, target_prefill=target_prefill)
    cache = cache.grown(n + m)
    mine = _answer_logprobs(target, own, out.logits, n, answer)  # (1, m, V)
    theirs = _answer_logprobs(target, cache, first, n, answer)  # (A, m, V)
    kl = (mine.exp() * (mine - theirs)).sum(-1).clamp(min=0) / math.log(2)  # (A, m) bits; clamp: rounding
    top1 = (mine.argmax(-1) == theirs.argmax(-1)).float()  # (A, m)
    # the queries that predict the answer: the last prompt position and every answer token but the last
    toks = torch.tensor([ids[-1:] + answer[:-1]], device=target.device)
    cos = attention_cosines(target, own, cache, toks, torch.arange(n - 1, n + m - 1)[None])  # (L, A)
    return [{"map": label, "arm": arm_name(arm.rho, arm.method), "kl": kl[a].mean().item(),
             "kl_first": kl[a, 0].item(), "top1": top1[a].mean().item(), "attn_cos": cos[:, a].mean().item(),
             "attn_cos_layers": [round(c, 6) for c in cos[:, a].tolist()], "prompt_tokens": n, "answer_tokens": m}
            for a, (label, arm) in enumerate(variants)]


def variant_key(label: str, arm: str) -> str:
    return f"{label}/{arm}" if label else arm


def run_probe(prompts: list[ProbePrompt], source, target, maps: dict, variants: list[tuple[str, Arm]], out: Path,
              progress: bool = True) -> Path:
    """Probe every prompt whose (map, arm) lines `out` lacks, appending a prompt's lines together.
    `source`, `target`: LLMs (their runners run, the source's tokenizer encodes)."""
    from tqdm import tqdm

    from .results import read_done

    done = read_done(out, ("prompt", "variant"))
    todo = [(p, [v for v in variants if (p.id, variant_key(v[0], arm_name(v[1].rho, v[1].method))) not in done])
            for p in prompts]
    todo = [(p, vs) for p, vs in todo if vs]
    bar = tqdm(total=len(prompts), initial=len(prompts) - len(todo), unit="prompt", desc="probe",
               disable=not progress, dynamic_ncols=True, file=sys.stderr)
    with open(out, "a") as f:
        for p, vs in todo:
            ids = source.encode(list(p.messages))
            answer = source.tokenizer.encode(p.reference, add_special_tokens=False)
            rows = probe_prompt(source.runner, target.runner, maps, vs, ids, answer)
            f.write("".join(json.dumps({"prompt": p.id, "category": p.category,
                                        "variant": variant_key(r["map"], r["arm"]), **r}) + "\n" for r in rows))
            f.flush()
            bar.update(1)
    bar.close()
    return out


def summarise_probe(rows: list[dict], prompts: list[ProbePrompt] | None = None) -> dict:
    """Per map and arm: mean KL (bits), top-1 agreement and attention-output cosine over prompts (each
    prompt's mean over its answer positions, so a long answer weighs as one prompt), the cosine per
    layer, and the same per category. Only prompts of `prompts`, when given."""
    keep = {p.id for p in prompts} if prompts is not None else None
    cells: dict[str, dict[str, list[dict]]] = {}
    for r in rows:
        if keep is None or r["prompt"] in keep:
            cells.setdefault(r["map"], {}).setdefault(r["arm"], []).append(r)

    def means(rs: list[dict]) -> dict:
        return {"n": len(rs), **{k: sum(r[k] for r in rs) / len(rs) for k in ("kl", "kl_first", "top1", "attn_cos")}}

    out: dict[str, dict] = {}
    for label, arms in cells.items():
        for arm, rs in arms.items():
            layers = [sum(c) / len(rs) for c in zip(*(r["attn_cos_layers"] for r in rs))]
            cats = sorted({r["category"] for r in rs}, key=[c for c, _ in PLAN].index)
            out.setdefault(label, {})[arm] = {**means(rs), "attn_cos_layers": layers,
                                              "by_category": {c: means([r for r in rs if r["category"] == c])
                                                              for c in cats}}
    return {"arms": out}


def markdown(summary: dict) -> str:
    """One row per map and arm: the means, then KL per category."""
    cats = [c for c, _ in PLAN]
    lines = ["| map | arm | prompts | KL (bits) | KL, first token | top-1 same | attention cos | "
             + " | ".join(f"KL {c}" for c in cats) + " |", "|---" * (7 + len(cats)) + "|"]
    for label, arms in summary["arms"].items():
        for arm, c in arms.items():
            by = [f"{c['by_category'][k]['kl']:.3f}" if k in c["by_category"] else "—" for k in cats]
            lines.append(f"| {label or '—'} | {arm} | {c['n']} | {c['kl']:.4f} | {c['kl_first']:.4f} | "
                         f"{c['top1']:.1%} | {c['attn_cos']:.4f} | " + " | ".join(by) + " |")
    return "\n".join(lines)
