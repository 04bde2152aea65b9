"""Evaluation tasks. Each task is one small module registered in TASKS."""

from .base import Item, Task
from .gsm8k import GSM8K

TASKS: dict[str, type[Task]] = {t.name: t for t in (GSM8K,)}

__all__ = ["Item", "Task", "TASKS"]
