"""The selectors whose picks bring whole lines or paragraphs (`attn-source-line`, `attn-source-block`): the
tokenizer's line flags, where segments end, the pieces they are cut into and the order built from them."""

from __future__ import annotations

import random

import pytest
import torch

from rarecache.errors import RarecacheError
from rarecache.models.tokenizer import BLANK, LEADING_BREAK, LINE, TRAILING_BREAK, Tokenizer, line_flags
from rarecache.transfer.choice import budget, order_rank, pieces, segments, spans
from rarecache.transfer.handoff import HandoffConfig, handoff
from rarecache.transfer.selectors import SELECTORS, QueryConfig, text_ends


@pytest.mark.parametrize("text, flags", [
    ("a", 0), ("\n", LINE | LEADING_BREAK | TRAILING_BREAK), ("b\n", LINE | TRAILING_BREAK),
    ("\n  ", LINE | LEADING_BREAK | TRAILING_BREAK), ("  \n", LINE | LEADING_BREAK | TRAILING_BREAK),
    ("\n\n", LINE | BLANK | LEADING_BREAK | TRAILING_BREAK), (".\n\n", LINE | BLANK | TRAILING_BREAK),
    ("\r\n\r\n", LINE | BLANK | LEADING_BREAK | TRAILING_BREAK), ("x\r\n", LINE | TRAILING_BREAK),
    ("):\n   x", LINE), ("\n  \n  ", LINE | BLANK | LEADING_BREAK | TRAILING_BREAK), ("a\nb\nc", LINE)])
def test_line_flags_of_a_text(text, flags):
    assert line_flags(text) == flags


def test_break_flags_say_how_a_token_sits_in_lines(tok_dir):
    tok = Tokenizer.from_dir(tok_dir)
    flags = tok.break_flags(tok.vocab_size + 3)
    assert len(flags) == tok.vocab_size + 3 and flags[-3:] == [0, 0, 0]  # ids past the vocabulary: nothing
    for i in range(tok.vocab_size):
        text = tok.decode([i], skip_special_tokens=False)
        if text == "\n":
            assert flags[i] == LINE | LEADING_BREAK | TRAILING_BREAK
        elif "\n" not in text:
            assert flags[i] == 0, text
    newline = [i for i in range(tok.vocab_size) if tok.decode([i], skip_special_tokens=False) == "\n"]
    assert newline  # (the tiny vocabulary has the byte)


class _Flags:
    """A runner as far as `text_ends` reads one: per token id, its line flags."""

    def __init__(self, table):
        self.break_flags = torch.tensor(table, dtype=torch.uint8)


def test_lines_and_blocks_end_where_the_text_says():
    # ids: 0 "a", 1 "\n", 2 "\n\n", 3 "b\n" (ends a line), 4 "  \n" (starts and ends one)
    runner = _Flags([0, LINE | LEADING_BREAK | TRAILING_BREAK, LINE | BLANK | LEADING_BREAK | TRAILING_BREAK, LINE | TRAILING_BREAK,
                     LINE | LEADING_BREAK | TRAILING_BREAK])
    tokens = torch.tensor([[0, 3, 0, 2, 0, 3, 1, 0, 0, 4, 0]])
    assert text_ends(runner, tokens, "line")[0].nonzero().flatten().tolist() == [1, 3, 5, 6, 9]
    # a blank line in one token (3), or across two: "b\n" then "\n" (6); "a" then "  \n" is no blank line (9)
    assert text_ends(runner, tokens, "block")[0].nonzero().flatten().tolist() == [3, 6]
    with pytest.raises(RarecacheError, match="tokenizer"):
        text_ends(type("Bare", (), {"break_flags": None})(), tokens, "line")
    with pytest.raises(ValueError, match="a line or a block"):
        text_ends(runner, tokens, "para")


def test_pieces_cut_after_each_end_and_at_the_cap():
    ends = torch.tensor([[False, False, True, False, False, False, False, True, False]])
    assert pieces(ends, 3).tolist() == [[0, 0, 0, 1, 1, 1, 2, 2, 3]]
    assert pieces(ends, 100).tolist() == [[0, 0, 0, 1, 1, 1, 1, 1, 2]]
    assert pieces(torch.ones(1, 4, dtype=torch.bool), 5).tolist() == [[0, 1, 2, 3]]


def _slow_segments(key, ends, eligible, cap):
    """The order `segments` gives, position by position: by its piece's best eligible key, then its own."""
    W = len(key)
    piece, p, run = [], 0, 0
    for i in range(W):
        if i and (ends[i - 1] or run == cap):
            p, run = p + 1, 0
        piece.append(p)
        run += 1
    best = {q: max([key[i] for i in range(W) if piece[i] == q and eligible[i]], default=float("-inf"))
            for q in set(piece)}
    first = [best[piece[i]] if eligible[i] else float("-inf") for i in range(W)]
    own = [key[i] if eligible[i] else float("-inf") for i in range(W)]
    return sorted(range(W), key=lambda i: (-first[i], piece[i], -own[i], i))  # a tie of pieces: the earlier


