"""rarecache: cross-model KV-cache handoff.

A small public API: `LLM` loads a model (by name, HF directory or GGUF file) and
generates; `SamplingConfig` says how.
"""

from .engine.generate import SamplingConfig
from .engine.llm import LLM

__all__ = ["LLM", "SamplingConfig"]
