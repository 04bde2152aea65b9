"""The package's shape, checked from its source: the import directions docs/ARCHITECTURE.md tables (rooms,
and the sub-rooms of transfer/ and adapters/vllm/), no import circle (imports inside functions count: hiding
one there does not break it), no module past 400 lines, no module file name used twice (outside commands/),
every package path ARCHITECTURE.md names exists, and no path into docs/ or research/ that code could open at
run time."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "rarecache"
ARCHITECTURE = PKG.parent / "docs" / "ARCHITECTURE.md"
MAX_LINES = 400

# room -> the rooms it may import (docs/ARCHITECTURE.md, "Import directions"); a room imports itself freely
ALLOWED = {
    "errors": set(),
    "registry": {"errors"},
    "packages": {"errors"},
    "defaults": {"errors", "packages", "registry"},
    "dtypes": {"errors"},
    "models": {"errors", "packages"},
    "engine": {"models", "errors", "dtypes"},
    "transfer": {"registry", "defaults", "engine", "models", "errors", "packages", "dtypes"},
    "eval": {"registry", "transfer", "engine", "models", "errors", "packages", "dtypes"},
    "serve": {"registry", "defaults", "transfer", "engine", "models", "errors", "dtypes"},
    "bench": {"registry", "defaults", "serve", "transfer", "engine", "models", "errors", "dtypes"},
    "adapters": {"registry", "defaults", "transfer", "engine", "models", "errors", "packages", "serve", "dtypes"},
    "demo": {"registry", "defaults", "transfer", "engine", "models", "errors", "dtypes"},
    "commands": {"registry", "errors", "packages", "defaults", "dtypes", "models", "engine", "transfer", "eval", "serve", "bench",
                 "adapters", "demo", "commands"},
    "cli": {"commands", "errors"},
}
ADAPTERS_MAY_IMPORT_SERVE = "adapters/vllm/server/"  # the serving layer: the contract it shares with our engine
COMMANDS_MAY_IMPORT_ADAPTERS = {"commands/serve.py", "commands/bench_vllm.py"}
# sub-room -> the sub-rooms of the same room it may import (docs/ARCHITECTURE.md, "Inside transfer/ and
# adapters/vllm/"); a module's sub-room is its folder, and a room's folders not listed here are not sub-rooms
SUBROOMS = {
    "transfer": {"transfer/gate"},  # the runtime path: the gate from conversation.py only, never fitting
    "transfer/gate": {"transfer"},
    "transfer/fitting": {"transfer"},
    "adapters/vllm": set(),
    "adapters/vllm/rowstore": {"adapters/vllm"},
    "adapters/vllm/connector": {"adapters/vllm", "adapters/vllm/rowstore"},
    "adapters/vllm/server": {"adapters/vllm", "adapters/vllm/connector", "adapters/vllm/rowstore"},
}
TRANSFER_MAY_IMPORT_GATE = {"transfer/conversation.py"}


def _modules() -> dict[str, Path]:
    """'rarecache.transfer.mapper' -> its file, for every module of the package."""
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        parts = path.relative_to(PKG.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """The package modules `name` imports anywhere in its file (module level or inside a function)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            # `from . import x` names a submodule when one exists, else something the package defines
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in MODULES else mod for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in MODULES and "." in t:
                t = t.rsplit(".", 1)[0]
            if t in MODULES and t != name:
                found.add(t)
    return found


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _room(name: str) -> str | None:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else None  # None: the package's own __init__ (lazy exports of everything)


def test_import_directions():
    wrong = []
    for name, targets in GRAPH.items():
        room, rel = _room(name), str(MODULES[name].relative_to(PKG))
        if room is None:
            continue
        for t in targets:
            other = _room(t)
            if other is None:
                wrong.append(f"{rel} imports the package root")
            elif other == room:
                continue
            elif other not in ALLOWED[room]:
                wrong.append(f"{rel} imports {t}")
            elif room == "adapters" and other == "serve" and not rel.startswith(ADAPTERS_MAY_IMPORT_SERVE):
                wrong.append(f"{rel} imports {t} (only the serving layer may)")
            elif room == "commands" and other == "adapters" and rel not in COMMANDS_MAY_IMPORT_ADAPTERS:
                wrong.append(f"{rel} imports {t} (only serve and bench_vllm may)")
    assert not wrong, "imports against docs/ARCHITECTURE.md's directions:\n" + "\n".join(wrong)


def _subroom(path: Path) -> str | None:
    folder = path.parent.relative_to(PKG).as_posix()
    return folder if folder in SUBROOMS else None


def test_sub_room_directions():
    wrong = []
    for name, targets in GRAPH.items():
        here, rel = _subroom(MODULES[name]), MODULES[name].relative_to(PKG).as_posix()
        if here is None:
            continue
        for t in targets:
            there = _subroom(MODULES[t])
            if there is None or there == here or there.split("/")[0] != here.split("/")[0]:
                continue  # another room (test_import_directions), or the same sub-room
            if there not in SUBROOMS[here]:
                wrong.append(f"{rel} imports {t}")
            elif there == "transfer/gate" and rel not in TRANSFER_MAY_IMPORT_GATE:
                wrong.append(f"{rel} imports {t} (only {', '.join(sorted(TRANSFER_MAY_IMPORT_GATE))} may)")
    assert not wrong, "imports against the sub-rooms of docs/ARCHITECTURE.md:\n" + "\n".join(wrong)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_cycle_finder_finds_a_hidden_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle():
    assert _cycles(GRAPH) == []


