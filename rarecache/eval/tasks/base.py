"""What a task provides: evaluation items, a disjoint calibration pool, scoring."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...errors import RarecacheError
from ...registry import TASKS as TASK_NAMES
from ...transfer.fitting.corpus import Corpus
from ..answers import top_choices


@dataclass(frozen=True)
class Item:
    id: str
    messages: tuple[dict[str, str], ...]  # chat prompt
    gold: Any
    extra: dict[str, Any] = field(default_factory=dict)
    continuations: tuple[str, ...] = ()  # likelihood tasks: texts scored after the prompt
    text: str | None = None  # a raw-text prompt (no chat template) instead of messages

    @property
    def prompt(self) -> str | list[dict[str, str]]:
        """What the models encode: the raw text, or the chat messages."""
        return self.text if self.text is not None else list(self.messages)


class Task:
    """A registered subclass's `name` is the one registry.py's TASKS gives it (`__init_subclass__`): each task
    name is written once, there. A class registered under none (a shared base, a file's task, a test's own)
    keeps what it says."""

    name = ""
    metric = ""  # the headline field of a result row
    kind = "generate"  # or "likelihood"
    chance = 0.0  # accuracy of guessing (for floor-normalised retention)
    max_new_tokens = 256  # generation tasks: the answer's token cap when `eval run` is given none
    batch = 8  # generation tasks: items whose arms decode together when `eval run` is given no --batch

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        names = TASK_NAMES.names_of(cls.__module__, cls.__qualname__)
        if len(names) == 1:
            cls.name = names[0]

    def __init__(self, cache_dir: Path | None = None, tokenizer: Any = None):
        self.cache_dir = cache_dir
        self.tokenizer = tokenizer  # for tasks cut in tokens (perplexity passages)

    def items(self) -> list[Item]:
        """Evaluation items, in a fixed order."""
        raise NotImplementedError

    def calibration_items(self) -> list[Item]:
        """Items kept apart from evaluation for task-shaped calibration."""
        raise NotImplementedError

    def answer_complete(self, text: str) -> bool:
        """Generation tasks: True once `text` holds a final answer (decoding stops there)."""
        return False

    def score(self, item: Item, text: str) -> dict[str, Any]:
        """Generation tasks: fields of the result row for a generated answer."""
        raise NotImplementedError

    def score_likelihood(self, item: Item, logprobs: list[float]) -> dict[str, Any]:
        """Likelihood tasks: fields of the result row given each continuation's total log-probability."""
        raise NotImplementedError

    def calibration_corpus(self) -> Corpus:
        """The calibration pool as prompts in the evaluated format, disjointness checked."""
        pool = self.calibration_items()
        check_disjoint([i.id for i in pool], [i.id for i in self.items()], self.name)
        return prompt_corpus(f"task:{self.name}", pool, [i.id for i in pool])

    def record(self) -> dict | None:
        """What identifies the task's data beyond its name, for the run record (a task file's sha256)."""
        return None

    def check_map(self, mapper, items: list[Item]) -> None:
        """Refuse a map fitted or refined on any of `items` (a map records the ids of the documents it was fitted
        on: a task's item ids, or the long-context tasks' held-apart ones in general-v4's mix; refined maps the
        task prompts they trained on)."""
        fitted = set(mapper.info.calibration.get("document_ids", []))
        check_disjoint(fitted | mapper.refined_ids(), [i.id for i in items], self.name)


def prompt_corpus(name: str, pool: list[Item], ids: list[str]) -> Corpus:
    """Chat items' prompts as a calibration corpus (a lone user turn as its text, a conversation as its
    messages); `ids` are what the map records for later disjointness checks."""
    docs = tuple(i.messages[0]["content"] if len(i.messages) == 1 else tuple(i.messages) for i in pool)
    return Corpus(name, docs, chat=True, ids=tuple(ids))


def choice_fields(scores: list[float], gold: int, suffix: str = "") -> dict[str, Any]:
    """One way of scoring choices: the pick (the first of the top-scoring choices; accuracy counts it), the
    set of top-scoring choices (`top`: the answer agreement compares, eval/answers.py) and whether that set
    is a tie of several."""
    top = top_choices(scores)
    return {f"prediction{suffix}": top[0], f"correct{suffix}": top[0] == gold, f"top{suffix}": top,
            f"tie{suffix}": len(top) > 1}


def choice_scores(item: Item, logprobs: list[float]) -> dict[str, Any]:
    """Multiple choice by likelihood: acc takes the continuation with the highest total log-probability,
    acc_norm divides it by the continuation's length in characters (lm-eval-harness's acc_norm)."""
    norm = [lp / max(len(c), 1) for lp, c in zip(logprobs, item.continuations)]
    return {"logprobs": logprobs, **choice_fields(logprobs, item.gold), **choice_fields(norm, item.gold, "_norm")}


def gold_bpb(item: Item, logprobs: list[float]) -> dict[str, Any]:
    """Bits per byte of an item's one gold continuation, from its total log-probability (nats)."""
    n_bytes = len(item.continuations[0].encode("utf-8"))
    return {"bpb": -logprobs[0] / (math.log(2) * n_bytes), "bytes": n_bytes}


def minus_evaluated(pool: list[Item], evaluated: list[Item], what: str) -> list[Item]:
    """A calibration pool read from a file that also holds the evaluated items (a full validation split
    of which a subset is evaluated), without them; how many were removed is printed. Disjointness is
    still checked where the pool is used (`Task.calibration_corpus`, `Task.check_map`)."""
    ids = {i.id for i in evaluated}
    kept = [i for i in pool if i.id not in ids]
    print(f"{what} minus the evaluated items: {len(pool) - len(kept)} of {len(pool)} removed", file=sys.stderr)
    return kept


def check_disjoint(calibration_ids, evaluated_ids, what: str) -> None:
    """Refuse an evaluation whose items were used to calibrate the map."""
    overlap = set(calibration_ids) & set(evaluated_ids)
    if overlap:
        some = ", ".join(sorted(overlap)[:5])
        raise RarecacheError(f"{what}: {len(overlap)} evaluated item(s) were used for calibration ({some} ...)")
