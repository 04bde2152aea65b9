"""The general mix's long share: the long-context tasks' held-apart items, whole, in their own format.

Why: the served map is fitted on documents of at most 1,024 tokens of chat, code, math and prose, and the prompts a
handoff pays for are 2k-4k tokens of documents, files and conversations, then a question. A map fitted on
multi-document QA's own held-apart items, with the same recompute, keeps 86% of the 1.5B's multidoc answers where the
served map keeps 79% (research/LOG.md §20). `general-v4` (eval/mix.py) adds this share to v3's mix so that one map
serves both: every long-context task's calibration items at the lengths a calibration sequence holds, each its prompt
with the gold answer as the reply. Screened as v10 (2 documents a round) and v11 (8, `general-v5`): neither reached the
task map's figure (81% and 80%; research/fidelity/ADOPTION.md rules 17-18), so both mixes stay candidates, kept so
that their maps can be made again.

Disjointness: the items come from each task's calibration pool, whose sources (paragraphs, essay and code lines,
keys) are checked apart from every evaluated item's (`calibration_corpus`). The mix's line rule (eval/disjoint.py)
would drop them all, since each task repeats its instruction in every item; so for these documents the lines that
recur in at least TEMPLATE_SHARE of a task's evaluated items (its instruction, a synthetic project's shared helpers)
are the task's template and may be shared; any other shared line drops the document.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from ..registry import LONG_TASKS
from .disjoint import Doc, item_texts, lines

LENGTHS = (1024, 2048)  # whole in a calibration sequence of general-v4 (SEQ_LEN_LONG)
TEMPLATE_SHARE = 0.1  # a line in at least this share of a task's evaluated items is its template


def template_lines(items: Iterable) -> set[str]:
    """Line hashes (`disjoint.lines`) found in at least TEMPLATE_SHARE of `items`."""
    items = list(items)
    seen = Counter(h for item in items for h in lines(item_texts(item)))
    return {h for h, n in seen.items() if n >= TEMPLATE_SHARE * len(items)}


def answer(gold) -> str:
    """The reply a calibration document ends with: the gold answer (the first, where several are accepted)."""
    return gold if isinstance(gold, str) else str(gold[0])


def long_documents(tasks: dict[str, object], names: Iterable[str] = LONG_TASKS
                   ) -> tuple[list[tuple[str, Doc]], set[str]]:
    """(item id, prompt + gold reply) for every calibration item at LENGTHS of each long-context task `names` in
    `tasks` that can build its items (opened with a tokenizer), and the template lines those documents may share
    with evaluated items. Each task's calibration sources are checked disjoint from its evaluated items' first."""
    docs, template = [], set()
    for name in names:
        task = tasks.get(name)
        if task is None or getattr(task, "tokenizer", None) is None:
            continue
        task.calibration_corpus()  # refuses a pool that shares a source with an evaluated item
        template |= template_lines(task.items())
        for item in task.calibration_items():
            if item.extra["length"] in LENGTHS:
                docs.append((item.id, (*item.messages, {"role": "assistant", "content": answer(item.gold)})))
    return docs, template
