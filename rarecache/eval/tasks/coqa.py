"""CoQA: conversational questions over a passage, the model switched mid-conversation.

An item is one turn t of one story: the passage and the first question open the
chat, the earlier turns follow with their gold answers, and turn t's question
ends the prompt. The switch happens at that turn: the conversation so far was
read by the source and is handed to the target, which answers (the closed-form KV mapping paper,
arXiv 2608.03893, §4.6, measures drift as the gap to the target alone, turn by turn; every row records
its turn). `coqa` generates the answer (F1 against the annotators' answers, as
the CoQA/SQuAD scorer normalises them); `coqa_bpb` scores the gold answer's bits
per byte instead (no generation). The data (OLMES' CoQA validation, 500 stories)
is split by story: the first 400 are evaluated, the last 100 are the
calibration pool, and disjointness is checked in code.

`coqa_passage` asks as a new user would: one story per item, its passage and
first question in one user turn, and scores the gold answer's bits per byte.
CoQA's answers are mostly read from the passage, so this measures what a
handoff keeps of text that was mapped, not of the newest turn (issue 41: the
`suffix` default loses most there). Its stories split as CoQA's do.
"""

from __future__ import annotations

import re
import string
from collections import Counter

from ..data import olmo_documents
from .base import Item, Task, gold_bpb

INSTRUCTION = "Read the passage, then answer each question in a few words, using the passage.\n\n"
PASSAGE_INSTRUCTION = "Read the passage, then answer the question in a few words, using the passage.\n\n"
MAX_TURNS = 10  # turns evaluated per story (the closed-form KV mapping paper plots turns 1-10)
CALIBRATION_STORIES = 100  # the last stories of the file


_PUNCTUATION = str.maketrans("", "", string.punctuation)


def normalise(text: str) -> str:
    text = text.lower().translate(_PUNCTUATION)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def f1(prediction: str, gold: str) -> float:
    p, g = normalise(prediction).split(), normalise(gold).split()
    if not p or not g:
        return float(p == g)
    same = sum((Counter(p) & Counter(g)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(p), same / len(g)
    return 2 * precision * recall / (precision + recall)


def _stories(cache_dir) -> list[tuple[str, str, list[dict], dict[int, list[str]]]]:
    """(story id, passage, every turn's question and answer, annotators' answers per turn)."""
    stories: dict[str, tuple[str, list[dict], dict[int, list[str]]]] = {}
    for r in olmo_documents("coqa/bpb_0shot", cache_dir):  # a document is one turn
        doc = r["doc"]
        story, _, index = doc["id"].rpartition("_turn")  # 0-based: "_turn0" is the first question
        if story not in stories:
            stories[story] = (doc["story"], doc["previous_qa"], {})
        stories[story][2][int(index) + 1] = [a for a in doc["answers"] if a.strip()] or [doc["choices"][0]]
    return [(k, *v) for k, v in stories.items()]


def _item(name: str, story: str, passage: str, qa: list[dict], answers: dict[int, list[str]], turn: int) -> Item:
    messages = [{"role": "user", "content": f"{INSTRUCTION}Passage: {passage.strip()}\n\nQuestion: {qa[0]['question']}"}]
    for k in range(1, turn):
        messages += [{"role": "assistant", "content": qa[k - 1]["answer"]},
                     {"role": "user", "content": f"Question: {qa[k]['question']}"}]
    gold = answers.get(turn, [qa[turn - 1]["answer"]])
    return Item(f"{name}-{story}-t{turn}", tuple(messages), gold, {"turn": turn, "story": story},
                (qa[turn - 1]["answer"],))


class CoQA(Task):
    metric = "f1"

    def _items(self, calibration: bool) -> list[Item]:
        stories = _stories(self.cache_dir)
        stories = stories[-CALIBRATION_STORIES:] if calibration else stories[:-CALIBRATION_STORIES]
        out = []
        for story, passage, qa, answers in stories:
            turns = min(MAX_TURNS, len(qa))
            if calibration:  # one conversation per story, as long as evaluated ones get
                out.append(_item(self.name, story, passage, qa, answers, turns))
            else:
                out += [_item(self.name, story, passage, qa, answers, t) for t in range(1, turns + 1)]
        return out

    def items(self) -> list[Item]:
        """Story by story, turns 1-10 of each (a --limit takes whole conversations first)."""
        return self._items(False)

    def calibration_items(self) -> list[Item]:
        return self._items(True)

    def answer_complete(self, text: str) -> bool:
        return "\n" in text.lstrip()  # the answer line is over

    def score(self, item: Item, text: str) -> dict:
        answer = text.strip().split("\n")[0]
        return {"prediction": answer, "f1": max(f1(answer, g) for g in item.gold), "turn": item.extra["turn"]}


class CoQABPB(CoQA):
    """Bits per byte of the gold answer after the handed-off conversation."""

    metric = "bpb"
    kind = "likelihood"

    def score_likelihood(self, item: Item, logprobs: list[float]) -> dict:
        return {**gold_bpb(item, logprobs), "turn": item.extra["turn"]}


def passage_item(name: str, story: str, passage: str, qa: list[dict], answers: dict[int, list[str]]) -> Item:
    """A story's passage and first question as one user turn; the continuation is the gold first answer."""
    content = f"{PASSAGE_INSTRUCTION}Passage: {passage.strip()}\n\nQuestion: {qa[0]['question']}"
    return Item(f"{name}-{story}", ({"role": "user", "content": content},), answers.get(1, [qa[0]["answer"]]),
                {"story": story}, (qa[0]["answer"],))


class CoQAPassage(CoQABPB):
    """Passage question answering: bits per byte of the gold answer to a story's first question, asked with
    the passage in one user turn. One item per story; the last CALIBRATION_STORIES stories calibrate."""

    def _items(self, calibration: bool) -> list[Item]:
        stories = _stories(self.cache_dir)
        stories = stories[-CALIBRATION_STORIES:] if calibration else stories[:-CALIBRATION_STORIES]
        return [passage_item(self.name, *s) for s in stories]

    def items(self) -> list[Item]:
        """One item per evaluated story, in the file's order."""
        return self._items(False)

    def score_likelihood(self, item: Item, logprobs: list[float]) -> dict:
        return gold_bpb(item, logprobs)
