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
from ..engine.runner import Runner
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

    def __init__(self, ids: list[int]):
        self.ids = ids
        self.src_cache: KVCache | None = None


def _context(arm: Arm, st: _ItemState, source: LLM, target: LLM, mapper: Mapper, room: int):
    """(answering runner, cache with the prompt, last-prompt logits (V,), record fields, phase timings)."""
    ids, n = st.ids, len(st.ids)
    if arm.kind in ("target", "source"):
        runner = (target if arm.kind == "target" else source).runner
        t = time.perf_counter()
        cache, out = runner.prefill([ids], max_len=n + room)
        return runner, cache, out.logits[0], {}, {"prefill": time.perf_counter() - t}
    sel = SELECTORS.get(arm.selector)
    shared = sel is None or not sel.needs_source_attention
    if shared and st.src_cache is None:
        st.src_cache, _ = source.runner.prefill([ids], max_len=n)
    cache, logits, res = handoff(source.runner, target.runner, mapper, [ids], HandoffConfig(arm.rho, arm.selector),
                                 max_len=n + room, source_cache=st.src_cache if shared else None,
                                 source_from=[n] if shared else None)
    fields = {"recomputed": len(res.positions[0]), "position0": 0 in res.positions[0]}
    if res.prefix_layers is not None:
        fields["prefix_layers"] = res.prefix_layers
    return target.runner, cache, logits[0], fields, res.timings


@torch.inference_mode()
def run_task(task: Task, items: list[Item], source: LLM, target: LLM, mapper: Mapper, arms: list[Arm],
             out: Path, sampling: SamplingConfig = SamplingConfig(max_new_tokens=256),
             progress: bool = True) -> Path:
    """Evaluate every (item, arm) not yet in `out`, appending one JSON line each."""
    check_map_disjoint(mapper, task, items)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = read_done(out)
    if not sampling.stop_token_ids:
        sampling = replace(sampling, stop_token_ids=target.tokenizer.eos_token_ids)
    todo = sum((i.id, a.name) not in done for i in items for a in arms)
    bar = tqdm(total=todo, unit="answer", desc=task.name, disable=not progress, dynamic_ncols=True)
    with open(out, "a") as res_f, open(out.with_suffix(".timings.jsonl"), "a") as time_f:
        for item in items:
            pending = [a for a in arms if (item.id, a.name) not in done]
            if not pending:
                continue
            st = _ItemState(source.encode(list(item.messages)))
            conts = [source.tokenizer.encode(c, add_special_tokens=False) for c in item.continuations]
            room = sampling.max_new_tokens if task.kind == "generate" else max(len(c) for c in conts)
            for arm in pending:
                t0 = time.perf_counter()
                runner, cache, logits, fields, phases = _context(arm, st, source, target, mapper, room)
                record = {"task": task.name, "item": item.id, "arm": arm.name, "gold": item.gold, **fields}
                n = len(st.ids)
                if task.kind == "generate":
                    llm = source if runner is source.runner else target
                    done_yet = lambda toks, tok=llm.tokenizer: task.answer_complete(tok.decode(toks[-24:]))  # noqa: E731
                    gen = decode(runner, cache, logits[None], torch.tensor([n]), sampling, done_yet)[0]
                    text = llm.tokenizer.decode(gen.tokens)
                    record.update(task.score(item, text), prompt_tokens=n, new_tokens=len(gen.tokens), text=text)
                else:
                    lps = continuation_logprobs(runner, cache, logits, n, conts)
                    record.update(task.score_likelihood(item, [sum(lp) for lp in lps]), prompt_tokens=n)
                res_f.write(json.dumps(record) + "\n")
                res_f.flush()
                time_f.write(json.dumps({"item": item.id, "arm": arm.name, "seconds": time.perf_counter() - t0,
                                         "phases": phases}) + "\n")
                time_f.flush()
                bar.update(1)
    bar.close()
    return out


def load_results(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
