"""general-v4's long share (eval/mix_long.py): the long-context tasks' held-apart items, whole, their template
lines shared by design and nothing else."""

from __future__ import annotations

import pytest

from rarecache.errors import RarecacheError
from rarecache.eval import mix, mix_long
from rarecache.eval.disjoint import lines
from rarecache.eval.tasks.base import Item
from rarecache.registry import LONG_TASKS

INSTRUCTION = "Answer the question using the documents below. Give only the answer, in a few words."
TAKEN = "The Halvorsen bridge was finished in 1931 by a crew of forty masons from the valley."


def _item(iid, body, gold, length=1024, sources=()):
    return Item(iid, ({"role": "user", "content": f"{INSTRUCTION}\n\n{body}\n\nQuestion: who?"},), gold,
                {"length": length, "sources": sorted(sources)})


class _LongToy:
    """A long-context task's surface: items, calibration items, calibration_corpus's source check."""

    def __init__(self, evaluated, calibration, tokenizer=object()):
        self.tokenizer, self.evaluated, self.calibration = tokenizer, evaluated, calibration
        self.checked = False

    def items(self):
        return self.evaluated

    def calibration_items(self):
        return self.calibration

    def calibration_corpus(self):
        self.checked = True
        shared = {s for i in self.calibration for s in i.extra["sources"]} & {
            s for i in self.evaluated for s in i.extra["sources"]}
        if shared:
            raise RarecacheError(f"toy: {len(shared)} evaluated item(s) were used for calibration")


def _evaluated(n=20):
    return [_item(f"e-{k}", f"Paragraph {k} says something only item {k} holds, at some length here.", "x",
                  sources=[f"p{k}"]) for k in range(n)]


def test_documents_are_whole_items_with_the_gold_reply_at_the_lengths_a_sequence_holds():
    cal = [_item("c-0", "A calibration paragraph long enough to be a line of its own, held apart.", ["Oslo", "oslo"]),
           _item("c-1", "Another held-apart paragraph, long enough to count as a line in the rule.", "1931",
                 length=2048),
           _item("c-2", "A paragraph at 4k tokens, cut by a 2,048-token calibration sequence: left out.", "no",
                 length=4096)]
    toy = _LongToy(_evaluated(), cal)
    docs, template = mix_long.long_documents({"multidoc_qa": toy}, names=("multidoc_qa",))
    assert toy.checked  # the task's own source rule ran
    assert [i for i, _ in docs] == ["c-0", "c-1"]
    assert docs[0][1] == (*cal[0].messages, {"role": "assistant", "content": "Oslo"})
    assert docs[1][1][-1] == {"role": "assistant", "content": "1931"}
    assert template == lines([INSTRUCTION])  # in every evaluated item; each paragraph in one of 20 (< 10%)


def test_a_task_that_cannot_build_its_items_gives_none():
    toy = _LongToy(_evaluated(), [_item("c-0", TAKEN, "x")], tokenizer=None)
    assert mix_long.long_documents({"multidoc_qa": toy, "gsm8k": object()}) == ([], set())


def test_a_pool_sharing_a_source_with_an_evaluated_item_is_refused():
    toy = _LongToy(_evaluated(), [_item("c-0", TAKEN, "x", sources=["p3"])])
    with pytest.raises(RarecacheError, match="used for calibration"):
        mix_long.long_documents({"code_qa": toy}, names=("code_qa",))


def test_the_mix_keeps_template_lines_and_drops_any_other_shared_line(monkeypatch):
    evaluated = _evaluated() + [_item("e-taken", TAKEN, "1931")]
    cal = [_item("c-0", "A held-apart paragraph, long enough to be a line of its own in the rule.", "a"),
           _item("c-1", TAKEN, "1931")]  # an evaluated item's paragraph: dropped though its sources say apart
    toy = _LongToy(evaluated, cal)
    monkeypatch.setitem(mix.MIXES, "general-v4", (mix.Component(
        "long-toy", 1, "toy", None, lambda tasks: mix_long.long_documents(tasks, names=("retrieval",))),))
    corpus, dropped = mix.general_corpus({"retrieval": toy}, preset="general-v4")
    assert corpus.ids == ("c-0",) and dropped == 1 and corpus.name == "general-v4"
    # a template line is allowed only in the documents built from the tasks, not in the others
    monkeypatch.setitem(mix.MIXES, "general-v4", (mix.Component("plain", 1, "toy", lambda c: [("d", INSTRUCTION)]),))
    assert mix.general_corpus({"retrieval": toy}, preset="general-v4")[0].ids == ()


@pytest.mark.parametrize("preset,weight", [("general-v4", 2), ("general-v5", 8)])
def test_v4_and_v5_are_v3_and_one_long_component_per_task(preset, weight):
    v3, v = mix.components("general-v3"), mix.components(preset)
    assert v[: len(v3)] == v3
    long = v[len(v3):]
    assert [c.name for c in long] == [f"long-{t}" for t in LONG_TASKS]
    assert sum(c.weight for c in long) == pytest.approx(weight) and all(c.build is None and c.from_tasks for c in long)
    assert mix.seq_len(preset) == 2048 and mix.seq_len("general-v3") == mix.seq_len("general") == 1024
    # without the tasks (nothing to build the items with) the long share is empty and v3's documents come first
    assert all(c.from_tasks({}) == ([], set()) for c in long)


def test_a_map_whose_documents_hold_an_evaluated_item_is_refused_whatever_its_corpus():
    from types import SimpleNamespace

    from rarecache.eval.tasks.base import Task

    class Toy(Task):
        name = "multidoc_qa"

    items = _evaluated(3)

    def mapper(ids):
        return SimpleNamespace(info=SimpleNamespace(corpus={"name": "general-v4"},
                                                    calibration={"document_ids": ids}), refined_ids=lambda: set())

    Toy().check_map(mapper(["squad:Oxygen:35", "multidoc_qa-cal-T2048-0003"]), items)  # held-apart ids: fine
    with pytest.raises(RarecacheError, match="1 evaluated item"):
        Toy().check_map(mapper(["squad:Oxygen:35", "e-1"]), items)


def test_the_long_tasks_named_in_the_registry_are_the_long_context_tasks():
    from rarecache.eval.tasks import LONG_CONTEXT, TASKS, LongContextTask

    assert LONG_TASKS == LONG_CONTEXT == tuple(n for n, t in TASKS.items() if issubclass(t, LongContextTask))
