"""The general calibration mix: fixed proportions in every prefix, disjointness from evaluated items."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from rarecache.defaults import SERVED
from rarecache.errors import RarecacheError
from rarecache.eval import disjoint, mix
from rarecache.eval.tasks.base import Item, Task
from rarecache.transfer.mapper import Mapper


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
    monkeypatch.setitem(mix.MIXES, mix.SERVED_MIX, (mix.Component("only", 1, "toy", lambda cache_dir: list(docs)),))
    corpus, dropped = mix.general_corpus({"toy": _Toy([f"Question: {QUESTION}", f"  {QUESTION}  "])})
    assert dropped == 1 and corpus.ids == ("m:1",) and corpus.chat
    # whitespace is normalised: the evaluated prompt's second item matched despite its padding
    with pytest.raises(RarecacheError, match="toy-1 of toy"):
        disjoint.check_disjoint_from_tasks(mix.Corpus("general", (docs[0][1],), chat=True), {"toy": _Toy(["x", QUESTION])})
    # lines shorter than MIN_LINE (instructions, answer letters) are shared by design
    short = "Answer:"
    assert len(short) < disjoint.MIN_LINE
    assert disjoint.check_disjoint_from_tasks(mix.Corpus("general", (short,), chat=True), {"toy": _Toy([short])}) == {"toy": 1}


def test_mix_order_is_deterministic(monkeypatch):
    docs = [(f"d:{i}", f"document number {i} with enough characters to be a line of its own") for i in range(50)]
    monkeypatch.setitem(mix.MIXES, mix.SERVED_MIX, (mix.Component("a", 2, "toy", lambda c: list(docs[:25])),
                                                mix.Component("b", 1, "toy", lambda c: list(docs[25:]))))
    one, _ = mix.general_corpus({})
    two, _ = mix.general_corpus({})
    assert one.ids == two.ids and one.fingerprint == two.fingerprint and sorted(one.ids) == sorted(i for i, _ in docs)


def _rows(n):
    return [(f"prealgebra:{i}", {"problem": f"Tom has ${i}$ apples and buys $3$ more. How many apples does he have now?",
                                  "solution": f"He has ${i} + 3 = \\boxed{{{i + 3}}}$ apples.", "answer": str(i + 3)})
            for i in range(n)] + [("geometry:0", {"problem": "[asy] draw((0,0)--(1,1)); [/asy] Find the angle.",
                                                  "solution": "It is $\\boxed{45^\\circ}$.", "answer": "45^\\circ"})]


def test_plain_math_reduces_simple_latex_and_refuses_the_rest():
    assert mix.plain_math({"problem": "What is $\\frac{1}{2} \\cdot 6$?", "answer": "3",
                           "solution": "We get $\\frac{1}{2} \\cdot 6 = \\boxed{3}$, costing \\$3."}) == (
        "What is 1/2 * 6?", "We get 1/2 * 6 = 3, costing $3.", "3")
    assert mix.plain_math({"problem": "Find $x$.", "solution": "$\\sqrt{2}$", "answer": "\\sqrt{2}"}) is None
    assert mix.plain_math(_rows(1)[-1][1]) is None  # a figure


def test_math_chains_are_worked_examples_then_a_problem_answered_by_its_own_solution(monkeypatch):
    monkeypatch.setattr(mix, "_math_rows", lambda cache_dir: _rows(40))
    chains = mix._math_chains(None)
    assert len(chains) == 40 and len({i for i, _ in chains}) == 40  # every plain problem ends at most one chain
    for key, (user, reply) in chains:
        n = int(key.rsplit(":", 1)[1])
        assert user["role"] == "user" and reply["role"] == "assistant"
        assert reply["content"].startswith(f"He has {n} + 3 = {n + 3} apples.") and reply["content"].endswith(f"{n + 3}.")
        blocks = user["content"].split("\n\n")
        assert blocks[0] in mix.CHAIN_ASKS and 4 <= len(blocks) - 2 <= 8
        question, answer_tag = blocks[-1].rsplit("\n", 1)
        assert question.endswith(f"Tom has {n} apples and buys 3 more. How many apples does he have now?")
        assert answer_tag in [a.strip() for _, a, _ in mix.CHAIN_FORMATS] and f"has {n} apples" not in "".join(blocks[1:-1])
        assert all(str(int(b.split(" has ")[1].split()[0]) + 3) + "." in b for b in blocks[1:-1])  # closed by answers
    assert mix._math_chains(None) == chains  # deterministic
    # the math component keeps only what no chain can use
    assert [i for i, _ in mix._math(None)] == ["math:geometry:0"]


def test_the_general_preset_sharpens_plain_transfer_only_and_a_head_matched_map_whole():
    """--preset general: a plain ridge fit with plain transfer's sharpening recorded; head-matched maps (one
    fit for every budget) take the preset's sharpening as their fit's, as before; given powers win."""
    from types import SimpleNamespace

    from rarecache.commands.maps import _sharpening
    from rarecache.eval.mix import SHARPEN

    def args(**kw):
        return SimpleNamespace(**{"sharpen": None, "plain_sharpen": None, "head_matched": False, **kw})

    assert _sharpening(args(), True) == {"sharpen": (0.0, 0.0), "plain_sharpen": SHARPEN}
    assert _sharpening(args(head_matched=True), True) == {"sharpen": SHARPEN, "plain_sharpen": None}
    assert _sharpening(args(sharpen=[0.5, 0.5]), True) == {"sharpen": (0.5, 0.5), "plain_sharpen": None}
    assert _sharpening(args(plain_sharpen=[2.0, 1.0]), True) == {"sharpen": (0.0, 0.0), "plain_sharpen": (2.0, 1.0)}
    assert _sharpening(args(), False) == {"sharpen": (0.0, 0.0), "plain_sharpen": None}


def test_word_chains_are_gsm8k_shaped_prompts_of_other_problems_answered_by_their_own_solution(monkeypatch):
    problems = [(f"gsm8k-{1000 + i}", f"Sam has {i} pens and buys 2 more. How many pens does Sam have?",
                 f"Sam has {i} + 2 = {i + 2} pens. So the answer is {i + 2}.") for i in range(20)]
    monkeypatch.setattr(mix, "word_problems", lambda cache_dir=None: problems)
    chains = mix._word_chains(None)
    assert len(chains) == 20 and len({k for k, _ in chains}) == 20
    for (key, (user, reply)), (pid, question, solution) in zip(chains, problems):
        assert key == f"word:{pid}" and reply == {"role": "assistant", "content": solution}
        text = user["content"]
        assert text.startswith(mix.WORD_ASK) and text.endswith(f"\n\nQuestion: {question}\nAnswer:")
        shots = text.count("\nAnswer: ")
        assert shots == mix.WORD_SHOTS and text.count(question) == 1  # eight others, never its own
    assert mix._word_chains(None) == chains  # deterministic


def _recorded_names(monkeypatch) -> dict[str, str]:
    """The corpus name a map of each preset records: v2's maps say "general" (made when v2 was --preset
    general), v3's "general-v3"."""
    for name in list(mix.MIXES):
        monkeypatch.setitem(mix.MIXES, name, (mix.Component("only", 1, "toy", lambda c: [("d:0", "text")]),))
    return {p: mix.general_corpus({}, preset=p)[0].name for p in ("general", "general-v2", "general-v3")}


