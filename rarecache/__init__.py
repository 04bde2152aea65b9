"""rarecache: cross-model KV-cache handoff.

The public API, what a script needs: `LLM` loads a model (by name, HF directory or GGUF file)
and generates, as `SamplingConfig` says; `Pipeline` is a source, a target and the `Mapper`
between them, handing off with a `HandoffConfig` (how much to recompute, which positions);
`Conversation` is a chat that switches model turn by turn; `GatePolicy` is the quality gate;
`SERVED` is the map, selector and budget `rarecache serve` uses by default. Each loads on first
use, so that importing a submodule (the `rarecache` command building its `--help`) does not
import torch.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .defaults import SERVED
    from .engine.generate import SamplingConfig
    from .engine.llm import LLM
    from .transfer.conversation import Conversation
    from .transfer.gate.policy import GatePolicy
    from .transfer.handoff import HandoffConfig
    from .transfer.mapper import Mapper
    from .transfer.pipeline import Pipeline

__all__ = ["LLM", "SamplingConfig", "Pipeline", "HandoffConfig", "Mapper", "Conversation", "GatePolicy", "SERVED"]
_HOMES = {"LLM": ".engine.llm", "SamplingConfig": ".engine.generate", "Pipeline": ".transfer.pipeline",
          "HandoffConfig": ".transfer.handoff", "Mapper": ".transfer.mapper", "Conversation": ".transfer.conversation",
          "GatePolicy": ".transfer.gate.policy", "SERVED": ".defaults"}


def __getattr__(name: str):
    if name in _HOMES:
        value = getattr(import_module(_HOMES[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
