"""Evaluation tasks. Each task is one small module, registered by its line in registry.py's TASKS (the
name and the class), from which `TASKS` here is built; a user's own task is a JSONL file (`custom.py`),
named where a task name goes."""

from pathlib import Path

from ...errors import RarecacheError
from ...registry import LONG_TASKS as LONG_CONTEXT
from ...registry import TASKS as TASK_NAMES
from .base import Item, Task
from .custom import FileTask
from .longctx import LongContextTask

TASKS: dict[str, type[Task]] = {name: TASK_NAMES.load(name) for name in TASK_NAMES}

# LONG_CONTEXT (registry.LONG_TASKS, named there so that the calibration mix can read it without importing tasks) is
# every LongContextTask registered (tested)


def open_task(spec: str, cache_dir: Path | None = None, tokenizer=None, calibration: Path | None = None,
              length: int | None = None) -> Task:
    """A registered task by name (a long-context one at `length` tokens, or at all its lengths), else the task
    file at path `spec` (with its --calibration file, if any)."""
    if length is not None and not issubclass(TASKS.get(spec, Task), LongContextTask):
        raise RarecacheError(f"--length goes with the long-context tasks ({', '.join(LONG_CONTEXT)}), not {spec}")
    if spec in TASKS:
        if calibration is not None:
            raise RarecacheError(f"--calibration goes with a task file; {spec} has its own calibration pool")
        if issubclass(TASKS[spec], LongContextTask):
            return TASKS[spec](cache_dir, tokenizer=tokenizer, length=length)
        return TASKS[spec](cache_dir, tokenizer=tokenizer)
    if not Path(spec).is_file():
        raise RarecacheError(f"unknown task {spec!r}: not one of {', '.join(TASKS)}, and no such file")
    return FileTask(spec, calibration, cache_dir, tokenizer)


__all__ = ["Item", "Task", "TASKS", "LONG_CONTEXT", "FileTask", "LongContextTask", "open_task"]
