"""Scoring continuations over a filled cache, and the template positions of a prompt.

Likelihood tasks score every continuation in batched passes over copies of the
context's rows: a continuation's rows are written before they are read and
positions past it are never visible, so each copy serves its choice exactly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..engine.cache import KVCache
from ..engine.runner import Runner
from ..transfer.conversation import common_prefix

SCORE_TOKENS = 512  # padded continuation tokens per scoring pass (bounds the (rows, width, vocab) logits)


def continuation_logprobs(runner: Runner, cache: KVCache, first: torch.Tensor, start: int,
                          continuations: list[list[int]]) -> list[list[list[float]]]:
    """Per-token log-probabilities of each continuation placed at positions start.., for every row
    of `cache` (A contexts whose prompt rows end at start - 1) with `first` (A, V) their last logits.
    Returns [context][continuation][token].

    Every (context, continuation) pair gets its own copy of the context's rows; pairs of similar
    length run together as padded batches of about SCORE_TOKENS tokens (one pass reads the
    weights once for all of them).
    """
    A = first.shape[0]
    first_lp = F.log_softmax(first.float(), -1)  # (A, V)
    out = [[[first_lp[a, cont[0]].item()] for cont in continuations] for a in range(A)]
    pairs = sorted(((a, c) for a in range(A) for c, cont in enumerate(continuations) if len(cont) > 1),
                   key=lambda p: len(continuations[p[1]]))
    i = 0
    while i < len(pairs):
        j = i + 1
        while j < len(pairs) and (j + 1 - i) * (len(continuations[pairs[j][1]]) - 1) <= SCORE_TOKENS:
            j += 1
        chunk, i = pairs[i:j], j
        width = len(continuations[chunk[-1][1]]) - 1  # the last token of each is only predicted
        rows = torch.tensor([a for a, _ in chunk], device=cache.k.device)
        batch = runner.new_cache(len(chunk), start + width)
        batch.k[:, :, :, :start] = cache.k[:, rows, :, :start]
        batch.v[:, :, :, :start] = cache.v[:, rows, :, :start]
        batch.filled[:, :start] = cache.filled[rows, :start]
        toks = torch.zeros(len(chunk), width, dtype=torch.long)
        pos = torch.full((len(chunk), width), -1, dtype=torch.long)
        for r, (_, c) in enumerate(chunk):
            n = len(continuations[c]) - 1
            toks[r, :n] = torch.tensor(continuations[c][:-1])
            pos[r, :n] = torch.arange(start, start + n)
        lp = F.log_softmax(runner.forward(toks.to(runner.device), pos, batch, logits_at="all").logits.float(), -1)
        for r, (a, c) in enumerate(chunk):
            cont = continuations[c]
            out[a][c] += lp[r, torch.arange(len(cont) - 1), torch.tensor(cont[1:])].tolist()
    return out


def template_mask(ids: list[int], reference: list[int]) -> list[bool]:
    """Positions in the text every prompt of the task shares (instruction, exemplars, chat template):
    the common prefix and common suffix with another item's prompt."""
    n, m = len(ids), len(reference)
    p = common_prefix(ids, reference)
    s = 0
    while s < min(n, m) - p and ids[n - 1 - s] == reference[m - 1 - s]:
        s += 1
    return [i < p or i >= n - s for i in range(n)]
