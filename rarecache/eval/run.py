"""Resumable evaluation runs: every (item, arm) is one JSON line, written as soon as it is done.

Each arm turns an item's prompt into a filled cache and last-position logits for
the model that answers: the target's own prefill, the source's own prefill, or a
handoff at some ρ and selector. Generation tasks then decode; likelihood tasks
score each continuation over that same cache (a continuation's rows are written
before they are read and positions past it are never visible, so one cache
serves every choice exactly). Arms of one item share the source's prefill.

A killed run continues where it stopped and ends with the same results file as an
uninterrupted one (timings, which differ between runs, go to a separate file).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from ..engine.cache import KVCache
from ..engine.generate import SamplingConfig, decode
from ..engine.llm import LLM
from ..engine.runner import Runner, pad_batch
from ..errors import RarecacheError
from ..transfer.handoff import HandoffConfig, handoff
from ..transfer.mapper import Mapper
from ..transfer.selectors import SELECTORS
from .tasks.base import Item, Task, check_disjoint


@dataclass(frozen=True)
class Arm:
    kind: str  # "target", "source" or "handoff"
    rho: float = 0.0
    selector: str = "rank"

    @property
    def name(self) -> str:
        return self.kind if self.kind != "handoff" else f"rho={self.rho:g}/{self.selector}"

    @property
    def label(self) -> str:
        sel = SELECTORS.get(self.selector)
        return self.name + (" (oracle)" if self.kind == "handoff" and sel is not None and sel.oracle else "")

    @classmethod
    def parse(cls, spec: str) -> "Arm":
        """"target", "source", or "RHO:SELECTOR" (e.g. 0.3:rank)."""
        if spec in ("target", "source"):
            return cls(spec)
        rho, _, selector = spec.partition(":")
        try:
            arm = cls("handoff", float(rho), selector or "rank")
            HandoffConfig(arm.rho, arm.selector)  # validates
            return arm
        except ValueError:
            raise RarecacheError(f"bad arm {spec!r}: use target, source or RHO:SELECTOR (e.g. 0.3:rank)") from None


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


def check_map_disjoint(mapper: Mapper, task: Task, items: list[Item]) -> None:
    if mapper.info.corpus.get("name") == f"task:{task.name}":
        check_disjoint(mapper.info.calibration.get("document_ids", []), [i.id for i in items], task.name)


def continuation_logprobs(runner: Runner, cache: KVCache, first: torch.Tensor, start: int,
                          continuations: list[list[int]]) -> list[list[float]]:
    """Per-token log-probabilities of each continuation placed at positions start.., over `cache`
    (whose prompt rows end at start - 1) with `first` (V,) the prompt's last logits."""
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


class _ItemState:
    """Work shared by the arms of one item."""

    def __init__(self, item: str, ids: list[int]):
        self.item = item
        self.ids = ids
        self.src_cache: KVCache | None = None


def _context(arm: Arm, st: _ItemState, source: LLM, target: LLM, mapper: Mapper, row: KVCache):
    """Fill `row` (a batch-of-one cache) with the item's prompt as this arm does it.
    Returns the last-prompt logits (V,), record fields and phase timings."""
    ids, n = st.ids, len(st.ids)
    if arm.kind in ("target", "source"):
        runner = (target if arm.kind == "target" else source).runner
        t = time.perf_counter()
        out = runner.forward(*pad_batch([ids], runner.device), row)
        return out.logits[0], {}, {"prefill": time.perf_counter() - t}
    sel = SELECTORS.get(arm.selector)
    shared = sel is None or not sel.needs_source_attention
    if shared and st.src_cache is None:
        st.src_cache, _ = source.runner.prefill([ids], max_len=n)
    _, logits, res = handoff(source.runner, target.runner, mapper, [ids], HandoffConfig(arm.rho, arm.selector),
                             source_cache=st.src_cache if shared else None, source_from=[n] if shared else None,
                             target_cache=row)
    fields = {"recomputed": len(res.positions[0]), "position0": 0 in res.positions[0]}
    if res.prefix_layers is not None:
        fields["prefix_layers"] = res.prefix_layers
    return logits[0], fields, res.timings


