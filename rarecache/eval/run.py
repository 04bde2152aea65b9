"""Resumable evaluation runs: every (item, arm) is one JSON line, written as soon as it is done.

A killed run continues where it stopped and ends with the same results file as an
uninterrupted one (timings, which differ between runs, go to a separate file).
Arms of one item share the source's prefill.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from ..engine.generate import SamplingConfig, decode
from ..engine.llm import LLM
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


@torch.inference_mode()
def run_generation(task: Task, items: list[Item], source: LLM, target: LLM, mapper: Mapper, arms: list[Arm],
                   sampling: SamplingConfig, out: Path, progress: bool = True) -> Path:
    check_map_disjoint(mapper, task, items)
    out.parent.mkdir(parents=True, exist_ok=True)
    timings_path = out.with_suffix(".timings.jsonl")
    done = read_done(out)
    if not sampling.stop_token_ids:
        from dataclasses import replace

        sampling = replace(sampling, stop_token_ids=target.tokenizer.eos_token_ids)
    todo = sum((i.id, a.name) not in done for i in items for a in arms)
    bar = tqdm(total=todo, unit="answer", desc=f"{task.name}", disable=not progress, dynamic_ncols=True)
    with open(out, "a") as res_f, open(timings_path, "a") as time_f:
        for item in items:
            pending = [a for a in arms if (item.id, a.name) not in done]
            if not pending:
                continue
            ids = source.encode(list(item.messages))
            src_cache = None
            for arm in pending:
                t0 = time.perf_counter()
                record = {"task": task.name, "item": item.id, "arm": arm.name, "gold": item.gold}
                if arm.kind in ("target", "source"):
                    llm = target if arm.kind == "target" else source
                    comp = llm.generate([list(item.messages)], sampling)[0]
                    text, n_new, phases = comp.text, len(comp.tokens), dict(llm.timings)
                else:
                    shared = not SELECTORS.get(arm.selector) or not SELECTORS[arm.selector].needs_source_attention
                    if src_cache is None and shared:
                        src_cache, _ = source.runner.prefill([ids], max_len=len(ids))
                    cache, logits, res = handoff(
                        source.runner, target.runner, mapper, [ids], HandoffConfig(arm.rho, arm.selector),
                        max_len=len(ids) + sampling.max_new_tokens,
                        source_cache=src_cache if shared else None, source_from=[len(ids)] if shared else None)
                    gen = decode(target.runner, cache, logits, torch.tensor([len(ids)]), sampling)[0]
                    text, n_new, phases = target.tokenizer.decode(gen.tokens), len(gen.tokens), res.timings
                    record["recomputed"] = len(res.positions[0])
                    record["position0"] = 0 in res.positions[0]
                record.update(task.score(item, text), prompt_tokens=len(ids), new_tokens=n_new, text=text)
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
