"""rarecache: cross-model KV-cache handoff.

A small public API: `LLM` loads a model (by name, HF directory or GGUF file) and
generates; `SamplingConfig` says how. Both load on first use, so that importing a
submodule (the `rarecache` command building its `--help`) does not import torch.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .engine.generate import SamplingConfig
    from .engine.llm import LLM

__all__ = ["LLM", "SamplingConfig"]
_HOMES = {"LLM": ".engine.llm", "SamplingConfig": ".engine.generate"}


def __getattr__(name: str):
    if name in _HOMES:
        value = getattr(import_module(_HOMES[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
