"""Resumable evaluation runs: every (item, arm) is one JSON line, written as soon as it is done.

Each arm turns an item's prompt into a filled cache and last-position logits for
the model that answers: the target's own prefill, the source's own prefill, or a
handoff at some ρ and selector through one of the run's maps. Generation tasks then
decode; likelihood tasks score every continuation in one batched pass over copies
of that cache (a continuation's rows are written before they are read and
positions past it are never visible, so each copy serves its choice exactly).

Arms of one item share work: one source prefill (its cache feeds every handoff,
its captured attention the attn-source selector) and one target prefill (the
target arm, and the oracles' reference), whatever the number of maps and arms.

A killed run continues where it stopped and ends with the same results file as an
uninterrupted one (timings, which differ between runs, go to a separate file).
`<out>.meta.json` records what produced the results (models, maps and their
hashes, dtype, seed, versions); resuming with anything different is refused.
"""

from __future__ import annotations

import hashlib
import json
import platform
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from ..engine.cache import KVCache
from ..engine.generate import SamplingConfig, decode
from ..engine.llm import LLM
from ..engine.runner import Runner
from ..errors import RarecacheError
from ..models.loader import checkpoint_fingerprint
from ..transfer.handoff import HandoffConfig, handoff_variants
from ..transfer.mapper import Mapper
from ..transfer.selectors import SELECTORS, attention_capture, received
from .report import display
from .tasks.base import Item, Task

SEED = 0  # the random selector's seed


@dataclass(frozen=True)
class Arm:
    kind: str  # "target", "source" or "handoff"
    rho: float = 0.0
    selector: str = "rank"
    map: str = ""  # label of the map a handoff goes through ("" when the run has one unlabelled map)

    @property
    def name(self) -> str:
        if self.kind != "handoff":
            return self.kind
        return f"rho={self.rho:g}/{self.selector}" + (f"@{self.map}" if self.map else "")

    @property
    def label(self) -> str:
        return display(self.name)

    @classmethod
    def parse(cls, spec: str, maps: tuple[str, ...] = ("",)) -> list["Arm"]:
        """"target", "source", "RHO:SELECTOR" (one arm per map) or "RHO:SELECTOR@MAP"."""
        if spec in ("target", "source"):
            return [cls(spec)]
        body, _, label = spec.partition("@")
        rho, _, selector = body.partition(":")
        if label and label not in maps:
            raise RarecacheError(f"arm {spec!r} names map {label!r}; the run's maps: {', '.join(maps) or '(none)'}")
        try:
            arms = [cls("handoff", float(rho), selector or "rank", m) for m in ([label] if label else maps)]
            HandoffConfig(arms[0].rho, arms[0].selector)  # validates
            return arms
        except ValueError:
            raise RarecacheError(f"bad arm {spec!r}: use target, source or RHO:SELECTOR[@MAP] "
                                 "(e.g. 0.3:rank)") from None


def parse_arms(specs: list[str], maps: tuple[str, ...]) -> list[Arm]:
    arms: list[Arm] = []
    for spec in specs:
        arms += [a for a in Arm.parse(spec, maps) if a not in arms]
    return arms


def read_done(path: Path) -> set[tuple[str, str]]:
    """(item, arm) pairs already in the results file; a line cut short by a kill is dropped."""
    done = set()
    if path.is_file():
        data = path.read_bytes()
        if data and not data.endswith(b"\n"):
            path.write_bytes(data[: data.rfind(b"\n") + 1])
        for line in path.read_text().splitlines():
            if line.strip():
                try:
                    row = json.loads(line)
                    done.add((row["item"], row["arm"]))
                except (json.JSONDecodeError, KeyError):
                    raise RarecacheError(f"{path} has a malformed line; it is not a results file of this run")
    return done


# -- what produced a results file ---------------------------------------------------------

def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def run_meta(task: Task, source: LLM, target: LLM, maps: dict[str, Path], dtype: str,
             sampling: SamplingConfig | None) -> dict:
    from importlib.metadata import version

    return {"task": task.name,
            "source": {"name": source.path.name, "fingerprint": checkpoint_fingerprint(source.path)},
            "target": {"name": target.path.name, "fingerprint": checkpoint_fingerprint(target.path)},
            "maps": {label: {"file": str(p), "sha256": file_sha256(p)} for label, p in maps.items()},
            "dtype": dtype, "seed": SEED,
            "sampling": asdict(sampling) if sampling is not None and task.kind == "generate" else None,
            "versions": {"rarecache": version("rarecache"), "torch": torch.__version__,
                         "python": platform.python_version()}}


