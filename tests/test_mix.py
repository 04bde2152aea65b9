"""The general calibration mix: fixed proportions in every prefix, disjointness from evaluated items."""

from __future__ import annotations

import pytest

from rarecache.errors import RarecacheError
from rarecache.eval import mix
from rarecache.eval.tasks.base import Item, Task


def test_interleave_keeps_proportions_in_every_prefix():
    pools = {"a": list(range(300)), "b": list(range(100)), "c": list(range(200))}
    merged = mix.interleave(pools, {"a": 3, "b": 1, "c": 2})
    assert len(merged) == 600
    for n in (6, 60, 300, 600):
        counts = {k: sum(1 for c, _ in merged[:n] if c == k) for k in pools}
        assert abs(counts["a"] - n / 2) <= 1 and abs(counts["b"] - n / 6) <= 1 and abs(counts["c"] - n / 3) <= 1
    for k in pools:  # each pool's own order is kept
        assert [x for c, x in merged if c == k] == pools[k]


def test_interleave_drops_exhausted_pools():
    merged = mix.interleave({"a": [1, 2], "b": list(range(10))}, {"a": 1, "b": 1})
    assert [c for c, _ in merged].count("a") == 2 and len(merged) == 12


class _Toy(Task):
    name = "toy"

    def __init__(self, prompts):
        super().__init__()
        self.prompts = prompts

    def items(self):
        return [Item(f"toy-{i}", ({"role": "user", "content": p},), None) for i, p in enumerate(self.prompts)]


QUESTION = "What is the smallest positive integer that is divisible by each of the first eight primes?"


def test_general_corpus_drops_documents_that_share_a_line_with_an_evaluated_item(monkeypatch):
    docs = [("m:0", ({"role": "user", "content": f"Solve this problem.\n\n{QUESTION}"},
                     {"role": "assistant", "content": "9699690"})),
            ("m:1", "A document about something else entirely, long enough to count as a line.")]
    monkeypatch.setattr(mix, "COMPONENTS", (mix.Component("only", 1, "toy", lambda cache_dir: list(docs)),))
    corpus, dropped = mix.general_corpus({"toy": _Toy([f"Question: {QUESTION}", f"  {QUESTION}  "])})
    assert dropped == 1 and corpus.ids == ("m:1",) and corpus.chat
    # whitespace is normalised: the evaluated prompt's second item matched despite its padding
    with pytest.raises(RarecacheError, match="toy-1 of toy"):
        mix.check_disjoint_from_tasks(mix.Corpus("general", (docs[0][1],), chat=True), {"toy": _Toy(["x", QUESTION])})
    # lines shorter than MIN_LINE (instructions, answer letters) are shared by design
    short = "Answer:"
    assert len(short) < mix.MIN_LINE
    assert mix.check_disjoint_from_tasks(mix.Corpus("general", (short,), chat=True), {"toy": _Toy([short])}) == {"toy": 1}


def test_mix_order_is_deterministic(monkeypatch):
    docs = [(f"d:{i}", f"document number {i} with enough characters to be a line of its own") for i in range(50)]
    monkeypatch.setattr(mix, "COMPONENTS", (mix.Component("a", 2, "toy", lambda c: list(docs[:25])),
                                            mix.Component("b", 1, "toy", lambda c: list(docs[25:]))))
    one, _ = mix.general_corpus({})
    two, _ = mix.general_corpus({})
    assert one.ids == two.ids and one.fingerprint == two.fingerprint and sorted(one.ids) == sorted(i for i, _ in docs)


def test_the_general_map_has_a_default_place_and_other_maps_need_out(tmp_path, pair_dir, capsys):
    from rarecache.cli import main
    from rarecache.eval.mix import general_map_path

    path = general_map_path("qwen2.5-coder-0.5b-instruct", str(tmp_path / "m" / "big.gguf"), tmp_path)
    assert path == tmp_path / "maps" / "general-qwen2.5-coder-0.5b-instruct-to-big.safetensors"
    src, tgt = str(pair_dir / "src"), str(pair_dir / "tgt")
    assert main(["calibrate", "--source", src, "--target", tgt, "--corpus", str(pair_dir / "corpus.txt")]) == 2
    assert "give --out FILE" in capsys.readouterr().err
