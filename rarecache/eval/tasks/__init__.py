"""Evaluation tasks. Each task is one small module registered in TASKS."""

from .base import Item, Task
from .choice import ARCChallenge, ARCEasy, HellaSwag, WinoGrande
from .coqa import CoQA, CoQABPB
from .gsm8k import GSM8K, GSM8KBPB
from .mmlu import MMLU
from .wiki_ppl import WikiPerplexity

TASKS: dict[str, type[Task]] = {t.name: t for t in (GSM8K, GSM8KBPB, ARCChallenge, ARCEasy, HellaSwag, WinoGrande,
                                                 MMLU, CoQA, CoQABPB, WikiPerplexity)}

__all__ = ["Item", "Task", "TASKS"]
