"""The results file of a run and what produced it.

`<out>` holds one JSON line per (item, arm); a line cut short by a kill is dropped
when the run resumes. `<out>.meta.json` records the models, maps and their hashes,
a task file's hash, dtype, seed, sampling and versions; resuming with anything
different is refused.
"""

from __future__ import annotations

import gzip
import json
import platform
import zlib
from dataclasses import asdict
from pathlib import Path

import torch

from ..engine.generate import SamplingConfig
from ..engine.llm import LLM
from ..errors import RarecacheError
from ..models.loader import checkpoint_fingerprint
from ..packages import sha256_file
from .arms import SEED
from .tasks.base import Task


def read_done(path: Path, key: tuple[str, str] = ("item", "arm")) -> set[tuple[str, str]]:
    """(item, arm) pairs (or the `key` fields) already in the results file; a line cut short by a kill
    is dropped."""
    done = set()
    if path.is_file():
        data = path.read_bytes()
        if data and not data.endswith(b"\n"):
            path.write_bytes(data[: data.rfind(b"\n") + 1])
        for line in path.read_text().splitlines():
            if line.strip():
                try:
                    row = json.loads(line)
                    done.add((row[key[0]], row[key[1]]))
                except (json.JSONDecodeError, KeyError):
                    raise RarecacheError(f"{path} has a malformed line; it is not a results file of this run")
    return done


def results_stem(path: Path) -> str:
    """A results file's name without its suffix: `x` for `x.jsonl`, and for `x.jsonl.gz` as published."""
    return path.name.removesuffix(".jsonl.gz") if path.name.endswith(".jsonl.gz") else path.stem


def sibling(path: Path, suffix: str) -> Path:
    """The file beside results file `path` with `suffix` for its own (`.meta.json`, `.timings.jsonl`), named
    as a run writes it (`path.with_suffix`), or beside a published `x.jsonl.gz` (`x.timings.jsonl.gz` when
    only that exists)."""
    plain = path.with_name(results_stem(path) + suffix)
    packed = plain.with_name(plain.name + ".gz")
    return packed if suffix.endswith(".jsonl") and not plain.is_file() and packed.is_file() else plain


def run_record(path: Path) -> dict:
    """The record of what produced the results file `path` (its meta file), or {} where there is none."""
    meta = sibling(path, ".meta.json")
    try:
        record = json.loads(meta.read_text()) if meta.is_file() else {}
    except ValueError:
        raise RarecacheError(f"{meta} is not a run record") from None
    return record if isinstance(record, dict) else {}


def map_shas(path: Path) -> dict[str, str]:
    """Map label -> sha256 of every map the results file `path` records (its meta file)."""
    maps = run_record(path).get("maps", {})
    return {label: e["sha256"] for label, e in maps.items() if isinstance(e, dict) and isinstance(e.get("sha256"), str)}


def map_sha256(path: Path, label: str) -> str | None:
    """The sha256 of the map labelled `label` that produced the results file `path` (its meta file)."""
    return map_shas(path).get(label)


def generation_cap(path: Path) -> int | None:
    """The token cap the generations of results file `path` ran under (its meta file), if recorded."""
    sampling = run_record(path).get("sampling")
    return sampling.get("max_new_tokens") if isinstance(sampling, dict) else None


def load_results(path: Path) -> list[dict]:
    """The rows of a results (or timings) file, plain JSONL or gzipped (`.jsonl.gz`, as published)."""
    try:
        data = path.read_bytes()
        text = (gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data).decode()
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    except OSError as e:
        raise RarecacheError(f"cannot read {path}: {e.strerror or e}") from None
    except (UnicodeDecodeError, EOFError, gzip.BadGzipFile, zlib.error, json.JSONDecodeError) as e:
        raise RarecacheError(f"{path} is not a results file (JSON lines, plain or gzipped): {e}") from None


