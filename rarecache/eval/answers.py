"""What an arm answers on an item, and the one rule for whether two answers agree.

A multiple-choice row's answer is the SET of its top-scoring choices: one choice, or several when their
scores are exactly equal (a tie). Two answers agree when the sets are equal, so a tie agrees only with the
same tie: an arm that picks A where the target cannot tell A from B has moved the target's answer, and one
that ties A and B where the target says A has too. Counting a tie by the first tied choice (as `prediction`
does, for accuracy) would call an undecided model decided; counting it as agreeing with any of its members
would let a tie agree with answers that disagree with each other. Ties are reported beside (`tie`,
`eval report`'s ties column), so how many rows the rule touched is on record. A generated answer (GSM8K's
extracted number, CoQA's answer line) is a set of one.

Rows written before 2026-12-07 record no set: a `correct` row with its choices' log-likelihoods has its set
read from them; an acc_norm row (whose normalisation needs the choices' lengths, not recorded) keeps its
one recorded choice. Every agreement figure (`eval report`, the fidelity and general summaries, the gate's
changed answers, research/scripts/adopt_rules.py) goes through `same_answer`.
"""

from __future__ import annotations

from collections import Counter

PREDICTION = {"correct": "prediction", "correct_norm": "prediction_norm"}  # the choice each metric scores
TOP = {"correct": "top", "correct_norm": "top_norm"}  # the set of top-scoring choices (a list in the record)
TIE = {"correct": "tie", "correct_norm": "tie_norm"}


def top_choices(scores: list[float]) -> list[int]:
    """Every choice whose score equals the highest, in order: the answer as a set."""
    best = max(scores)
    return [k for k, s in enumerate(scores) if s == best]


def answer_field(metric: str) -> str | None:
    """The record field holding the answer `metric` scores: the chosen choice (acc_norm: the length-
    normalised one) or a generated answer (GSM8K's extracted number, CoQA's answer line). None for bits
    per byte: the likelihood of a fixed text gives no answer to agree on (reports give its paired Δ)."""
    return None if metric == "bpb" else PREDICTION.get(metric, "prediction")


def _choices(row: dict, metric: str) -> tuple | None:
    """The set of top-scoring choices where the record gives it: `top`/`top_norm`, or for an older `correct`
    row its choices' log-likelihoods; None otherwise (a generated answer, an older acc_norm row)."""
    top = TOP.get(metric)
    if top is not None and isinstance(row.get(top), list):
        return tuple(row[top])
    pick = row.get("prediction")
    if metric == "correct" and isinstance(row.get("logprobs"), list) and isinstance(pick, int) \
            and not isinstance(pick, bool):
        return tuple(top_choices(row["logprobs"]))  # a record from before the set was kept
    return None


def answer(row: dict, metric: str) -> tuple | None:
    """The answer `row` gives under `metric`, as a tuple: its top-scoring choices, or its one generated
    answer (or recorded choice); None where it gives none (bits per byte, or no answer field)."""
    field = answer_field(metric)
    if field is None or field not in row:
        return None
    return _choices(row, metric) or (row[field],)


def tied(row: dict, metric: str) -> bool | None:
    """Whether `row`'s answer under `metric` is a tie of several choices; None where the record cannot say
    (a generated answer, bits per byte, an acc_norm row from before the set was kept)."""
    choices = _choices(row, metric)
    return None if choices is None else len(choices) > 1


def same_answer(a: dict, b: dict, metric: str) -> bool:
    """The one agreement rule: the two rows' answers are the same set (module docstring)."""
    return answer(a, metric) == answer(b, metric)


def _pairs(rows: list[dict], arm: str, metric: str, items: set[str] | None) -> dict[str, tuple[dict, dict]] | None:
    """Per item both answered (only `items` when given): (the target's row, `arm`'s). None for bits per
    byte, which scores a fixed text and gives no answer."""
    if answer_field(metric) is None:
        return None
    by: dict[str, dict[str, dict]] = {"target": {}, arm: {}}
    for r in rows:
        if r["arm"] in by and (items is None or r["item"] in items) and answer(r, metric) is not None:
            by[r["arm"]][r["item"]] = r
    return {i: (by["target"][i], r) for i, r in by[arm].items() if i in by["target"]}


def agrees(rows: list[dict], arm: str, metric: str, items: set[str] | None = None) -> dict[str, bool]:
    """Per item both answered (only `items` when given): whether `arm`'s answer is the target's own
    (`same_answer`). Empty for bits per byte, which scores a fixed text and gives no answer."""
    return {i: same_answer(t, a, metric) for i, (t, a) in (_pairs(rows, arm, metric, items) or {}).items()}


def agreement(rows: list[dict], arm: str, metric: str, items: set[str] | None = None) -> tuple[float | None, int]:
    """The share of items whose answer under `arm` is the target's own on the same item, and on how many
    items (both answered; only `items` when given). (None, 0) for bits per byte or no such item."""
    same = agrees(rows, arm, metric, items)
    return (sum(same.values()) / len(same), len(same)) if same else (None, 0)


def kappa(rows: list[dict], arm: str, metric: str, items: set[str] | None = None) -> float | None:
    """Cohen's κ between `arm`'s answers and the target's on the items both answered: agreement beyond what
    the two answers' frequencies give by chance, (p_o − p_e) / (1 − p_e), each answer (a tie's set too) one
    category. Agreement alone can be bought by answering the target's favourite choice (the 0.5B agrees with
    the 1.5B on 48% of MMLU items by answering B on 79% of them, where the 1.5B answers B on 56%: κ 0.02); κ
    cannot. None for bits per byte, no item, or chance agreement 1 (both always give one answer)."""
    pairs = [(repr(answer(t, metric)), repr(answer(a, metric)))  # (repr: any JSON value counts as a key)
             for t, a in (_pairs(rows, arm, metric, items) or {}).values()]
    if not pairs:
        return None
    n = len(pairs)
    t, a = Counter(p[0] for p in pairs), Counter(p[1] for p in pairs)
    observed = sum(x == y for x, y in pairs) / n
    chance = sum(t[c] * a[c] for c in t) / n ** 2
    return None if chance >= 1 else (observed - chance) / (1 - chance)


def ties(rows: list[dict], arm: str, metric: str) -> tuple[int, int] | None:
    """How many of `arm`'s answers under `metric` are ties, of how many whose record can say; None where none
    can (bits per byte, a generated answer, acc_norm records from before the set was kept)."""
    flags = [f for r in rows if r["arm"] == arm and (f := tied(r, metric)) is not None]
    return (sum(flags), len(flags)) if flags else None
