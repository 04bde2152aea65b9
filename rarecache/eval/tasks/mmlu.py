"""MMLU, 57 subjects: 0-shot, direct answer (the RaReCache paper, arXiv 2610.11358, §4.1), scored by
the likelihood of the letter.

Letters are scored from a float32 LM head (`eval run` on likelihood tasks): a bfloat16 head puts the four
log-probabilities on a grid of 1/16 nats or coarser, where 11 of 300 of the 1.5B's answers were exact ties
that went to the first letter. A tie left in float32 is recorded (`tie`, `top`) and agrees only with the
same tie (eval/answers.py).

The chat prompt states the subject, the question and four lettered options and
asks for the letter; each letter is a continuation of the assistant turn and the
most likely one is the answer (acc; every continuation is one character, so
acc_norm is the same). Evaluation reads the test split, subjects interleaved so
that any prefix of the items spans every subject; calibration reads the
validation split. Item ids hash the question and options, so the disjointness
check compares content: a validation question that also appears in the test
split is left out of the calibration pool.
"""

from __future__ import annotations

import hashlib

from ..data import olmo_arrow_tables
from .base import Item, Task, choice_fields, minus_evaluated

LETTERS = "ABCD"


def _prompt(row: dict) -> str:
    subject = row["subject"].replace("_", " ")
    options = "\n".join(f"{letter}. {text}" for letter, text in zip(LETTERS, row["choices"]))
    return (f"The following is a multiple choice question about {subject}. Answer with the letter of the "
            f"correct option.\n\n{row['question'].strip()}\n{options}\nAnswer:")


def _item(row: dict) -> Item:
    key = hashlib.sha1((row["question"] + "\x00" + "\x00".join(row["choices"])).encode()).hexdigest()[:12]
    return Item(f"mmlu-{row['subject']}-{key}", ({"role": "user", "content": _prompt(row)},), int(row["answer"]),
                {"subject": row["subject"]}, tuple(LETTERS[: len(row["choices"])]))


def interleave(by_subject: dict[str, list[Item]]) -> list[Item]:
    """Round robin over subjects in name order: item k of every subject before item k + 1 of any."""
    out, seen = [], set()
    lists = [by_subject[s] for s in sorted(by_subject)]
    for k in range(max((len(v) for v in lists), default=0)):
        for v in lists:
            if k < len(v) and v[k].id not in seen:  # a question repeated within a split counts once
                seen.add(v[k].id)
                out.append(v[k])
    return out


class MMLU(Task):
    metric = "correct"
    kind = "likelihood"
    chance = 0.25

    def _split(self, split: str) -> list[Item]:
        by_subject: dict[str, list[Item]] = {}
        for path, rows in olmo_arrow_tables("hails/mmlu_no_train", self.cache_dir).items():
            subject, _, name = path.rpartition("/")
            if name == split:
                by_subject[subject] = [_item(r) for r in rows]
        return interleave(by_subject)

    def items(self) -> list[Item]:
        return self._split("test")

    def calibration_items(self) -> list[Item]:
        return minus_evaluated(self._split("validation"), self.items(), f"{self.name}: calibration pool (validation)")

    def score_likelihood(self, item: Item, logprobs: list[float]) -> dict:
        return {"logprobs": logprobs, **choice_fields(logprobs, item.gold)}