def run_meta(task: Task, source: LLM, target: LLM, maps: dict[str, Path], dtype: str,
             sampling: SamplingConfig | None) -> dict:
    """`logits`: what likelihood tasks score from ("float32 head": `Runner.float32_logits`; records before
    2026-12-07 scored a bfloat16 model's own head and record none, so they are not resumed with this one)."""
    return {"task": task.name, "task_file": task.record(), **models_meta(source, target, maps, dtype),
            "sampling": asdict(sampling) if sampling is not None and task.kind == "generate" else None,
            "logits": "float32 head" if task.kind == "likelihood" else None}


def models_meta(source: LLM, target: LLM, maps: dict[str, Path], dtype: str) -> dict:
    """What every results file records of how it was computed: the models, the maps by label (their
    sha256), dtype, seed and versions."""
    from importlib.metadata import version

    return {"source": {"name": source.path.name, "fingerprint": checkpoint_fingerprint(source.path)},
            "target": {"name": target.path.name, "fingerprint": checkpoint_fingerprint(target.path)},
            "maps": {label: {"file": str(p), "sha256": sha256_file(p)} for label, p in maps.items()},
            "dtype": dtype, "seed": SEED,
            "versions": {"rarecache": version("rarecache"), "torch": torch.__version__,
                         "python": platform.python_version(),
                         "cpu": torch.backends.cpu.get_cpu_capability()}}  # float rounding depends on it


RUN_KEYS = ("task", "source", "target", "dtype", "seed", "sampling", "logits")


def check_meta(out: Path, meta: dict, keys: tuple[str, ...] = RUN_KEYS, once: tuple[str, ...] = ()) -> dict:
    """Refuse to add to a results file made with other models, maps or settings (`keys`, the maps by
    label, a task file's content); record this run. `once`: settings compared only where both the
    record and this run have one (a drift file's gate policy: a file run without the gate arm may gain it)."""
    meta = json.loads(json.dumps(meta))  # compare what the file will hold: tuples read back as lists
    path = out.with_suffix(".meta.json")
    if path.is_file():
        try:
            old = json.loads(path.read_text())
        except ValueError:
            raise RarecacheError(f"{path} is not a run record; move it away or use another --out") from None
        for key in keys + tuple(k for k in once if old.get(k) is not None and meta.get(k) is not None):
            if old.get(key) != meta.get(key):  # (a key neither records reads None on both sides)
                raise RarecacheError(f"{out} was produced with {key} {old.get(key)!r}, this run has "
                                     f"{meta.get(key)!r}: use another --out")
        was, now = (m.get("task_file") or {} for m in (old, meta))
        if was.get("sha256") != now.get("sha256"):  # the file's content, wherever it lies now
            raise RarecacheError(f"{out}: task file {now.get('file') or was.get('file')} is not the file its results "
                                 f"came from (sha256 {now.get('sha256', '-')[:12]}, "
                                 f"was {was.get('sha256', '-')[:12]}): use another --out")
        for label, m in meta["maps"].items():
            was = old.get("maps", {}).get(label)
            if was is not None and was["sha256"] != m["sha256"]:
                raise RarecacheError(f"{out}: map {label or '(unlabelled)'} is not the file its results came from "
                                     f"({m['file']} sha256 {m['sha256'][:12]}, was {was['sha256'][:12]}): "
                                     "use another --out")
        seen = [*old.get("versions_seen", []), old.get("versions"), meta["versions"]]
        meta = {**meta, "maps": {**old.get("maps", {}), **meta["maps"]},
                "versions_seen": [v for i, v in enumerate(seen) if v and v not in seen[:i]],
                **{k: old[k] for k in once if meta.get(k) is None and old.get(k) is not None}}
        if "maps_replaced" in old:  # a map recalibrated on another CPU (research/scripts/rebase_map.py): kept on record
            meta["maps_replaced"] = old["maps_replaced"]
    out.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(meta, indent=1) + "\n")
    return meta
