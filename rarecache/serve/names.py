"""The name a served model answers to (the `model` field of a chat request, `GET /v1/models`)."""

from __future__ import annotations

from pathlib import Path


def model_id(spec: str) -> str:
    """The name a served model answers to: a bundled name as given, else the directory or file stem."""
    path = Path(spec)
    return path.stem if path.suffix == ".gguf" else path.name if len(path.parts) > 1 or path.exists() else spec