def check_meta(out: Path, meta: dict) -> dict:
    """Refuse to add to a results file made with other models, maps or settings; record this run."""
    path = out.with_suffix(".meta.json")
    if path.is_file():
        try:
            old = json.loads(path.read_text())
        except ValueError:
            raise RarecacheError(f"{path} is not a run record; move it away or use another --out") from None
        for key in ("task", "source", "target", "dtype", "seed", "sampling"):
            if old.get(key) != meta[key]:
                raise RarecacheError(f"{out} was produced with {key} {old.get(key)!r}, this run has {meta[key]!r}: "
                                     "use another --out")
        for label, m in meta["maps"].items():
            was = old.get("maps", {}).get(label)
            if was is not None and was["sha256"] != m["sha256"]:
                raise RarecacheError(f"{out}: map {label or '(unlabelled)'} is not the file its results came from "
                                     f"({m['file']} sha256 {m['sha256'][:12]}, was {was['sha256'][:12]}): "
                                     "use another --out")
        seen = [*old.get("versions_seen", []), old.get("versions"), meta["versions"]]
        meta = {**meta, "maps": {**old.get("maps", {}), **meta["maps"]},
                "versions_seen": [v for i, v in enumerate(seen) if v and v not in seen[:i]]}
    out.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(meta, indent=1) + "\n")
    return meta


# -- scoring continuations ------------------------------------------------------------------

SCORE_TOKENS = 512  # padded continuation tokens per scoring pass (bounds the (rows, width, vocab) logits)


def continuation_logprobs(runner: Runner, cache: KVCache, first: torch.Tensor, start: int,
                          continuations: list[list[int]]) -> list[list[list[float]]]:
    """Per-token log-probabilities of each continuation placed at positions start.., for every row
    of `cache` (A contexts whose prompt rows end at start - 1) with `first` (A, V) their last logits.
    Returns [context][continuation][token].

    Every (context, continuation) pair gets its own copy of the context's rows; pairs of similar
    length run together as padded batches of about SCORE_TOKENS tokens (one pass reads the
    weights once for all of them).
    """
    A = first.shape[0]
    first_lp = F.log_softmax(first.float(), -1)  # (A, V)
    out = [[[first_lp[a, cont[0]].item()] for cont in continuations] for a in range(A)]
    pairs = sorted(((a, c) for a in range(A) for c, cont in enumerate(continuations) if len(cont) > 1),
                   key=lambda p: len(continuations[p[1]]))
    i = 0
    while i < len(pairs):
        j = i + 1
        while j < len(pairs) and (j + 1 - i) * (len(continuations[pairs[j][1]]) - 1) <= SCORE_TOKENS:
            j += 1
        chunk, i = pairs[i:j], j
        width = len(continuations[chunk[-1][1]]) - 1  # the last token of each is only predicted
        rows = torch.tensor([a for a, _ in chunk], device=cache.k.device)
        batch = runner.new_cache(len(chunk), start + width)
        batch.k[:, :, :, :start] = cache.k[:, rows, :, :start]
        batch.v[:, :, :, :start] = cache.v[:, rows, :, :start]
        batch.filled[:, :start] = cache.filled[rows, :start]
        toks = torch.zeros(len(chunk), width, dtype=torch.long)
        pos = torch.full((len(chunk), width), -1, dtype=torch.long)
        for r, (_, c) in enumerate(chunk):
            n = len(continuations[c]) - 1
            toks[r, :n] = torch.tensor(continuations[c][:-1])
            pos[r, :n] = torch.arange(start, start + n)
        lp = F.log_softmax(runner.forward(toks.to(runner.device), pos, batch, logits_at="all").logits.float(), -1)
        for r, (a, c) in enumerate(chunk):
            cont = continuations[c]
            out[a][c] += lp[r, torch.arange(len(cont) - 1), torch.tensor(cont[1:])].tolist()
    return out


