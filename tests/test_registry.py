"""The one registry of names (rarecache/registry.py): each selector, task and preset name is written once in
the package, and each name looks up what it names."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from rarecache.errors import RarecacheError
from rarecache.registry import PRESETS, SELECTORS, TASKS, Names

PKG = Path(__file__).resolve().parents[1] / "rarecache"
# the same text as a name, meaning something else, where it is written (not a second spelling of the name)
NOT_A_NAME = {("eval/tasks/multiple_choice.py", "query")}  # OLMES's field for the question (QUESTION)


def _literals() -> dict[str, list[str]]:
    """Every string constant of the package's code (docstrings aside) -> where it is written."""
    found: dict[str, list[str]] = {}
    for path in sorted(PKG.rglob("*.py")):
        rel = str(path.relative_to(PKG))
        tree = ast.parse(path.read_text())
        docs = {id(n.body[0].value) for n in ast.walk(tree)
                if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.body
                and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs \
                    and (rel, node.value) not in NOT_A_NAME:
                found.setdefault(node.value, []).append(f"{rel}:{node.lineno}")
    return found


def test_each_name_is_written_once_in_the_package():
    literals = _literals()
    names = [*SELECTORS, *TASKS, *PRESETS]
    assert len(names) == len(set(names))  # no name means two things
    twice = {n: literals.get(n, []) for n in names if len(literals.get(n, [])) != 1}
    assert not twice, f"names written other than once (registry.py, or a constant there): {twice}"
    assert all(where[0].startswith("registry.py:") for n in names for where in [literals[n]])
    for rel, text in NOT_A_NAME:  # an exemption still names a string written there
        tree = ast.parse((PKG / rel).read_text())
        assert any(isinstance(n, ast.Constant) and n.value == text for n in ast.walk(tree))


def test_the_grep_finds_a_second_spelling(tmp_path, monkeypatch):
    """The check above can fail: a name written in another module is found."""
    fake = tmp_path / "rarecache"
    fake.mkdir()
    (fake / "registry.py").write_text('RANK = "rank"\n')
    (fake / "other.py").write_text('"""A docstring may say "rank"."""\nX = {"selector": "rank"}\n')
    monkeypatch.setitem(globals(), "PKG", fake)
    assert _literals()["rank"] == ["other.py:2", "registry.py:1"]


def test_every_name_looks_up_what_it_names():
    from rarecache import registry
    from rarecache.eval import mix
    from rarecache.eval.tasks import TASKS as TASK_CLASSES
    from rarecache.transfer.handoff import LAYER_PREFIX
    from rarecache.transfer.selectors import QUERY_VARIANTS, SELECTORS as SELECTOR_OBJECTS, QuerySelector

    for name in SELECTORS:
        found = SELECTORS.load(name)
        if name == LAYER_PREFIX:
            assert found == name  # a schedule, not a selector
            continue
        assert SELECTOR_OBJECTS[name].name == name and isinstance(SELECTOR_OBJECTS[name], found)
        if found is QuerySelector:  # a variant's name is its instance's, its settings QUERY_VARIANTS'
            assert SELECTOR_OBJECTS[name].config is QUERY_VARIANTS[name]
        else:
            assert found.name == name
        assert SELECTOR_OBJECTS[name].oracle == (name in SELECTORS.oracles)
    assert set(SELECTOR_OBJECTS) | {LAYER_PREFIX} == set(SELECTORS)
    assert tuple(QUERY_VARIANTS) == registry.QUERY_VARIANTS
    for name in TASKS:
        assert TASKS.load(name).name == name and TASK_CLASSES[name] is TASKS.load(name)
    assert set(TASK_CLASSES) == set(TASKS)
    assert PRESETS.load(mix.NAME) is mix.MIXES[mix.SERVED_MIX]
    assert SELECTORS.name_of("rarecache.transfer.selectors", "Suffix") == "suffix"
    assert len(SELECTORS.names_of("rarecache.transfer.selectors", "QuerySelector")) == len(QUERY_VARIANTS)


def test_a_package_class_has_its_registered_name_or_none():
    """Every selector and task class in the package is registered (it reads its name there) or has no name of
    its own (a shared base, a file's task, QuerySelector whose instances are named): none spells one."""
    from rarecache.eval.tasks import TASKS as TASK_CLASSES
    from rarecache.eval.tasks.base import Task
    from rarecache.transfer.selectors import Selector

    def subclasses(cls):
        return [s for c in cls.__subclasses__() for s in (c, *subclasses(c))]

    for base, names in ((Selector, SELECTORS), (Task, TASKS)):
        for cls in subclasses(base):
            if not cls.__module__.startswith("rarecache."):
                continue  # a test's own
            registered = names.names_of(cls.__module__, cls.__qualname__)
            assert cls.name == (registered[0] if len(registered) == 1 else ""), cls
    assert {c.__name__ for c in subclasses(Task) if c.__module__.startswith("rarecache.") and not c.name} == {
        "OlmesChoice", "FileTask", "LongContextTask"}  # (bases, and a user's own file)
    assert len(TASK_CLASSES) == len(TASKS)


def test_a_class_registered_under_no_name_keeps_its_own():
    from rarecache.eval.tasks.base import Task
    from rarecache.transfer.selectors import Selector

    class Mine(Selector):
        name = "mine"

    class MyTask(Task):
        name = "my-task"

    assert (Mine.name, Mine.oracle, MyTask.name) == ("mine", False, "my-task")


def test_an_unknown_name_is_a_user_mistake():
    names = Names("thing", {"a": "rarecache.registry:RANK"}, oracles={"b": "rarecache.registry:RANDOM"})
    assert names.load("a") == "rank" and names.names == ("a", "b") and "b" in names
    assert names.help("a") == "a, b (oracle) (default: a)"
    with pytest.raises(RarecacheError, match="unknown thing 'c'; choose from a, b"):
        names.load("c")
    with pytest.raises(KeyError):
        names.name_of("rarecache.registry", "NOTHING")
