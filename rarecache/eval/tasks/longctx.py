"""Long-context fidelity tasks: answers read from a long handed-off prompt (issue 54).

A handoff pays where the prompt is long, and there the answer is read from mapped rows. These tasks build
such prompts from offline data (`longctx_data.py`): a fact, paragraphs, a definition or a story placed at a
chosen depth of about T tokens of other text, then a question, as chat messages. A task is built at each
of its `lengths`; `--length` picks one. Item k at length T is drawn from a seed of (task, split, T, k), so
the same command builds the same items on any machine, and a prompt is cut to at most T tokens as the
models encode it (chat template included) and no fewer than T − `slack(T)`.

What the rows hold: `prediction`, the answer normalised (SQuAD's rule, `coqa.normalise`; the number, for
the fact tasks), which is what `eval report` compares with the target's own answer on the same item for
agreement, and the gold score beside it (`correct`: the exact value found in the reply; `f1` and `em`
against the gold answers), with the item's length and depth.

The calibration pool comes from other text and other facts (separate pools, word lists and seeds); every
item lists what it is made of (`extra["sources"]`), and the pool's sources are checked disjoint from
every evaluated item's, at every length, where the pool is used.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from collections.abc import Callable, Iterable
from typing import Any

from ...errors import RarecacheError
from .base import Item, Task, check_disjoint
from .coqa import f1, normalise

SEED = 2026054
LENGTHS = (1024, 2048, 4096)
EVAL_ITEMS = 100  # per length (runs at 4k read the first 30)
CALIBRATION_ITEMS = 40  # per length
DEPTHS = tuple(i / 10 for i in range(11))  # item k sits at DEPTHS[k % 11]


def slack(length: int) -> int:
    """How far under its length a prompt may fall: filler comes in whole sentences, lines and paragraphs."""
    return length // 16


def seeded(*key: Any) -> random.Random:
    return random.Random(":".join(map(str, (SEED, *key))))


def first_fit(budget: int, candidates: Iterable[Any], cost: Callable[[Any], int], misses: int = 64) -> list[Any]:
    """Candidates in their order, each taken while it still fits in `budget` tokens; stops after `misses`
    candidates in a row did not fit (`misses` 1: the longest run of the first candidates that fits)."""
    out, used, missed = [], 0, 0
    for c in candidates:
        n = cost(c)
        if used + n <= budget:
            out.append(c)
            used, missed = used + n, 0
        elif (missed := missed + 1) >= misses:
            break
    return out


def depth_index(costs: list[int], depth: float) -> int:
    """Where a needle goes among filler units (0: before the first, len: after the last) to sit at `depth` of
    their tokens: the unit boundary whose share of tokens before it is nearest `depth`."""
    total, acc, best = max(sum(costs), 1), 0, (depth, 0)
    for j, c in enumerate(costs, 1):
        acc += c
        best = min(best, (abs(acc / total - depth), j))
    return best[1]


def place(filler: list[str], needles: list[tuple[str, float]], cost: Callable[[str], int]) -> list[str]:
    """`filler` with each needle inserted at its depth of the filler's tokens (later needles after earlier ones
    at the same boundary)."""
    costs = [cost(u) for u in filler]
    at = sorted(((depth_index(costs, d), j) for j, (_, d) in enumerate(needles)), reverse=True)
    out = list(filler)
    for index, j in at:
        out.insert(index, needles[j][0])
    return out


def answer_line(text: str) -> str:
    """The reply's first line: decoding stops at the end of the answer line."""
    return text.strip().split("\n")[0].strip()


def qa_score(golds: list[str], text: str) -> dict[str, Any]:
    """F1 and exact match against the best of `golds`, SQuAD-normalised; the normalised answer is the prediction."""
    line = answer_line(text)
    return {"prediction": normalise(line), "f1": max(f1(line, g) for g in golds),
            "em": float(any(normalise(line) == normalise(g) for g in golds))}