def continuation_logprobs_reference(runner: Runner, cache: KVCache, first: torch.Tensor, start: int,
                                    continuations: list[list[int]]) -> list[list[float]]:
    """One context (cache of batch one, `first` (V,)), one continuation at a time over that one
    cache: the reference for `continuation_logprobs`."""
    cache = cache.grown(start + max(len(c) for c in continuations))
    out = []
    for cont in continuations:
        logits = first[None]
        if len(cont) > 1:
            toks = torch.tensor([cont[:-1]], device=runner.device)
            pos = torch.arange(start, start + len(cont) - 1, device=runner.device)[None]
            logits = torch.cat([logits, runner.forward(toks, pos, cache, logits_at="all").logits[0]])
        lp = F.log_softmax(logits.float(), -1).gather(1, torch.tensor(cont, device=logits.device)[:, None])
        out.append(lp[:, 0].tolist())
    return out


# -- shared work of one item -----------------------------------------------------------------

def template_mask(ids: list[int], reference: list[int]) -> list[bool]:
    """Positions in the text every prompt of the task shares (instruction, exemplars, chat template):
    the common prefix and common suffix with another item's prompt."""
    n, m = len(ids), len(reference)
    p = 0
    while p < min(n, m) and ids[p] == reference[p]:
        p += 1
    s = 0
    while s < min(n, m) - p and ids[n - 1 - s] == reference[m - 1 - s]:
        s += 1
    return [i < p or i >= n - s for i in range(n)]


@dataclass
class _Prefill:
    cache: KVCache  # batch one, the prompt's rows
    logits: torch.Tensor  # (V,) at the last prompt position
    attn: torch.Tensor  # (1, n) attention received by each position (last queries, last layers)


class _ItemState:
    """Work shared by the arms of one item: each model's own prefill, done at most once."""

    def __init__(self, item: str, ids: list[int], reference: list[int]):
        self.item = item
        self.ids = ids
        self.template = template_mask(ids, reference)
        self._prefills: dict[str, _Prefill] = {}

    def prefill(self, kind: str, runner: Runner) -> tuple[_Prefill, float]:
        """The model's own prefill with attention captured, and the seconds it cost now (0 if shared)."""
        if kind in self._prefills:
            return self._prefills[kind], 0.0
        t = time.perf_counter()
        n = len(self.ids)
        cache = runner.new_cache(1, n)
        ends = torch.tensor([n], device=runner.device)
        out = runner.forward(torch.tensor([self.ids], device=runner.device), torch.arange(n)[None], cache,
                             capture=attention_capture(runner, ends))
        self._prefills[kind] = _Prefill(cache, out.logits[0], received(out.attn, n))
        return self._prefills[kind], time.perf_counter() - t


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
            logits[k], phases[k] = pre.logits, {"prefill": spent}
    if handoffs:
        sels = [SELECTORS.get(arms[k].selector) for k in handoffs]
        src, spent = st.prefill("source", source.runner)
        own = None
        if any(sel is not None and sel.oracle for sel in sels):
            tgt, own_s = st.prefill("target", target.runner)
            own, spent = (tgt.cache, tgt.attn), spent + own_s
        variants = [(arms[k].map, HandoffConfig(arms[k].rho, arms[k].selector, SEED)) for k in handoffs]
        out, lg, results = handoff_variants(source.runner, target.runner, maps, ids, variants, src.cache,
                                            source_attn=src.attn, own=own)
        for j, (k, res) in enumerate(zip(handoffs, results)):
            cache.row(k).copy_prefix(out.row(j), n)
            logits[k] = lg[j]
            chosen = res.positions[0]
            fields[k] = {"recomputed": len(chosen), "position0": 0 in chosen,
                         "chosen_template": sum(st.template[p] for p in chosen)}
            if res.prefix_layers is not None:
                fields[k]["prefix_layers"] = res.prefix_layers
            phases[k] = {**res.timings, "shared_prefill": spent}
    return cache, logits, fields, phases


def _record(task: Task, item: Item, arm: Arm, st: _ItemState, fields: dict) -> dict:
    return {"task": task.name, "item": item.id, "arm": arm.name, "gold": item.gold, **fields,
            "prompt_tokens": len(st.ids), "template_tokens": sum(st.template)}


