"""The one registry of names (rarecache/registry.py): each selector, task and preset name is written once in
the package, and each name looks up what it names."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from rarecache.errors import RarecacheError
from rarecache.registry import PRESETS, SELECTORS, TASKS, Names

PKG = Path(__file__).resolve().parents[1] / "rarecache"
# Files other branches are editing while this test was written (#56 phase A): their classes still spell their
# own names (`name = "rank"`), and handoff.py its schedule's. Merging them means the class reads its name from
# the registry (`Names.name_of`) and the file leaves this list; nothing else may spell a name.
PENDING = ("transfer/selectors.py", "transfer/handoff.py", "eval/tasks/")


def _literals() -> dict[str, list[str]]:
    """Every string constant of the package's code (docstrings aside) -> where it is written."""
    found: dict[str, list[str]] = {}
    for path in sorted(PKG.rglob("*.py")):
        rel = str(path.relative_to(PKG))
        if rel.startswith(PENDING):
            continue
        tree = ast.parse(path.read_text())
        docs = {id(n.body[0].value) for n in ast.walk(tree)
                if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.body
                and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
                found.setdefault(node.value, []).append(f"{rel}:{node.lineno}")
    return found


def test_each_name_is_written_once_in_the_package():
    literals = _literals()
    names = [*SELECTORS, *TASKS, *PRESETS]
    assert len(names) == len(set(names))  # no name means two things
    twice = {n: literals.get(n, []) for n in names if len(literals.get(n, [])) != 1}
    assert not twice, f"names written other than once (registry.py, or a constant there): {twice}"
    assert all(where[0].startswith("registry.py:") for n in names for where in [literals[n]])


def test_the_grep_finds_a_second_spelling(tmp_path, monkeypatch):
    """The check above can fail: a name written in another module is found."""
    fake = tmp_path / "rarecache"
    fake.mkdir()
    (fake / "registry.py").write_text('RANK = "rank"\n')
    (fake / "other.py").write_text('"""A docstring may say "rank"."""\nX = {"selector": "rank"}\n')
    monkeypatch.setitem(globals(), "PKG", fake)
    assert _literals()["rank"] == ["other.py:2", "registry.py:1"]


def test_every_name_looks_up_what_it_names():
    from rarecache.eval import mix
    from rarecache.eval.tasks import TASKS as TASK_CLASSES
    from rarecache.transfer.handoff import LAYER_PREFIX
    from rarecache.transfer.selectors import SELECTORS as SELECTOR_OBJECTS

    for name in SELECTORS:
        found = SELECTORS.load(name)
        if name == LAYER_PREFIX:
            assert found == name  # a schedule, not a selector
            continue
        assert SELECTOR_OBJECTS[name].name == name and isinstance(SELECTOR_OBJECTS[name], found)
        if found.__name__ != "QuerySelector":  # (a variant's name is its instance's, QUERY_VARIANTS)
            assert found.name == name
        assert found.oracle == (name in SELECTORS.oracles)
    assert set(SELECTOR_OBJECTS) | {LAYER_PREFIX} == set(SELECTORS)  # (until selectors.py reads the registry)
    for name in TASKS:
        assert TASKS.load(name).name == name and TASK_CLASSES[name] is TASKS.load(name)
    assert set(TASK_CLASSES) == set(TASKS)  # (until eval/tasks reads the registry)
    assert PRESETS.load(mix.NAME) is mix.MIXES[mix.SERVED_MIX]
    assert SELECTORS.name_of("rarecache.transfer.selectors", "Suffix") == "suffix"


def test_an_unknown_name_is_a_user_mistake():
    names = Names("thing", {"a": "rarecache.registry:RANK"}, oracles={"b": "rarecache.registry:RANDOM"})
    assert names.load("a") == "rank" and names.names == ("a", "b") and "b" in names
    assert names.help("a") == "a, b (oracle) (default: a)"
    with pytest.raises(RarecacheError, match="unknown thing 'c'; choose from a, b"):
        names.load("c")
    with pytest.raises(KeyError):
        names.name_of("rarecache.registry", "NOTHING")