@pytest.mark.parametrize("seed", range(20))
def test_segments_match_the_slow_reference(seed):
    rng = random.Random(seed)
    W, cap = rng.randrange(1, 40), rng.randrange(1, 9)
    key = [float(rng.randrange(6)) for _ in range(W)]  # ties on purpose
    ends = [rng.random() < 0.2 for _ in range(W)]
    eligible = [rng.random() < 0.85 for _ in range(W)]
    k, e, el = torch.tensor([key]), torch.tensor([ends]), torch.tensor([eligible])
    got = segments(k, pieces(e, cap), el)[0].argsort(descending=True, stable=True).tolist()
    assert got == _slow_segments(key, ends, eligible, cap)


def test_settings_are_checked():
    for bad in (dict(segment="para", piece=8), dict(segment="line"), dict(piece=8)):
        with pytest.raises(RarecacheError, match="bad query selector settings"):
            QueryConfig(source=True, **bad)
    with pytest.raises(RarecacheError, match="bad query selector settings"):  # segments: one pass only
        QueryConfig(segment="line", piece=8)
    with pytest.raises(ValueError, match="pass where they end"):
        SELECTORS["attn-source-line"].order(torch.ones(1, 1, 6), torch.arange(6)[None])


@pytest.mark.parametrize("name", ["attn-source-line", "attn-source-block"])
def test_a_pick_brings_its_whole_piece(fitted, pair_dir, name):
    """Through a handoff, given the source's attention (one peak inside the longest piece, noise elsewhere):
    the recomputed set is the peak's whole piece, then whole pieces by their best, the one the budget cuts,
    and the last position."""
    source, target, mapper, _ = fitted
    tok = Tokenizer.from_dir(pair_dir / "src")
    text = ("the quick brown fox\njumps over\n\nthe lazy dog\ndef add return\n\ntokens spaces the fox\nlazy dog "
            "jumps over the quick\nbrown fox\n\nthe end")
    ids = tok.encode(text)
    n = len(ids)
    sel = SELECTORS[name]
    ends = text_ends(target, torch.tensor([ids]), sel.config.segment)
    piece = pieces(ends, sel.config.piece)[0].tolist()
    groups = {p: {i for i in range(n) if piece[i] == p and i >= sel.config.sinks} for p in set(piece)}
    assert len(groups) > 3  # (the text has segments to choose among)
    longest = max(groups.values(), key=len)
    peak = sorted(longest)[len(longest) // 2]
    attn = torch.rand(1, n, generator=torch.Generator().manual_seed(0)) * 0.1
    attn[0, peak] = 5.0
    k = len(longest) + 3
    held = source.new_cache(1, n)  # the source holds the prompt and gives its attention: no prefill of its own
    source.forward(torch.tensor([ids]), torch.arange(n)[None], held, logits_at=None)
    _, _, res = handoff(source, target, mapper, [ids], HandoffConfig(k / n, name), source_cache=held,
                        source_kept=[n], source_attn=attn)
    chosen = set(res.positions[0])
    assert len(chosen) == k and longest <= chosen and n - 1 in chosen
    partial = [p for p, g in groups.items() if g & (chosen - {n - 1}) and not g <= chosen]
    assert len(partial) <= 1, (piece, sorted(chosen))


def test_a_batch_is_its_rows(fitted, pair_dir):
    """Two prompts of different lengths (the shorter padded) choose as one handoff each."""
    source, target, mapper, _ = fitted
    tok = Tokenizer.from_dir(pair_dir / "src")
    texts = ["the quick brown fox\njumps over\n\nthe lazy dog\ndef add return\n\ntokens spaces the fox",
             "lazy dog\n\njumps over the quick\nbrown fox"]
    prompts = [tok.encode(t) for t in texts]
    assert len(prompts[0]) != len(prompts[1])
    for name in ("attn-source-line", "attn-source-block"):
        cfg = HandoffConfig(0.4, name)
        _, logits, res = handoff(source, target, mapper, prompts, cfg)
        for b, ids in enumerate(prompts):
            _, one_logits, one = handoff(source, target, mapper, [ids], cfg)
            assert res.positions[b] == one.positions[0], name
            torch.testing.assert_close(logits[b], one_logits[0], rtol=1e-4, atol=1e-4)


def test_the_mix_takes_spans_and_blocks_in_turn(fitted, pair_dir):
    """`attn-source-mix` (rule 12): its first k picks hold the span order's first k/2 and the block order's
    first (k-1)/2 (a position on both counts once, so each may give more)."""
    source, target, mapper, _ = fitted
    tok = Tokenizer.from_dir(pair_dir / "src")
    ids = tok.encode("the quick brown fox\njumps over\n\nthe lazy dog\ndef add return\n\ntokens spaces the "
                     "fox\nlazy dog jumps over the quick\nbrown fox\n\nthe end of it all")
    n = len(ids)
    attn = torch.rand(1, n, generator=torch.Generator().manual_seed(1))
    positions = torch.arange(n)[None]
    sel = SELECTORS["attn-source-mix"]
    mix = sel.order(attn[:, None], positions, ends=sel.ends(target, torch.tensor([ids]), positions))[0]
    eligible = positions >= sel.config.sinks
    by_span = order_rank(spans(attn, sel.config.span, eligible))[0]
    by_block = order_rank(segments(attn, pieces(sel.ends(target, torch.tensor([ids]), positions),
                                                sel.config.piece), eligible))[0]
    assert not torch.equal(by_span, by_block)  # (the two orders differ here)
    for k in range(1, n - sel.config.sinks):
        first = set(mix.topk(k).indices.tolist())
        assert first >= {i for i in range(n) if by_span[i] < k / 2 or by_block[i] < (k - 1) / 2}, k
