"""Prefix-conditioned perplexity (the mapping paper's protocol).

Each passage's continuation is scored by the target conditioned on a prefix cache
from (a) the target's own prefill, (b) the source's cache mapped into the target
(the target computes only the last prefix position, as in plain transfer), and
by (c) the source model alone. All arms score the same continuation tokens, so
the gap isolates the quality of the prefix KV. Passages are cut from documents a
map was not fitted on; the check is in code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm import tqdm

from ..engine.runner import Runner
from ..errors import RarecacheError
from ..models.tokenizer import Tokenizer
from ..transfer.fitting.corpus import Corpus
from ..transfer.mapper import Mapper

ARMS = ("target", "mapped", "source")


@dataclass
class PerplexityResult:
    nll: dict[str, list[float]]  # arm -> mean NLL per passage (nats/token)
    passages: int
    prefix: int
    continuation: int
    first_document: int

    def ppl(self, arm: str) -> float:
        vals = self.nll[arm]
        return math.exp(sum(vals) / len(vals))


def heldout_passages(corpus: Corpus, tokenizer: Tokenizer, mapper: Mapper | None, n: int, length: int,
                     first_document: int | None = None) -> tuple[list[list[int]], int]:
    """`n` passages of `length` tokens from documents the map did not see (a packed token stream)."""
    start = first_document if first_document is not None else 0
    if mapper is not None and mapper.info.corpus.get("fingerprint") == corpus.fingerprint:
        used = mapper.info.calibration["documents_used"]
        if start < used:
            if first_document is not None:
                raise RarecacheError(f"documents {first_document}..{used - 1} of {corpus.name} were used to fit the "
                                     "map; evaluate on later ones")
            start = used
    stream: list[int] = []
    passages = []
    for doc in corpus.documents[start:]:
        stream += tokenizer.encode(doc + "\n\n", add_special_tokens=False)
        while len(stream) >= length and len(passages) < n:
            passages.append(stream[:length])
            stream = stream[length:]
        if len(passages) == n:
            return passages, start
    raise RarecacheError(f"{corpus.name} has only {len(passages)} passages of {length} tokens after document {start}")


def _nll(logits: torch.Tensor, targets: list[int]) -> float:
    return F.cross_entropy(logits.float(), torch.tensor(targets, device=logits.device)).item()


@torch.inference_mode()
def passage_nll(source: Runner, target: Runner, mapper: Mapper, ids: list[int], prefix: int) -> dict[str, float]:
    n = len(ids)
    tokens = torch.tensor([ids])
    scored = ids[prefix:]
    at = torch.arange(prefix - 1, n - 1)[None]  # logits here predict the continuation
    out = {}
    for arm, runner in (("target", target), ("source", source)):
        cache = runner.new_cache(1, n)
        logits = runner.forward(tokens, torch.arange(n)[None], cache, logits_at=at).logits[0]
        out[arm] = _nll(logits, scored)
    src_cache = source.new_cache(1, prefix)
    source.forward(tokens[:, :prefix], torch.arange(prefix)[None], src_cache, logits_at=None)
    cache = target.new_cache(1, n)
    mapper.plain().apply(source, src_cache, target, cache, torch.arange(prefix)[None],
                         tokens=tokens[:, :prefix])  # plain transfer
    pos = torch.arange(prefix - 1, n - 1)[None]
    logits = target.forward(tokens[:, prefix - 1 : n - 1], pos, cache, logits_at="all").logits[0]
    out["mapped"] = _nll(logits, scored)
    return out


def prefix_perplexity(source: Runner, target: Runner, mapper: Mapper, passages: list[list[int]], prefix: int,
                      first_document: int, progress: bool = True) -> PerplexityResult:
    nll: dict[str, list[float]] = {a: [] for a in ARMS}
    for ids in tqdm(passages, desc="perplexity", unit="passage", disable=not progress, dynamic_ncols=True):
        for arm, v in passage_nll(source, target, mapper, ids, prefix).items():
            nll[arm].append(v)
    return PerplexityResult(nll, len(passages), prefix, len(passages[0]) - prefix, first_document)
