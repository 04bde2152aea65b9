"""Prefix-conditioned perplexity on Wikipedia text (the protocol of the closed-form KV mapping paper,
arXiv 2608.03893), as a registry task.

Each item is a passage of a packed token stream: a 512-token prefix is the
handed-off prompt (raw text, no chat template) and the next 512 tokens are the
scored continuation, so every arm, selector and budget is compared on the same
text. Passages come from the second half of the exllamav2 `wiki` corpus; the first
half is the calibration pool, and a map fitted on this corpus (the generic `wiki`
maps) is refused if it read any document a passage comes from.
"""

from __future__ import annotations

from ...errors import RarecacheError
from ...transfer.fitting.corpus import load_corpus
from .base import Item, Task, gold_bpb

PREFIX = 512
CONTINUATION = 512


class WikiPerplexity(Task):
    metric = "bpb"
    kind = "likelihood"
    corpus = "wiki"

    def _corpus(self):
        return load_corpus(self.corpus, cache_dir=self.cache_dir)

    def first_document(self) -> int:
        return len(self._corpus().documents) // 2

    def items(self) -> list[Item]:
        if self.tokenizer is None:
            raise RarecacheError(f"{self.name} cuts passages in tokens: construct it with the models' tokenizer")
        corpus, first = self._corpus(), self.first_document()
        items, stream, start_doc = [], [], first
        for d, doc in enumerate(corpus.documents[first:], first):
            stream += self.tokenizer.encode(doc + "\n\n", add_special_tokens=False)
            while len(stream) >= PREFIX + CONTINUATION:
                prefix, cont = stream[:PREFIX], stream[PREFIX : PREFIX + CONTINUATION]
                items.append(Item(f"{self.name}-{len(items)}", (), None, {"first_document": start_doc,
                                                                          "last_document": d},
                                  (self.tokenizer.decode(cont),), text=self.tokenizer.decode(prefix)))
                stream, start_doc = stream[PREFIX + CONTINUATION :], d
        return items

    def calibration_items(self) -> list[Item]:
        return [Item(f"{self.name}-doc{d}", (), None, text=doc)
                for d, doc in enumerate(self._corpus().documents[: self.first_document()])]

    def calibration_corpus(self):
        """The generic corpus itself (`rarecache calibrate --corpus wiki` reads the same documents)."""
        return self._corpus()

    def check_map(self, mapper, items: list[Item]) -> None:
        corpus = self._corpus()
        if mapper.info.corpus.get("fingerprint") == corpus.fingerprint:
            used = mapper.info.calibration.get("documents_used", 0)
            first = min(i.extra["first_document"] for i in items)
            if used > first:
                raise RarecacheError(f"{self.name}: the map read {corpus.name} documents 0..{used - 1}; the passages "
                                     f"start at document {first}")

    def score_likelihood(self, item: Item, logprobs: list[float]) -> dict:
        return gold_bpb(item, logprobs)