def _by_model(arms: list[Arm], source: LLM, target: LLM) -> list[tuple[LLM, list[Arm]]]:
    groups = ((target, [a for a in arms if a.kind != "source"]), (source, [a for a in arms if a.kind == "source"]))
    return [(llm, group) for llm, group in groups if group]


def _generate_chunk(task: Task, chunk: list[tuple[Item, Arm]], source: LLM, target: LLM, maps: dict[str, Mapper],
                    sampling: SamplingConfig, reference: list[int]) -> list[tuple[dict, dict]]:
    """Every (item, arm) of a chunk: each item's contexts into rows of a batch cache per answering
    model, then one batched decode per model (decoding is bound by reading the weights, so a
    batch costs about what one sequence does)."""
    items = list({item.id: item for item, _ in chunk}.values())
    states = {item.id: _ItemState(item.id, source.encode(item.prompt), reference) for item in items}
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
                             {**fields, **task.score(item, text), "new_tokens": len(gen.tokens), "text": text})
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
    for llm, group in _by_model(arms, source, target):
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
    return [results[a.name] for a in arms]


@torch.inference_mode()
def run_task(task: Task, items: list[Item], source: LLM, target: LLM, maps: Mapper | dict[str, Mapper],
             arms: list[Arm], out: Path, sampling: SamplingConfig = SamplingConfig(max_new_tokens=256),
             progress: bool = True, batch: int = 8, meta: dict | None = None) -> Path:
    """Evaluate every (item, arm) not yet in `out`, appending one JSON line each.

    `maps` is one map, or maps by label (arms name the label they go through).
    Generation tasks run `batch` items at a time (all their arms decode together), likelihood
    tasks one item at a time (all its arms score together); the lines of a chunk are written
    together, in item then arm order, so a resumed run ends with the same file as an
    uninterrupted one.
    """
    maps = maps if isinstance(maps, dict) else {"": maps}
    for arm in arms:
        if arm.kind == "handoff" and arm.map not in maps:
            raise RarecacheError(f"arm {arm.name} needs map {arm.map!r}, which this run was not given")
    for mapper in maps.values():
        task.check_map(mapper, items)
    if meta is not None:
        check_meta(out, meta)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = read_done(out)
    if not sampling.stop_token_ids:
        sampling = replace(sampling, stop_token_ids=target.tokenizer.eos_token_ids)
    pool = task.calibration_items()  # another prompt of the task: what every prompt shares
    reference = source.encode(pool[0].prompt) if pool else []
    jobs = [(i, a) for i in items for a in arms if (i.id, a.name) not in done]
    bar = tqdm(total=len(items) * len(arms), initial=len(items) * len(arms) - len(jobs), unit="answer",
               desc=task.name, disable=not progress, dynamic_ncols=True, file=sys.stderr)
    with open(out, "a") as res_f, open(out.with_suffix(".timings.jsonl"), "a") as time_f:
        if task.kind == "generate":
            order = {item.id: k for k, item in enumerate(items)}
            chunks: dict[int, list[tuple[Item, Arm]]] = {}
            for item, arm in jobs:  # fixed chunks of the item list, whatever is already done
                chunks.setdefault(order[item.id] // batch, []).append((item, arm))
            for key in sorted(chunks):
                rows = _generate_chunk(task, chunks[key], source, target, maps, sampling, reference)
                res_f.write("".join(json.dumps(r) + "\n" for r, _ in rows))
                res_f.flush()
                time_f.write("".join(json.dumps(t) + "\n" for _, t in rows))
                time_f.flush()
                bar.update(len(rows))
        else:
            todo: dict[str, list[Arm]] = {}
            for item, arm in jobs:
                todo.setdefault(item.id, []).append(arm)
            for item in items:
                if item.id not in todo:
                    continue
                st = _ItemState(item.id, source.encode(item.prompt), reference)
                conts = [source.tokenizer.encode(c, add_special_tokens=False) for c in item.continuations]
                rows = _likelihood_item(task, item, todo[item.id], st, conts, source, target, maps)
                res_f.write("".join(json.dumps(r) + "\n" for r, _ in rows))
                res_f.flush()
                time_f.write("".join(json.dumps(t) + "\n" for _, t in rows))
                time_f.flush()
                bar.update(len(rows))
    bar.close()
    return out


def load_results(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