def _v2_map() -> Path:
    """v2's map (served until v3), no longer in the tree (docs/RESULTS.md, "Maps that are no longer in the
    tree", says how to put it back): $RARECACHE_V2_MAP, else $RARECACHE_HOME/maps/general-64k.safetensors."""
    from rarecache.packages import default_cache_dir

    env = os.environ.get("RARECACHE_V2_MAP")
    return Path(env).expanduser() if env else default_cache_dir() / "maps" / "general-64k.safetensors"


def test_general_is_the_v3_mix_and_each_mix_records_the_name_its_maps_carry(monkeypatch):
    assert mix.components("general") == mix.components("general-v3") == mix.COMPONENTS_V3
    assert mix.components("general-v2") == mix.COMPONENTS and "word" not in [c.name for c in mix.COMPONENTS]
    assert mix.COMPONENTS_V3 == mix.COMPONENTS + (mix.COMPONENTS_V3[-1],) and mix.COMPONENTS_V3[-1].name == "word"
    with pytest.raises(RarecacheError, match="unknown preset"):
        mix.components("general-v9")
    names = _recorded_names(monkeypatch)
    assert names == {"general": "general-v3", "general-v2": "general", "general-v3": "general-v3"}
    for preset in ("general-v2", "general-v3"):
        assert mix.preset_of(names[preset]) == preset  # what makes a map of that name again
    committed = {"general-v3": "rarecache/data/general-v4-64k.safetensors"}  # v4 is fitted on v3's mix; v2's: below
    root = Path(__file__).resolve().parents[1]
    for preset, rel in committed.items():
        assert Mapper.load(root / rel).info.corpus["name"] == names[preset], rel
    assert "rarecache/" + SERVED.file == committed[mix.SERVED_MIX]  # the served file is the served mix's


def test_v2s_map_records_the_name_its_preset_makes(monkeypatch):
    path = _v2_map()
    if not path.is_file():
        pytest.skip(f"v2's map is no longer in the tree and is not at {path} (set RARECACHE_V2_MAP, or put it "
                    "there: docs/RESULTS.md, 'Maps that are no longer in the tree')")
    assert Mapper.load(path).info.corpus["name"] == _recorded_names(monkeypatch)["general-v2"], path


def test_every_preset_is_looked_up_through_the_registry():
    from rarecache.registry import PRESETS

    assert {n: mix.components(n) for n in PRESETS} == {mix.NAME: mix.MIXES[mix.SERVED_MIX], **mix.MIXES}