@pytest.mark.parametrize("name", sorted(MODULES))
def test_module_size(name):
    lines = len(MODULES[name].read_text().splitlines())
    assert lines <= MAX_LINES, f"{MODULES[name].relative_to(PKG)} has {lines} lines (split it along a seam)"


def _repeated_names(paths: list[Path]) -> dict[str, list[str]]:
    """File name -> where, for module file names used more than once outside commands/ (where a command's
    module may share its subject's name) and __init__.py."""
    where: dict[str, list[str]] = {}
    for path in paths:
        rel = path.relative_to(PKG).as_posix()
        if path.name != "__init__.py" and not rel.startswith("commands/"):
            where.setdefault(path.name, []).append(rel)
    return {n: w for n, w in where.items() if len(w) > 1}


def test_no_module_file_name_repeats():
    assert _repeated_names(list(MODULES.values())) == {}


def test_the_name_check_finds_a_repeat():
    names = [PKG / p for p in ("serve/store.py", "models/store.py", "commands/eval.py", "eval/__init__.py",
                               "commands/store.py", "eval/run.py")]
    assert _repeated_names(names) == {"store.py": ["serve/store.py", "models/store.py"]}


def _named_paths(text: str) -> list[str]:
    """The module paths a page names in backticks (`transfer/handoff.py`, `rarecache/registry.py`, `store_dir.py`)."""
    return re.findall(r"`([\w/]+\.py)\b", text)


def _missing_paths(named: list[str]) -> list[str]:
    """Those that name no file: a path from the package (or the repository) root, or a bare name that is no
    module's file name (names are unique, test_no_module_file_name_repeats) and no test's."""
    names = {p.name for p in MODULES.values()} | {p.name for p in (PKG.parent / "tests").glob("*.py")}
    missing = []
    for n in named:
        if "/" not in n:
            ok = n in names
        else:
            ok = (PKG / n).is_file() or (PKG.parent / n).is_file()
        if not ok:
            missing.append(n)
    return missing


def test_every_path_architecture_names_exists():
    named = _named_paths(ARCHITECTURE.read_text())
    assert len(named) > 50  # the page names its modules
    assert _missing_paths(named) == []


def test_the_path_check_finds_a_missing_file():
    assert _missing_paths(_named_paths("`transfer/handoff.py` and `handoff.py`, `transfer/gate_pass.py`, "
                                       "`rarecache/registry.py`, `gate_pass.py`")) == ["transfer/gate_pass.py",
                                                                                      "gate_pass.py"]


def _table_rooms(text: str) -> dict[str, set[str]]:
    """ARCHITECTURE.md's import-directions table: room -> the rooms its row names (paths in backticks that
    go below a room, e.g. `adapters/vllm/server/`, name no room; "anything above" names every room above)."""
    rows = re.search(r"\| room \| may import \|\n\|---\|---\|\n((?:\|.*\|\n)+)", text).group(1)
    out: dict[str, set[str]] = {}
    for line in rows.splitlines():
        room_cell, cell = [c.strip() for c in line.strip("|").split("|", 1)]
        room = room_cell.strip("`").removesuffix("/").removesuffix(".py")
        cell = re.sub(r"`[^`]*/[^`]+`|`[^`]*\.py`", "", cell)  # deeper paths and files: not rooms
        named = {w for w in re.findall(r"[a-z]+", cell) if w in ALLOWED}
        out[room] = set(out) | {room} if cell.startswith("anything above") else named
    return out


def test_the_architecture_table_is_the_structure_test_s():
    assert _table_rooms(ARCHITECTURE.read_text()) == ALLOWED


def _code_strings(tree: ast.AST):
    """String constants that are not docstrings."""
    docs = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docs.add(id(first.value))
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            yield node


def test_no_path_into_docs_or_research():
    # help texts may point a user at a manual ("see docs/VLLM.md"); a string that *is* such a path could be opened
    found = [f"{p.relative_to(PKG)}:{n.lineno} {n.value!r}" for p in MODULES.values()
             for n in _code_strings(ast.parse(p.read_text()))
             if n.value.lstrip("./").startswith(("docs/", "research/")) or n.value in ("docs", "research")]
    assert not found, "paths into docs/ or research/ in package code:\n" + "\n".join(found)


def test_no_machine_path_in_any_tracked_file():
    # a record or a doc names where a run kept its files as RUNS/ or OUT/, never one machine's home folder
    import subprocess

    root = PKG.parent
    try:
        files = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    found = []
    for name in filter(None, files.decode().split("\0")):
        path = root / name
        if path.suffix in {".gz", ".png", ".safetensors"} or not path.is_file():
            continue
        text = path.read_bytes()
        for home in (b"/root/", b"/home/"):
            if home in text and name != "tests/test_structure.py":
                found.append(f"{name}: {home.decode()}")
    assert not found, "machine paths in tracked files:\n" + "\n".join(found)
