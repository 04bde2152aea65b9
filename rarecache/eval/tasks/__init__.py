"""Evaluation tasks. Each task is one small module registered in TASKS; a user's own task is a
JSONL file (`custom.py`), named where a task name goes."""

from pathlib import Path

from ...errors import RarecacheError
from .base import Item, Task
from .coqa import CoQA, CoQABPB, CoQAPassage
from .custom import FileTask
from .gsm8k import GSM8K, GSM8KBPB
from .mmlu import MMLU
from .multiple_choice import ARCChallenge, ARCEasy, HellaSwag, WinoGrande
from .wiki_ppl import WikiPerplexity

TASKS: dict[str, type[Task]] = {t.name: t for t in (GSM8K, GSM8KBPB, ARCChallenge, ARCEasy, HellaSwag, WinoGrande,
                                                 MMLU, CoQA, CoQABPB, CoQAPassage,
                                                 WikiPerplexity)}


def open_task(spec: str, cache_dir: Path | None = None, tokenizer=None, calibration: Path | None = None) -> Task:
    """A registered task by name, else the task file at path `spec` (with its --calibration file, if any)."""
    if spec in TASKS:
        if calibration is not None:
            raise RarecacheError(f"--calibration goes with a task file; {spec} has its own calibration pool")
        return TASKS[spec](cache_dir, tokenizer=tokenizer)
    if not Path(spec).is_file():
        raise RarecacheError(f"unknown task {spec!r}: not one of {', '.join(TASKS)}, and no such file")
    return FileTask(spec, calibration, cache_dir, tokenizer)


__all__ = ["Item", "Task", "TASKS", "FileTask", "open_task"]