def _generate_chunk(task: Task, chunk: list[tuple[Item, Arm]], source: LLM, target: LLM, mapper: Mapper,
                    sampling: SamplingConfig) -> list[tuple[dict, dict]]:
    """Every (item, arm) of a chunk: contexts one by one into rows of a batch cache per answering
    model, then one batched decode per model (decoding is bound by reading the weights, so a
    batch costs about what one sequence does)."""
    states = {item.id: _ItemState(item.id, source.encode(list(item.messages))) for item, _ in chunk}
    results: dict[int, tuple[dict, dict]] = {}
    for llm, jobs in ((target, [j for j in enumerate(chunk) if j[1][1].kind != "source"]),
                      (source, [j for j in enumerate(chunk) if j[1][1].kind == "source"])):
        if not jobs:
            continue
        lengths = [len(states[item.id].ids) for _, (item, _) in jobs]
        cache = llm.runner.new_cache(len(jobs), max(lengths) + sampling.max_new_tokens)
        logits, meta = [], []
        for row, (_, (item, arm)) in enumerate(jobs):
            t = time.perf_counter()
            lg, fields, phases = _context(arm, states[item.id], source, target, mapper, cache.row(row))
            logits.append(lg)
            meta.append((fields, phases, time.perf_counter() - t))
        t = time.perf_counter()
        gens = decode(llm.runner, cache, torch.stack(logits), torch.tensor(lengths), sampling,
                      lambda toks: task.answer_complete(llm.tokenizer.decode(toks[-24:])))
        decode_s = time.perf_counter() - t
        for (k, (item, arm)), gen, n, (fields, phases, ctx_s) in zip(jobs, gens, lengths, meta):
            text = llm.tokenizer.decode(gen.tokens)
            record = {"task": task.name, "item": item.id, "arm": arm.name, "gold": item.gold, **fields,
                      **task.score(item, text), "prompt_tokens": n, "new_tokens": len(gen.tokens), "text": text}
            results[k] = (record, {"item": item.id, "arm": arm.name, "context_s": ctx_s, "phases": phases,
                                   "batch_decode_s": decode_s, "batch": len(jobs)})
    return [results[k] for k in range(len(chunk))]


def _likelihood(task: Task, item: Item, arm: Arm, st: _ItemState, conts: list[list[int]], source: LLM,
                target: LLM, mapper: Mapper) -> tuple[dict, dict]:
    t0 = time.perf_counter()
    llm = source if arm.kind == "source" else target
    n = len(st.ids)
    cache = llm.runner.new_cache(1, n + max(len(c) for c in conts))
    logits, fields, phases = _context(arm, st, source, target, mapper, cache.row(0))
    lps = continuation_logprobs(llm.runner, cache, logits, n, conts)
    record = {"task": task.name, "item": item.id, "arm": arm.name, "gold": item.gold, **fields,
              **task.score_likelihood(item, [sum(lp) for lp in lps]), "prompt_tokens": n}
    return record, {"item": item.id, "arm": arm.name, "seconds": time.perf_counter() - t0, "phases": phases}


@torch.inference_mode()
def run_task(task: Task, items: list[Item], source: LLM, target: LLM, mapper: Mapper, arms: list[Arm],
             out: Path, sampling: SamplingConfig = SamplingConfig(max_new_tokens=256),
             progress: bool = True, batch: int = 8) -> Path:
    """Evaluate every (item, arm) not yet in `out`, appending one JSON line each.

    Generation tasks run `batch` items at a time (all their arms decode together); the lines
    of a chunk are written together, in item then arm order, so a resumed run ends with the
    same file as an uninterrupted one.
    """
    check_map_disjoint(mapper, task, items)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = read_done(out)
    if not sampling.stop_token_ids:
        sampling = replace(sampling, stop_token_ids=target.tokenizer.eos_token_ids)
    jobs = [(i, a) for i in items for a in arms if (i.id, a.name) not in done]
    bar = tqdm(total=len(jobs), unit="answer", desc=task.name, disable=not progress, dynamic_ncols=True)
    with open(out, "a") as res_f, open(out.with_suffix(".timings.jsonl"), "a") as time_f:
        if task.kind == "generate":
            order = {item.id: k for k, item in enumerate(items)}
            chunks: dict[int, list[tuple[Item, Arm]]] = {}
            for item, arm in jobs:  # fixed chunks of the item list, whatever is already done
                chunks.setdefault(order[item.id] // batch, []).append((item, arm))
            for key in sorted(chunks):
                rows = _generate_chunk(task, chunks[key], source, target, mapper, sampling)
                res_f.write("".join(json.dumps(r) + "\n" for r, _ in rows))
                res_f.flush()
                time_f.write("".join(json.dumps(t) + "\n" for _, t in rows))
                time_f.flush()
                bar.update(len(rows))
        else:
            st = None
            for item, arm in jobs:
                if st is None or st.item != item.id:  # one item's shared work at a time
                    st = _ItemState(item.id, source.encode(list(item.messages)))
                conts = [source.tokenizer.encode(c, add_special_tokens=False) for c in item.continuations]
                record, timing = _likelihood(task, item, arm, st, conts, source, target, mapper)
                res_f.write(json.dumps(record) + "\n")
                res_f.flush()
                time_f.write(json.dumps(timing) + "\n")
                time_f.flush()
                bar.update(1)
    bar.close()
    return out


def load_results(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
