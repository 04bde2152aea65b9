"""Questions over one document among many: `multidoc_qa` (HotpotQA's gold paragraphs among distractor
paragraphs) and `passage_qa_gen` (a CoQA story among other stories, its first question answered in words).

Both score the generated answer line by F1 and exact match against the gold answers (SQuAD-normalised), and
place the gold text as one block at the item's depth (0-100% of the documents' tokens).

`multidoc_qa`: a HotpotQA question whose answer is a span (not yes/no) found in its supporting paragraphs; the
question's own distractor paragraphs first, then other paragraphs of its pool, none holding the answer, so the
gold paragraphs are where it is read. `passage_qa_gen` is `coqa_passage` generated rather than scored in bits
per byte, with the story among others: CoQA's evaluated stories (the last `coqa.CALIBRATION_STORIES` calibrate,
as CoQA's tasks split them), the question naming its story's number.
"""

from __future__ import annotations

from ...errors import RarecacheError
from .coqa import CALIBRATION_STORIES, _stories
from .longctx import DEPTHS, LongContextTask, contains, place, qa_score, seeded
from .longctx_data import hotpot_pool

MULTIDOC_ASK = ("Answer the question using the documents below. Give only the answer, in a few words, "
                "with no explanation.")
STORY_ASK = ("Read the stories below, then answer the question about one of them in a few words, using that "
             "story.")


class MultiDocQA(LongContextTask):
    metric = "f1"
    max_new_tokens = 48

    def _questions(self, split: str) -> list:
        """The pool's span-answer questions whose answer is in the supporting paragraphs, in a seeded order
        (item k asks question k at every length)."""
        qs = [q for q in hotpot_pool(self.name, split, self.cache_dir).questions
              if q.answer.lower() not in ("yes", "no") and contains(" ".join(x for _, x in q.gold), q.answer)]
        seeded(self.name, split).shuffle(qs)
        return qs

    def build(self, split: str, T: int, k: int):
        questions = self.memo(("questions", split), lambda: self._questions(split))
        if k >= len(questions):
            raise RarecacheError(f"{self.name}: the {split} pool has {len(questions)} questions; item {k} asks for more")
        q = questions[k]
        paragraphs = hotpot_pool(self.name, split, self.cache_dir).paragraphs
        rng = seeded(self.name, split, T, k)
        depth = DEPTHS[k % len(DEPTHS)]
        gold_titles = {t for t, _ in q.gold}
        start = rng.randrange(len(paragraphs))
        seen = set(gold_titles)
        others = (p for p in (*q.others, *paragraphs[start:], *paragraphs[:start])  # its own ones first
                  if not (p[0] in seen or seen.add(p[0])) and not contains(p[1], q.answer))  # (read lazily)
        block = "\n\n".join(f"{t}\n{x}" for t, x in q.gold)  # the gold paragraphs, placed together

        def render(chosen: list[tuple[str, str]]) -> list[dict]:
            docs = place([f"{t}\n{x}" for t, x in chosen], [(block, depth)], self.cost)
            parts = [d for unit in docs for d in (unit.split("\n\n") if unit == block else [unit])]
            text = "\n\n".join(f"Document [{n}] {d}" for n, d in enumerate(parts, 1))
            return [{"role": "user", "content": f"{MULTIDOC_ASK}\n\n{text}\n\nQuestion: {q.question}"}]

        messages, chosen = self.fill(T, render, others, lambda p: self.cost(f"\n\nDocument [10] {p[0]}\n{p[1]}"),
                                     lambda p, n: (p[0], x) if (x := self.sentences(p[1], n - 12)) else None)
        used = (*gold_titles, *(t for t, _ in chosen))
        return self.item(split, T, k, messages, [q.answer], [f"para:{t}" for t in used], depth=depth, question=q.index)

    def score(self, item, text: str) -> dict:
        return {**qa_score(item.gold, text), **self.fields(item)}


class PassageQAGen(LongContextTask):
    metric = "f1"
    max_new_tokens = 48

    def _pool(self, split: str) -> list:
        """CoQA's stories of `split`: the last CALIBRATION_STORIES calibrate, as CoQA's own tasks split them."""
        stories = self.memo("stories", lambda: _stories(self.cache_dir))
        return stories[-CALIBRATION_STORIES:] if split == "calibration" else stories[:-CALIBRATION_STORIES]

    def _order(self, stories: list, T: int) -> list[int]:
        """The stories in a seeded order, those longer than half of T left out: item k asks the k-th (the same
        story at every length it fits)."""
        order = list(range(len(stories)))
        seeded(self.name, len(stories)).shuffle(order)
        return [i for i in order if self.cost(stories[i][1].strip()) <= T // 2]

    def build(self, split: str, T: int, k: int):
        stories = self._pool(split)
        story, passage, qa, answers = stories[self.memo(("order", split, T), lambda: self._order(stories, T))[k]]
        rng = seeded(self.name, split, T, k)
        depth = DEPTHS[k % len(DEPTHS)]
        start = rng.randrange(len(stories))
        others = [s for s in stories[start:] + stories[:start] if s[0] != story]
        gold = passage.strip()

        def render(chosen: list[tuple[str, str]]) -> list[dict]:
            docs = place([text for _, text in chosen], [(gold, depth)], self.cost)
            text = "\n\n".join(f"Story {m}:\n{d}" for m, d in enumerate(docs, 1))
            return [{"role": "user", "content": f"{STORY_ASK}\n\n{text}\n\nQuestion about story "
                                                f"{docs.index(gold) + 1}: {qa[0]['question']}"}]

        messages, chosen = self.fill(T, render, [(s[0], s[1].strip()) for s in others],
                                     lambda u: self.cost(f"\n\nStory 10:\n{u[1]}"),
                                     lambda u, n: (u[0], x) if (x := self.sentences(u[1], n - 8)) else None)
        used = [sid for sid, _ in chosen]
        golds = answers.get(1, [qa[0]["answer"]])
        return self.item(split, T, k, messages, golds, [f"story:{s}" for s in (story, *used)], depth=depth,
                         story=story)

    def score(self, item, text: str) -> dict:
        return {**qa_score(item.gold, text), **self.fields(item)}