def value_score(value: str, text: str) -> dict[str, Any]:
    """A fact's value: correct when the reply's answer line holds exactly that number (not inside a longer one);
    the prediction is the line's first number (commas dropped), else the line normalised."""
    line = answer_line(text)
    numbers = re.findall(r"\d+", line.replace(",", ""))
    return {"prediction": numbers[0] if numbers else normalise(line), "correct": value in numbers}


def contains(text: str, phrase: str) -> bool:
    """Whether `phrase` occurs in `text` as whole words, both SQuAD-normalised."""
    return f" {normalise(phrase)} " in f" {normalise(text)} "


class LongContextTask(Task):
    """Items at each of `lengths` tokens; subclasses build one item (`build`) and score it."""

    lengths: tuple[int, ...] = LENGTHS
    max_new_tokens = 32
    # one item's arms decode together: a batch cache holds (items x arms) rows of T + answer tokens, and at 2048
    # tokens eight items of eleven arms held over 10 GB (two such runs were killed out of memory on 24 GiB)
    batch = 1

    def __init__(self, cache_dir=None, tokenizer=None, length: int | None = None):
        super().__init__(cache_dir, tokenizer)
        if length is not None and length not in self.lengths:
            raise RarecacheError(f"{self.name} is built at lengths {', '.join(map(str, self.lengths))} tokens, "
                                 f"not {length}")
        self.length = length
        self._built: dict[tuple[str, int], list[Item]] = {}
        self._costs: dict[str, int] = {}
        self._memo: dict[Any, Any] = {}

    def memo(self, key: Any, make: Callable[[], Any]) -> Any:
        """`make()`, once per task object (a pool read out of a data file)."""
        if key not in self._memo:
            self._memo[key] = make()
        return self._memo[key]

    # -- items ---------------------------------------------------------------------------------

    def items(self) -> list[Item]:
        """At the task's length, or at every length of the suite (what the calibration mix is checked against)."""
        return [i for T in ((self.length,) if self.length else self.lengths) for i in self._split("eval", T)]

    def calibration_items(self) -> list[Item]:
        return [i for T in ((self.length,) if self.length else self.lengths) for i in self._split("calibration", T)]

    def _split(self, split: str, T: int) -> list[Item]:
        if (split, T) not in self._built:
            if self.tokenizer is None:
                raise RarecacheError(f"{self.name} cuts its prompts in tokens: construct it with the models' tokenizer")
            n = EVAL_ITEMS if split == "eval" else CALIBRATION_ITEMS
            self._built[(split, T)] = [self.build(split, T, k) for k in range(n)]
        return self._built[(split, T)]

    def build(self, split: str, T: int, k: int) -> Item:
        """Item k of `split` ("eval" or "calibration") at length T."""
        raise NotImplementedError

    def item(self, split: str, T: int, k: int, messages: list[dict], gold: Any, sources: Iterable[str],
             **extra: Any) -> Item:
        tag = "" if split == "eval" else "cal-"
        return Item(f"{self.name}-{tag}T{T}-{k:04d}", tuple(messages), gold,
                    {"length": T, "sources": sorted(set(sources)), **extra})

    # -- cutting to a length -------------------------------------------------------------------

    def cost(self, text: str) -> int:
        """Tokens `text` adds to a prompt (memoised: filler repeats across items)."""
        if text not in self._costs:
            self._costs[text] = len(self.tokenizer.encode(text, add_special_tokens=False))
        return self._costs[text]

    def prompt_tokens(self, messages: list[dict]) -> int:
        return len(self.tokenizer.encode_chat(messages))

    def fill(self, T: int, render: Callable[[list], list[dict]], candidates: Iterable[Any],
             cost: Callable[[Any], int], cut: Callable[[Any, int], Any] | None = None,
             in_order: bool = False) -> tuple[list[dict], list[Any]]:
        """The prompt `render(units)` makes of filler units taken first-fit from `candidates`, of at most T tokens
        as the models encode it and at least T - slack(T), and the units. Unit costs are counted alone, so their
        sum misses what joining them adds or merges: the room is corrected by what the rendered prompt measures,
        and units come off the end while it is over T. `cut(unit, tokens)` (a unit shortened to about `tokens`,
        or None) tops a prompt of large units up with the start of one more. `in_order`: units are a running text
        (lines, blocks), taken as its first ones, none skipped but (where one will not cut to fit) the top-up's."""
        pool, total = [], 0
        for c in candidates:  # enough candidates to fill any room (a generator is read no further)
            pool.append(c)
            total += cost(c)
            if total > 2 * T + 2048:
                break
        room, best = T - self.prompt_tokens(render([])), (-1, [])
        for _ in range(6):  # the room moves by what the last choice measured over or under T
            chosen = first_fit(room, pool, cost, 1 if in_order else 64)
            got, used = self.prompt_tokens(render(chosen)), sum(map(cost, chosen))
            if got <= T and got > best[0]:
                best = (got, chosen)
            if T - slack(T) // 2 <= got <= T:
                break
            room = used + T - got if got < T else used - (got - T) - 1
        got, chosen = best if best[0] >= 0 else (got, chosen)
        while got > T and chosen:
            chosen = chosen[:-1]
            got = self.prompt_tokens(render(chosen))
        if cut is not None and got <= T:
            spare = pool[len(chosen):len(chosen) + 4] if in_order else [c for c in pool if c not in chosen][:16]
            chosen, got = self._top_up(T, render, spare, chosen, got, cut)
        if got > T:
            raise RarecacheError(f"{self.name}: the question alone is longer than {T} tokens")
        if got < T - slack(T):
            raise RarecacheError(f"{self.name}: a prompt of {got} tokens is too short for length {T} (its pool ran "
                                 "out of filler)")
        return render(chosen), chosen

    def _top_up(self, T: int, render, spare: list, chosen: list, got: int, cut) -> tuple[list, int]:
        """Cut pieces of `spare` units added while the prompt is more than a quarter of the slack under T."""
        for unit in spare:
            if got >= T - slack(T) // 4:
                break
            want = T - got
            for _ in range(3):
                piece = cut(unit, want)
                if piece is None:
                    break
                now = self.prompt_tokens(render(chosen + [piece]))
                if now <= T:
                    chosen, got = chosen + [piece], now
                    break
                want -= now - T
        return chosen, got

    def sentences(self, text: str, tokens: int) -> str | None:
        """The longest run of `text`'s first sentences of at most `tokens` tokens, or None."""
        out = None
        for m in re.finditer(r"[.!?](?=\s|$)", text):
            if len(self.tokenizer.encode(text[: m.end()], add_special_tokens=False)) > tokens:
                break
            out = text[: m.end()]
        return out

    # -- disjointness, record, scoring ---------------------------------------------------------

    def calibration_corpus(self):
        """The pool as prompts, its sources checked disjoint from every evaluated item's, at every length."""
        evaluated = [s for T in self.lengths for i in self._split("eval", T) for s in i.extra["sources"]]
        check_disjoint([s for i in self.calibration_items() for s in i.extra["sources"]], evaluated, self.name)
        return super().calibration_corpus()

    def record(self) -> dict | None:
        """The length and a hash of the items: a results file is resumed only with the items it began with."""
        if self.length is None:
            return None
        body = json.dumps([(i.id, i.messages, i.gold) for i in self.items()], sort_keys=True)
        return {"file": f"{self.name}@{self.length}", "length": self.length,
                "sha256": hashlib.sha256(body.encode()).hexdigest()}

    def answer_complete(self, text: str) -> bool:
        return "\n" in text.lstrip()  # the answer line is over

    def fields(self, item: Item) -> dict[str, Any]:
        """What a row records of the item beside its score."""
        return {k: item.extra[k] for k in ("length", "depth", "kind") if k in item.extra}
