"""Calibration text apart from evaluated text: the line-by-line disjointness rule.

A map calibrated on an item it is then evaluated on would flatter itself. The general mix
(`eval/mix.py`) drops any document that shares a line with an evaluated item of a registered
task, and `check_disjoint_from_tasks` refuses any corpus that does; both use the one rule here.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

from ..errors import RarecacheError
from ..transfer.fitting.corpus import Corpus

Doc = str | tuple[dict[str, str], ...]  # plain text, or chat messages
MIN_LINE = 40  # shorter lines (instructions, "Answer:", answer letters) are shared by design


def lines(texts: Iterable[str]) -> set[str]:
    """Short hashes of every line of at least MIN_LINE characters, whitespace normalised."""
    out = set()
    for t in texts:
        for line in t.splitlines():
            line = " ".join(line.split())
            if len(line) >= MIN_LINE:
                out.add(hashlib.sha256(line.encode()).hexdigest()[:16])
    return out


def doc_texts(doc: Doc) -> list[str]:
    return [doc] if isinstance(doc, str) else [m["content"] for m in doc]


def doc_lines(doc: Doc) -> set[str]:
    return lines(doc_texts(doc))


def item_texts(item) -> list[str]:
    return [m["content"] for m in item.messages] + list(item.continuations) + ([item.text] if item.text else [])


def evaluated_lines(tasks: dict[str, object]) -> set[str]:
    """The lines of every evaluated item of every task, prompt and continuations."""
    return lines(t for task in tasks.values() for item in task.items() for t in item_texts(item))


def check_disjoint_from_tasks(corpus: Corpus, tasks: dict[str, object]) -> dict[str, int]:
    """Refuse the corpus if any line (of at least MIN_LINE characters, whitespace normalised) of any
    evaluated item of any task, prompt or continuation, appears in a calibration document.
    Returns the number of evaluated items checked per task."""
    mix = lines(t for d in corpus.documents for t in doc_texts(d))
    checked = {}
    for name, task in tasks.items():
        items = task.items()
        for item in items:
            if lines(item_texts(item)) & mix:
                raise RarecacheError(f"the {corpus.name} calibration corpus shares text with evaluated item "
                                     f"{item.id} of {name}: not disjoint")
        checked[name] = len(items)
    return checked
