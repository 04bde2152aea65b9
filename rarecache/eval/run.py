"""Resumable evaluation runs: every (item, arm) is one JSON line, written as soon as it is done.

Each arm (`arms.py`) turns an item's prompt into a filled cache and last-position
logits for the model that answers: the target's own prefill, the source's own
prefill, or a handoff at some ρ and selector through one of the run's maps.
Generation tasks then decode; likelihood tasks score every continuation in one
batched pass over copies of that cache (`scoring.py`).

Arms of one item share work: one source prefill (its cache feeds every handoff,
its captured attention the attn-source selector) and one target prefill (the
target arm, and the oracles' reference), whatever the number of maps and arms.
Items share work too: the prefix every prompt of a task starts with (instruction,
few-shot exemplars) is prefilled once per model and copied into each item's cache
(`SharedPrefix`), so an item prefills only its own text.

A killed run continues where it stopped and ends with the same results file as an
uninterrupted one (timings, which differ between runs, go to a separate file).
`<out>.meta.json` records what produced the results (`results.py`); resuming with
anything different is refused.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from ..engine.cache import KVCache
from ..engine.generate import SamplingConfig, decode
from ..engine.llm import LLM
from ..engine.runner import Runner
from ..errors import RarecacheError
from ..transfer.conversation import common_prefix
from ..transfer.gate.policy import RUNGS, GatePolicy, js_bits
from ..transfer.gate.ladder import gated_handoff
from ..transfer.handoff import handoff_variants
from ..transfer.mapper import Mapper
from ..transfer.selectors import ATTN_QUERIES, forward_received
from .answers import same_answer
from .arms import Arm
from .results import check_meta, read_done
from .scoring import continuation_logprobs, template_mask
from .tasks.base import Item, Task


# -- shared work of one item -----------------------------------------------------------------

class SharedPrefix:
    """The tokens a task's prompts start with (instruction, exemplars, chat template), prefilled once
    per model.

    Why: by causality the rows of a prompt's first p positions depend on its first p tokens alone, so
    an item that starts with them copies those rows and prefills only the rest. The cache is the same
    up to float rounding (tested against full prefills), and on a few-shot task the prefix is most of
    the prompt (HellaSwag: ~390 of ~440 tokens). The tokens are what two of the task's calibration
    prompts share, never read from evaluated items, so every run, resumed or not, copies the same rows.
    """

    def __init__(self, tokens: list[int]):
        self.tokens = tokens
        self._rows: dict[str, tuple[KVCache, float]] = {}  # kind -> (rows, seconds their prefill took)

    @classmethod
    def of_task(cls, task: Task, encode) -> SharedPrefix:
        pool = task.calibration_items()
        if len(pool) < 2:
            return cls([])
        a, b = encode(pool[0].prompt), encode(pool[1].prompt)
        return cls(a[: common_prefix(a, b)])

    def fill(self, kind: str, runner: Runner, ids: list[int], cache: KVCache) -> tuple[int, float]:
        """Copy the first rows `ids` shares with the prefix into `cache` (batch one), leaving the
        captured queries (the last ATTN_QUERIES) to the item's own pass. Returns how many rows, and the
        seconds prefilling them took (pro rata of the prefix's one prefill)."""
        q = min(common_prefix(ids, self.tokens), len(ids) - ATTN_QUERIES)
        if q <= 0:
            return 0, 0.0
        if kind not in self._rows:
            t = time.perf_counter()
            rows = runner.new_cache(1, len(self.tokens))
            runner.forward(torch.tensor([self.tokens], device=runner.device), torch.arange(len(self.tokens))[None],
                           rows, logits_at=None)
            self._rows[kind] = (rows, time.perf_counter() - t)
        rows, seconds = self._rows[kind]
        cache.copy_prefix(rows, q)
        return q, seconds * q / len(self.tokens)


@dataclass
class _Prefill:
    cache: KVCache  # batch one, the prompt's rows
    logits: torch.Tensor  # (V,) at the last prompt position
    attn: torch.Tensor  # (1, n) attention received by each position (last queries, last layers)
    seconds: float  # what a prefill of the whole prompt costs (a shared prefix's part pro rata)
    shared: int = 0  # rows copied from the task's shared prefix


class _ItemState:
    """Work shared by the arms of one item: each model's own prefill, done at most once."""

    def __init__(self, ids: list[int], reference: list[int], shared: SharedPrefix | None = None):
        self.ids = ids
        self.template = template_mask(ids, reference)
        self.shared = shared
        self._prefills: dict[str, _Prefill] = {}

    def prefill(self, kind: str, runner: Runner) -> tuple[_Prefill, float]:
        """The model's own prefill with attention captured, and the seconds it cost now (0 if shared)."""
        if kind in self._prefills:
            return self._prefills[kind], 0.0
        t = time.perf_counter()
        n = len(self.ids)
        cache = runner.new_cache(1, n)
        q, shared_s = self.shared.fill(kind, runner, self.ids, cache) if self.shared else (0, 0.0)
        own = time.perf_counter()
        ends = torch.tensor([n - q], device=runner.device)
        out, attn = forward_received(runner, torch.tensor([self.ids[q:]], device=runner.device),
                                     torch.arange(q, n)[None], cache, ends, n)
        done = time.perf_counter()
        self._prefills[kind] = _Prefill(cache, out.logits[0], attn, done - own + shared_s, q)
        return self._prefills[kind], done - t


def _contexts(arms: list[Arm], st: _ItemState, source: LLM, target: LLM, maps: dict[str, Mapper]
              ) -> tuple[KVCache, torch.Tensor, list[dict], list[dict]]:
    """The item's prompt as each arm fills it, for arms answered by one model: a cache with one row
    per arm, the last-prompt logits (A, V), record fields and phase timings per arm."""
    ids, n = st.ids, len(st.ids)
    answering = source if arms[0].kind == "source" else target
    cache = answering.runner.new_cache(len(arms), n)
    logits = torch.empty(len(arms), answering.config.vocab_size, device=answering.runner.device)
    fields: list[dict] = [{} for _ in arms]
    phases: list[dict] = [{} for _ in arms]
    handoffs = [k for k, a in enumerate(arms) if a.kind == "handoff"]
    for k, arm in enumerate(arms):
        if arm.kind != "handoff":
            pre, spent = st.prefill(arm.kind, answering.runner)
            cache.row(k).copy_prefix(pre.cache, n)
            logits[k], phases[k] = pre.logits, {"prefill": spent, "shared_prefix": pre.shared}
    if handoffs:
        variants = [(arms[k].map, arms[k].config) for k in handoffs]
        src, spent = st.prefill("source", source.runner)
        target_prefill = None
        if any(cfg.scorer is not None and cfg.scorer.oracle for _, cfg in variants):
            tgt, tgt_s = st.prefill("target", target.runner)
            target_prefill, spent = (tgt.cache, tgt.attn), spent + tgt_s
        out, lg, results = handoff_variants(source.runner, target.runner, maps, ids, variants, src.cache,
                                            source_attn=src.attn, target_prefill=target_prefill)
        for j, (k, res) in enumerate(zip(handoffs, results)):
            cache.row(k).copy_prefix(out.row(j), n)
            logits[k] = lg[j]
            chosen = res.positions[0]
            fields[k] = {"recomputed": res.recomputed(0), "position0": 0 in chosen,
                         "chosen_template": sum(st.template[p] for p in chosen)}
            if res.prefix_layers is not None:
                fields[k]["prefix_layers"] = res.prefix_layers
            if res.first_pass is not None:  # a two-pass selector: "recomputed" counts both passes
                fields[k]["first_pass"] = len(res.first_pass[0])
            phases[k] = {**res.timings, "shared_prefill": spent}
    return cache, logits, fields, phases


def _record(task: Task, item: Item, arm: Arm, st: _ItemState, fields: dict) -> dict:
    return {"task": task.name, "item": item.id, "arm": arm.name, "gold": item.gold, **fields,
            "prompt_tokens": len(st.ids), "template_tokens": sum(st.template)}


def _by_model(arms: list[Arm], source: LLM, target: LLM) -> list[tuple[LLM, list[Arm]]]:
    groups = ((target, [a for a in arms if a.kind != "source"]), (source, [a for a in arms if a.kind == "source"]))
    return [(llm, group) for llm, group in groups if group]


def _generate_chunk(task: Task, chunk: list[tuple[Item, Arm]], source: LLM, target: LLM, maps: dict[str, Mapper],
                    sampling: SamplingConfig, reference: list[int], shared: SharedPrefix | None
                    ) -> list[tuple[dict, dict]]:
    """Every (item, arm) of a chunk: each item's contexts into rows of a batch cache per answering
    model, then one batched decode per model (decoding is bound by reading the weights, so a
    batch costs about what one sequence does)."""
    items = list({item.id: item for item, _ in chunk}.values())
    states = {item.id: _ItemState(source.encode(item.prompt), reference, shared) for item in items}
    arms_of = {item.id: [a for i, a in chunk if i.id == item.id] for item in items}
    results: dict[tuple[str, str], tuple[dict, dict]] = {}
    for llm in (target, source):
        jobs = [(item, group) for item in items for m, group in _by_model(arms_of[item.id], source, target)
                if m is llm]
        if not jobs:
            continue
        rows = [(item, arm) for item, group in jobs for arm in group]
        lengths = [len(states[item.id].ids) for item, _ in rows]
        cache = llm.runner.new_cache(len(rows), max(lengths) + sampling.max_new_tokens)
        firsts, meta, r = [], [], 0
        for item, group in jobs:
            st = states[item.id]
            t = time.perf_counter()
            ctx, lg, fields, phases = _contexts(group, st, source, target, maps)
            ctx_s = time.perf_counter() - t
            for k in range(len(group)):
                cache.row(r).copy_prefix(ctx.row(k), len(st.ids))
                firsts.append(lg[k])
                meta.append((fields[k], phases[k], ctx_s))
                r += 1
        t = time.perf_counter()
        gens = decode(llm.runner, cache, torch.stack(firsts), torch.tensor(lengths), sampling,
                      lambda toks: task.answer_complete(llm.tokenizer.decode(toks[-24:])))
        decode_s = time.perf_counter() - t
        for (item, arm), gen, (fields, phases, ctx_s) in zip(rows, gens, meta):
            text = llm.tokenizer.decode(gen.tokens)
            record = _record(task, item, arm, states[item.id],
                             {**fields, **task.score(item, text), "new_tokens": len(gen.tokens),
                              "truncated": gen.finish_reason == "length", "text": text})  # (cut at the cap)
            results[(item.id, arm.name)] = (record, {"item": item.id, "arm": arm.name, "item_context_s": ctx_s,
                                                     "phases": phases, "batch_decode_s": decode_s,
                                                     "batch": len(rows)})
    return [results[(item.id, arm.name)] for item, arm in chunk]


def _likelihood_item(task: Task, item: Item, arms: list[Arm], st: _ItemState, conts: list[list[int]],
                     source: LLM, target: LLM, maps: dict[str, Mapper]) -> list[tuple[dict, dict]]:
    """Every arm of one item: the contexts per answering model, then every (arm, choice) scored in
    shared passes. Results come back in the order of `arms`."""
    n = len(st.ids)
    results: dict[str, tuple[dict, dict]] = {}
    ladders = [a for a in arms if a.kind == "ladder"]
    for llm, group in _by_model([a for a in arms if a.kind != "ladder"], source, target):
        t = time.perf_counter()
        cache, firsts, fields, phases = _contexts(group, st, source, target, maps)
        ctx_s = time.perf_counter() - t
        t = time.perf_counter()
        lps = continuation_logprobs(llm.runner, cache, firsts, n, conts)
        score_s = time.perf_counter() - t
        for arm, lp, f, ph in zip(group, lps, fields, phases):
            record = _record(task, item, arm, st, {**f, **task.score_likelihood(item, [sum(x) for x in lp])})
            results[arm.name] = (record, {"item": item.id, "arm": arm.name, "item_context_s": ctx_s, "phases": ph,
                                          "batch_continuations_s": score_s, "batch": len(group)})
    for arm in ladders:
        results[arm.name] = _ladder(task, item, arm, st, conts, source, target, maps[arm.map])
    return [results[a.name] for a in arms]


def answer_shift(metric: str, a: dict, b: dict) -> float:
    """How far an answer moves between two scorings of the same item (`answer_views`: the rung's cache against
    the same with the rows still mapped from the map's other view). Bits per byte: the absolute difference.
    Multiple choice: the total variation between the choices' softmax distributions, plus 1 when the
    scored answer differs (`answers.same_answer`; so a changed answer ranks above any agreeing pair)."""
    if metric == "bpb":
        return abs(a["bpb"] - b["bpb"])
    pa, pb = (torch.tensor(x["logprobs"], dtype=torch.float64).softmax(-1) for x in (a, b))
    return 0.5 * (pa - pb).abs().sum().item() + float(not same_answer(a, b, metric))


def _ladder(task: Task, item: Item, arm: Arm, st: _ItemState, conts: list[list[int]], source: LLM, target: LLM,
            mapper: Mapper) -> tuple[dict, dict]:
    """The gate's ladder for one item: every rung climbed from the source's own prefill, each rung's
    cache scored like any arm's. The target's prefill is timed alongside (shared with the target arm):
    the gate's expected speed-up divides by it."""
    n = len(st.ids)
    src, _ = st.prefill("source", source.runner)
    tgt, _ = st.prefill("target", target.runner)
    snaps = target.runner.new_cache(len(RUNGS), n)
    view_snaps = target.runner.new_cache(len(RUNGS), n) if mapper.has_plain_view else None
    _, firsts, res = gated_handoff(source.runner, target.runner, mapper, st.ids, GatePolicy(arm.method, RUNGS, -1.0),
                                   source_cache=src.cache, source_kept=n, source_attn=src.attn, climb_all=True,
                                   snapshots=snaps, view_snapshots=view_snaps)
    t = time.perf_counter()
    lps = continuation_logprobs(target.runner, snaps, firsts, n, conts)
    score_s = time.perf_counter() - t
    answers = [task.score_likelihood(item, [sum(x) for x in lp]) for lp in lps]
    views = res.views_logits is not None
    if views:  # the answers under the other view too: how far they move (candidate signal `answer_views`)
        t = time.perf_counter()
        other = [task.score_likelihood(item, [sum(x) for x in lp])
                 for lp in continuation_logprobs(target.runner, view_snaps, res.views_logits, n, conts)]
        views_answer_s = time.perf_counter() - t
    v = min(firsts.shape[-1], src.logits.shape[-1])  # (a family shares its tokenizer; vocab rows may be padded)
    rungs = [{"rho": r.rho, "recomputed": r.recomputed, "run": r.run, "js": r.js, "top1_same": r.top1_same,
              "outside": r.outside, "margin": r.margin, "entropy": r.entropy, "js_plain": r.js_plain,
              "row_error": r.row_error, "row_error_layers": r.row_error_layers, "nll": r.nll, "nll_shift": r.nll_shift,
              "nll_gap": r.nll_gap, "probe_cos": r.probe_cos,
              **({"js_views": r.js_views, "answer_views": answer_shift(task.metric, a, other[k])} if views else {}),
              "js_source": js_bits(lg[:v], src.logits[:v]),  # candidate signal: against the source's own next token
              **a} for k, (r, a, lg) in enumerate(zip(res.rungs[1:], answers, firsts))]
    record = _record(task, item, arm, st, {"ladder": rungs, "plain_outside": res.rungs[0].outside})
    tm = res.handoff.timings
    phases = {"map": tm["map"], "score": tm["score"], "rung_recompute": [r.seconds for r in res.rungs],
              "rung_signals": [r.signal_seconds for r in res.rungs],  # what measuring each signal cost, per rung
              "target_prefill": tgt.seconds, "target_shared_prefix": tgt.shared}
    if views:  # what the js_views signal costs: mapping the other view, one more last-position pass per rung
        rung_s = [r.views_seconds for r in res.rungs]
        phases |= {"views_map": tm["views"] - sum(rung_s), "views_rungs": rung_s, "views_answer": views_answer_s}
    return record, {"item": item.id, "arm": arm.name, "phases": phases, "batch_continuations_s": score_s,
                    "batch": len(RUNGS)}


@torch.inference_mode()
def run_task(task: Task, items: list[Item], source: LLM, target: LLM, maps: Mapper | dict[str, Mapper],
             arms: list[Arm], out: Path, sampling: SamplingConfig | None = None,
             progress: bool = True, batch: int = 8, meta: dict | None = None, share_prefix: bool = True) -> Path:
    """Evaluate every (item, arm) not yet in `out`, appending one JSON line each.

    `maps` is one map, or maps by label (arms name the label they go through).
    Generation tasks run `batch` items at a time (all their arms decode together), likelihood
    tasks one item at a time (all its arms score together); the lines of a chunk are written
    together, in item then arm order, so a resumed run ends with the same file as an
    uninterrupted one. `share_prefix=False` prefills every prompt whole (the reference `SharedPrefix`
    is tested against). `sampling` defaults to greedy up to the task's own cap (`Task.max_new_tokens`).
    Likelihood tasks score from a float32 LM head (`Runner.float32_logits`): a bfloat16 head's logits sit
    on bf16's grid, where choices that differ tie. (The gate ladder's signals are read from the same
    float32-head logits; a served gate reads the model's own head, which differs by bf16's rounding.)
    """
    sampling = sampling or SamplingConfig(max_new_tokens=task.max_new_tokens)
    if task.kind == "likelihood":
        with source.runner.float32_logits(), target.runner.float32_logits():
            return _run(task, items, source, target, maps, arms, out, sampling, progress, batch, meta, share_prefix)
    return _run(task, items, source, target, maps, arms, out, sampling, progress, batch, meta, share_prefix)


def _run(task: Task, items: list[Item], source: LLM, target: LLM, maps: Mapper | dict[str, Mapper],
         arms: list[Arm], out: Path, sampling: SamplingConfig, progress: bool, batch: int, meta: dict | None,
         share_prefix: bool) -> Path:
    maps = maps if isinstance(maps, dict) else {"": maps}
    for arm in arms:
        if arm.kind == "handoff" and arm.map not in maps:
            raise RarecacheError(f"arm {arm.name} needs map {arm.map!r}, which this run was not given")
    if task.kind == "generate" and any(a.kind == "ladder" for a in arms):
        raise RarecacheError(f"the ladder arm scores likelihoods; {task.name} is a generation task")
    for mapper in maps.values():
        task.check_map(mapper, items)
    if meta is not None:
        check_meta(out, meta)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = read_done(out)
    sampling = target.with_eos(sampling)
    pool = task.calibration_items()  # another prompt of the task: what every prompt shares
    reference = source.encode(pool[0].prompt) if pool else []
    shared = SharedPrefix.of_task(task, source.encode) if share_prefix else None
    jobs = [(i, a) for i in items for a in arms if (i.id, a.name) not in done]
    bar = tqdm(total=len(items) * len(arms), initial=len(items) * len(arms) - len(jobs), unit="answer",
               desc=task.name, disable=not progress, dynamic_ncols=True, file=sys.stderr)
    with open(out, "a") as res_f, open(out.with_suffix(".timings.jsonl"), "a") as time_f:
        def write(rows: list[tuple[dict, dict]]) -> None:  # a chunk's records, then their timings
            res_f.write("".join(json.dumps(r) + "\n" for r, _ in rows))
            res_f.flush()
            time_f.write("".join(json.dumps(t) + "\n" for _, t in rows))
            time_f.flush()
            bar.update(len(rows))

        if task.kind == "generate":
            order = {item.id: k for k, item in enumerate(items)}
            chunks: dict[int, list[tuple[Item, Arm]]] = {}
            for item, arm in jobs:  # fixed chunks of the item list, whatever is already done
                chunks.setdefault(order[item.id] // batch, []).append((item, arm))
            for key in sorted(chunks):
                write(_generate_chunk(task, chunks[key], source, target, maps, sampling, reference, shared))
        else:
            todo: dict[str, list[Arm]] = {}
            for item, arm in jobs:
                todo.setdefault(item.id, []).append(arm)
            for item in items:
                if item.id not in todo:
                    continue
                st = _ItemState(source.encode(item.prompt), reference, shared)
                conts = [source.tokenizer.encode(c, add_special_tokens=False) for c in item.continuations]
                write(_likelihood_item(task, item, todo[item.id], st, conts, source, target, maps))
    bar.close()
    return out

