"""Your own task from a JSONL file: `eval run --task FILE.jsonl`, with no class to write.

A serving engineer wants to know what a handoff costs on their own traffic, not only
on our benchmarks. One line is one item, in one of two forms (one form per file,
detected from the fields):

- multiple choice: `context` or `messages`, `choices` (>= 2 strings), `gold` (an index);
  each choice is scored as the assistant's reply, acc and acc_norm as the OLMES tasks
  score them (`choice_scores`);
- bits per byte: `context` or `messages`, `continuation`, scored by `gold_bpb`.

`context` is a lone user turn and `messages` a chat ending in a user turn, rendered
with the chat template as every built-in chat task builds its prompt; the answer text
is scored verbatim after the assistant turn opens. `id` is optional (else a hash of
the line's content) and must be unique. A calibration file (`calibrate --task FILE
--calibration CAL`) holds lines of the same forms or `{"text": ...}` (a user turn).

Files are data: read with json.loads only, and validated line by line, so a mistake
names the file, the line and the field. A map reads prompts only, so disjointness
compares the sha256 of each prompt (its messages as canonical JSON), never ids: a
calibration line with an evaluated item's prompt is refused when the corpus is built,
and a map whose recorded documents include an evaluated prompt is refused whatever
task name or file it was calibrated under.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...errors import RarecacheError
from ...transfer.fitting.corpus import Corpus
from .base import Item, Task, choice_scores, gold_bpb, prompt_corpus

# form: (the field that marks it, what it is called in messages)
FORMS = {"choice": ("choices", "multiple-choice"), "bpb": ("continuation", "bits-per-byte"),
         "text": ("text", "text")}
TASK_FORMS = ("choice", "bpb")
CALIBRATION_FORMS = ("choice", "bpb", "text")
ROLES = ("system", "user", "assistant")
HASH = "sha256:"  # prefix of a prompt hash among a map's recorded document ids


def _canonical(x: Any) -> bytes:
    return json.dumps(x, sort_keys=True, ensure_ascii=False, separators=(",", ":")).encode()


def prompt_sha256(messages) -> str:
    """The disjointness key: the prompt a map would read, as canonical JSON."""
    return hashlib.sha256(_canonical([{"role": m["role"], "content": m["content"]} for m in messages])).hexdigest()


@dataclass(frozen=True)
class TaskFile:
    path: Path
    form: str
    items: tuple[Item, ...]
    sha256: str  # of the file's bytes: a resumed run refuses an edited file


def read_task_file(path: Path | str, forms: tuple[str, ...] = TASK_FORMS) -> TaskFile:
    """Every item of a JSONL file, validated; the first mistake raises, naming file, line and field."""
    path = Path(path)
    if not path.is_file():
        raise RarecacheError(f"no task file {path}")
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RarecacheError(f"{path}: not UTF-8 text (byte {e.start})") from None
    items: list[Item] = []
    form, first, seen = None, 0, {}
    for n, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue  # blank lines (a trailing newline) hold no item
        where = f"{path} line {n}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise RarecacheError(f"{where}: not valid JSON ({e.msg}, column {e.colno})") from None
        if not isinstance(row, dict):
            raise RarecacheError(f"{where}: expected a JSON object, got {type(row).__name__}")
        f = _form(row, where, forms)
        if form is None:
            form, first = f, n
        elif f != form:
            raise RarecacheError(f"{where}: a {FORMS[f][1]} line in a {FORMS[form][1]} file (line {first}): "
                                 "all lines must be one form")
        item = _item(row, f, where, n)
        if item.id in seen:
            what = f"id {item.id!r}" if "id" in row else "the same content (no id given: ids hash the content)"
            raise RarecacheError(f"{where}: field id: {what} is also on line {seen[item.id]}; ids must be unique")
        seen[item.id] = n
        items.append(item)
    if not items:
        raise RarecacheError(f"{path}: no items (the file is empty)")
    return TaskFile(path, form, tuple(items), hashlib.sha256(data).hexdigest())


def _form(row: dict, where: str, forms: tuple[str, ...]) -> str:
    found = [f for f, (mark, _) in FORMS.items() if mark in row]
    if len(found) > 1:
        raise RarecacheError(f"{where}: fields {' and '.join(FORMS[f][0] for f in found)} mix forms; give one")
    if not found or found[0] not in forms:
        wanted = " or ".join(f"{FORMS[f][0]} ({FORMS[f][1]})" for f in forms)
        hint = "; {\"text\": ...} lines belong in a --calibration file" if found == ["text"] else ""
        raise RarecacheError(f"{where}: missing field {wanted}{hint}")
    return found[0]


def _string(row: dict, key: str, where: str) -> str:
    value = row.get(key)
    if not isinstance(value, str) or not value:
        got = "missing" if key not in row else f"got {json.dumps(value)[:40]}"
        raise RarecacheError(f"{where}: field {key} must be a non-empty string ({got})")
    return value


def _prompt(row: dict, where: str) -> tuple[dict[str, str], ...]:
    if ("context" in row) == ("messages" in row):
        raise RarecacheError(f"{where}: " + ("give field context or messages, not both" if "context" in row
                                             else "missing field context (or messages)"))
    if "context" in row:
        return ({"role": "user", "content": _string(row, "context", where)},)
    msgs = row["messages"]
    if not isinstance(msgs, list) or not msgs:
        raise RarecacheError(f"{where}: field messages must be a non-empty list of {{role, content}}")
    for k, m in enumerate(msgs):
        if not isinstance(m, dict) or set(m) != {"role", "content"}:
            raise RarecacheError(f"{where}: field messages[{k}] must be an object with role and content only")
        if m["role"] not in ROLES:
            raise RarecacheError(f"{where}: field messages[{k}].role must be one of {', '.join(ROLES)} "
                                 f"(got {json.dumps(m['role'])[:40]})")
        if not isinstance(m["content"], str):
            raise RarecacheError(f"{where}: field messages[{k}].content must be a string")
    if msgs[-1]["role"] != "user":
        raise RarecacheError(f"{where}: field messages must end in a user turn (the answer is scored as the "
                             "assistant's reply)")
    return tuple(msgs)


def _item(row: dict, form: str, where: str, n: int) -> Item:
    fields = {"choice": ("choices", "gold"), "bpb": ("continuation",), "text": ("text",)}[form]
    allowed = {"id", *fields} | ({"context", "messages"} if form != "text" else set())
    unknown = sorted(set(row) - allowed)
    if unknown:
        raise RarecacheError(f"{where}: unknown field {unknown[0]} (a {FORMS[form][1]} line has "
                             f"{', '.join(sorted(allowed))})")
    if form == "text":  # a calibration document: a user turn, nothing scored
        messages = ({"role": "user", "content": _string(row, "text", where)},)
    else:
        messages = _prompt(row, where)
    conts, gold, answer = (), None, {}  # answer: what the content hash of an id-less line covers beyond the prompt
    if form == "choice":
        choices, gold = row["choices"], row.get("gold")
        if not isinstance(choices, list) or len(choices) < 2:
            raise RarecacheError(f"{where}: field choices must be a list of at least 2 strings")
        for k, c in enumerate(choices):
            if not isinstance(c, str) or not c:
                raise RarecacheError(f"{where}: field choices[{k}] must be a non-empty string")
        if "gold" not in row:
            raise RarecacheError(f"{where}: missing field gold (the index of the correct choice)")
        if not isinstance(gold, int) or isinstance(gold, bool):
            raise RarecacheError(f"{where}: field gold must be an integer index (got {json.dumps(gold)[:40]})")
        if not 0 <= gold < len(choices):
            raise RarecacheError(f"{where}: field gold {gold} is out of range for {len(choices)} choices "
                                 f"(0-{len(choices) - 1})")
        conts, answer = tuple(choices), {"choices": choices, "gold": gold}
    elif form == "bpb":
        conts = (_string(row, "continuation", where),)
        answer = {"continuation": conts[0]}
    key = row.get("id")
    if "id" in row and not ((isinstance(key, str) and key) or (isinstance(key, int) and not isinstance(key, bool))):
        raise RarecacheError(f"{where}: field id must be a non-empty string or an integer")
    content = hashlib.sha256(_canonical({"messages": list(messages), **answer})).hexdigest()[:16]
    iid = str(key) if "id" in row else content
    return Item(iid, messages, gold, {"line": n, "prompt_sha256": prompt_sha256(messages)}, conts)


def _lines(items: list[Item], limit: int = 5) -> str:
    some = ", ".join(f"line {i.extra['line']} (id {i.id})" for i in items[:limit])
    return some + (f" and {len(items) - limit} more" if len(items) > limit else "")


class FileTask(Task):
    """A task read from a user's JSONL file; its name is the file's name."""

    kind = "likelihood"

    def __init__(self, path: Path | str, calibration: Path | str | None = None, cache_dir: Path | None = None,
                 tokenizer: Any = None):
        super().__init__(cache_dir, tokenizer)
        self.file = read_task_file(path)
        self.calibration = Path(calibration) if calibration is not None else None
        self._pool: list[Item] | None = None
        self.name = self.file.path.name
        choice = self.file.form == "choice"
        self.metric = "correct_norm" if choice else "bpb"  # acc_norm is the headline, as for ARC and HellaSwag
        self.chance = sum(1 / len(i.continuations) for i in self.file.items) / len(self.file.items) if choice else 0.0

    def items(self) -> list[Item]:
        return list(self.file.items)

    def calibration_items(self) -> list[Item]:
        """The --calibration file's items; none without one."""
        if self.calibration is None:
            return []
        if self._pool is None:
            self._pool = list(read_task_file(self.calibration, CALIBRATION_FORMS).items)
        return self._pool

    def calibration_corpus(self) -> Corpus:
        """The calibration file's prompts, refused if any is an evaluated prompt; the map records their hashes."""
        if self.calibration is None:
            raise RarecacheError(f"{self.name}: a task file's map is fitted on data you give: --calibration "
                                 "CAL.jsonl (lines of the task's forms, or {\"text\": ...})")
        pool = self.calibration_items()
        evaluated = {i.extra["prompt_sha256"]: i for i in self.file.items}
        hits = [i for i in pool if i.extra["prompt_sha256"] in evaluated]
        if hits:
            pairs = ", ".join(f"line {i.extra['line']} = {self.file.path} line "
                              f"{evaluated[i.extra['prompt_sha256']].extra['line']}" for i in hits[:5])
            raise RarecacheError(f"{self.calibration}: {len(hits)} line(s) have the prompt of an evaluated item "
                                 f"(sha256 of the prompt): {pairs}; calibrate on data disjoint from what you evaluate")
        return prompt_corpus(f"task:{self.name}", pool, [HASH + i.extra["prompt_sha256"] for i in pool])

    def check_map(self, mapper, items: list[Item]) -> None:
        """Refuse a map that read any evaluated prompt, by hash: whichever task file it was calibrated for."""
        fitted = set(mapper.info.calibration.get("document_ids", [])) | mapper.refined_ids()
        hits = [i for i in items if HASH + i.extra["prompt_sha256"] in fitted]
        if hits:
            raise RarecacheError(f"{self.file.path}: the map (calibrated on {mapper.info.corpus.get('name')}) was "
                                 f"fitted on the prompts of {len(hits)} evaluated item(s), by sha256 of the prompt: "
                                 f"{_lines(hits)}; calibrate on data disjoint from what you evaluate")

    def record(self) -> dict:
        return {"file": str(self.file.path), "sha256": self.file.sha256}

    def score_likelihood(self, item: Item, logprobs: list[float]) -> dict:
        return choice_scores(item, logprobs) if self.file.form == "choice" else gold_bpb(item, logprobs)


def headline(rows: list[dict]) -> tuple[str, float]:
    """The metric and chance level of a results file whose task is not registered (a task file's):
    bits per byte, or acc_norm with chance the mean of 1 / choices over its items."""
    if any("bpb" in r for r in rows):
        return "bpb", 0.0
    if any("correct_norm" in r for r in rows):
        n = {r["item"]: len(r["logprobs"]) for r in rows if isinstance(r.get("logprobs"), list) and r["logprobs"]}
        return "correct_norm", (sum(1 / k for k in n.values()) / len(n) if n else 0.0)
    return "correct", 0.0
