"""What several commands share: the model, pair and sampling flags, loading the pair
they name, and writing a result to `--out` while printing it as one JSON line.

Light on purpose: every heavy import happens inside the function that needs it, so
building the parser (and `--help`) stays quick.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..dtypes import DTYPE_CHOICES, DTYPE_HELP, announce, cpu_capability, gpu_or_cpu, resolve_dtype
from ..errors import RarecacheError


def add_dtype_option(p: argparse.ArgumentParser, device=None) -> None:
    """`--dtype` (default auto: dtypes.py's rule), resolved once by `settle_dtype` before the command runs.
    `device`: where the command computes, from its parsed flags (default: its --device, else the CPU)."""
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto", help=DTYPE_HELP)
    p.set_defaults(dtype_device=device or (lambda args: getattr(args, "device", None) or "cpu"))


def vllm_device(args) -> str:
    """Where vLLM engines compute: the GPU where there is one (vLLM takes it), else the CPU."""
    return gpu_or_cpu()


def engine_device(args) -> str:
    """Where a command with --engine computes: vLLM's device, or our own engine's CPU."""
    return vllm_device(args) if getattr(args, "engine", None) == "vllm" else "cpu"


def settle_dtype(args):
    """Turn a command's --dtype (auto by default) into the dtype that runs, saying which and why on stderr.
    Commands without --dtype: None."""
    if getattr(args, "dtype_device", None) is None:
        return None
    choice = resolve_dtype(args.dtype, args.dtype_device(args))
    args.dtype = choice.dtype
    announce(choice)
    return choice


def ran_in(args) -> dict:
    """What a command's record says about how it computed: the dtype that ran and the CPU's capability
    (which kernels ran: figures and rounding depend on both)."""
    return {"dtype": args.dtype, "cpu": cpu_capability()}


def add_model_options(p: argparse.ArgumentParser, device=None) -> None:
    add_dtype_option(p, device)
    p.add_argument("--cache-dir", type=Path, default=None,
                   help="model cache directory (default: $RARECACHE_HOME or ~/.cache/rarecache)")


def add_pair_options(p: argparse.ArgumentParser, required: bool = True) -> None:
    p.add_argument("--source", required=required, help="model whose cache is mapped (name, HF dir or .gguf)")
    p.add_argument("--target", required=required, help="model that receives the mapped cache")
    p.add_argument("--map", type=Path, required=required, help="map file fitted for source -> target")
    p.add_argument("--map-dtype", choices=["bfloat16", "float32"], default=None,
                   help="dtype of the map's products (default: the compute dtype; a map stored in bf16 is widened "
                        "on load). bfloat16 with --dtype float32 makes the map ~4x cheaper on AVX-512 BF16 CPUs "
                        "(not on AVX2); mapped rows round to bf16, recomputed rows stay exact")


def add_sampling_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=256, help="tokens to generate at most (default: 256)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: 1.0)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")


def load_models(args, pack_target: bool | None = None):
    """Source and target runners named by --source/--target, and the (shared) tokenizer. `pack_target`: as
    `Runner`'s `pack` for the target (False where gradients run through its layers)."""
    from ..engine.llm import DTYPES
    from ..engine.runner import Runner
    from ..models.store import resolve_model
    from ..models.tokenizer import Tokenizer

    paths = [resolve_model(m, cache_dir=args.cache_dir) for m in (args.source, args.target)]
    device = getattr(args, "device", "cpu")  # (the benches take --device)
    source = Runner.load(paths[0], dtype=DTYPES[args.dtype], device=device)
    target = Runner.load(paths[1], dtype=DTYPES[args.dtype], device=device, pack=pack_target)
    tokenizer = Tokenizer.from_dir(paths[0])
    source.learn_lines(tokenizer), target.learn_lines(tokenizer)  # (the selectors that recompute whole lines)
    return source, target, tokenizer


def load_pair(args):
    """load_models plus the --map file, checked against the pair (identity and fit)."""
    from ..transfer.mapper import Mapper

    mapper = Mapper.load(args.map)  # a bad file fails before the models, which take much longer to load
    source, target, tokenizer = load_models(args)
    mapper.check_pair(source, target)
    return source, target, with_map_dtype(mapper, args), tokenizer


def with_map_dtype(mapper, args):
    """The mapper computing in --map-dtype (unset: the target's dtype)."""
    from ..engine.llm import DTYPES

    name = getattr(args, "map_dtype", None)
    return mapper.computing_in(DTYPES[name]) if name else mapper


def write_out(path: Path, text: str) -> None:
    """Write `text` to an --out file, making its folder first."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def print_json(result: dict, out: Path | None = None, indent: int | None = None) -> None:
    """Print `result` as one JSON line; with an --out path, write it there first (that line, or the
    JSON indented by `indent`)."""
    line = json.dumps(result)
    if out:
        write_out(out, line + "\n" if indent is None else json.dumps(result, indent=indent))
    print(line)


def fill_served_defaults(args, source: str | None, target: str | None,
                         runs: tuple[str, ...] | None = None) -> dict[str, str]:
    """Fill the handoff flags left unset (`args.map`, `args.selector`, `args.rho` None) from the served
    defaults (rarecache/defaults.py), as serve and generate do; `runs`: the selectors the engine runs.
    Returns what was filled and why ({"map": ..., "selector": ...}), to tell the user."""
    from ..defaults import SERVED, default_selector, pair_map

    notes = {}
    if getattr(args, "map", "") is None and source is not None and target is not None:
        args.map = pair_map(source, target, args.cache_dir)
        if args.map is not None:
            notes["map"] = f"using the map {args.map}"
    if args.selector is None:
        args.selector, why = default_selector(runs)
        notes["selector"] = f"selector {args.selector}: {why}"
    if args.rho is None:
        args.rho = SERVED.rho
    return notes


def warn_fit(mapper) -> None:
    """Say on stderr when a map fits badly (`Mapper.fit_problems`): `serve` refuses it unless told otherwise."""
    problems = mapper.fit_problems()
    if problems:
        print(f"warning: this map fits badly: {'; '.join(problems)} (`rarecache serve` refuses it without "
              "--accept-poor-map)", file=sys.stderr)


def map_specs(specs: list[str]) -> dict[str, Path]:
    """--map PATH (one unlabelled map) or --map LABEL=PATH ... -> {label: path}."""
    maps: dict[str, Path] = {}
    for spec in specs:
        label, sep, path = spec.partition("=")
        label, path = (label, path) if sep else ("", spec)
        if sep and not label.replace("-", "").replace("_", "").isalnum():
            raise RarecacheError(f"map label {label!r}: use letters, digits, - and _")
        if label in maps:
            raise RarecacheError(f"map label {label or '(none)'} given twice")
        if not Path(path).is_file():
            raise RarecacheError(f"no map file {path}")
        maps[label] = Path(path)
    if "" in maps and len(maps) > 1:
        raise RarecacheError("several maps need labels: --map task=FILE wiki=FILE")
    return maps
