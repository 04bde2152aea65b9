"""The served defaults: the map, selector and budget a handoff uses when nobody names them.

`rarecache serve`, `generate`, `demo`, the benches and the vLLM connector all read `SERVED`, so
one command does not hand off differently from another. The map ships inside the package
(package data, found in the package's own directory), so a regular install resolves the same
defaults as an editable one; nothing here reads docs/ or depends on the current folder.

The map is the one the adoption runs picked by agreement with the target across the short tasks; the selector
and budget are the ones ADOPTION.md's rule 9 picked through this very map on the long-context suite, where
handoffs pay, with the short tasks as a guard (each rule written before its runs). tests/test_defaults.py
holds them to the committed summaries: the map's sha256 to the fidelity summary's, the selector and budget to
the long-context summary's served arm.
Light on purpose: `--help` reads it, so it must not import torch (the selectors' names are registry.py's).
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path

from .errors import RarecacheError
from .registry import ATTN_SOURCE_SPAN, QUERY_W8, RANK, SELECTORS


@dataclass(frozen=True)
class ServedMap:
    file: str  # package-relative path of the map file
    sha256: str
    source: str  # the pair it maps, by bundled model name
    target: str
    calibrate: str  # the command that made its fit (the map's own metadata records the same settings)
    store: str  # the command that wrote the served file from the fit (`{fit}`: calibrate's --out)
    selector: str  # the default position selector
    rho: float  # the default share of handed-off positions recomputed
    fallback: str  # the selector an engine that cannot run `selector` uses (default_selector)

    @property
    def path(self) -> Path:
        """The map file inside the installed package."""
        return Path(str(files(__package__).joinpath(self.file)))


# v4 (issue #41): the general mix of v3 (eval/mix.py), every target layer also reading the target's own
# layer-0 rows of the token and layer 0 computed exactly (transfer/mapper.py), bf16 statistics, stored with
# bf16 weights. Adopted over v3 by the rule written before its runs (research/fidelity/ADOPTION.md).
SERVED = ServedMap(
    file="data/general-v4-64k.safetensors",
    sha256="7145adb2044d14f1235a732ef4e62bd7e89ee23cb88c8f1629805762119e79eb",
    source="qwen2.5-coder-0.5b-instruct",
    target="qwen2.5-coder-1.5b-instruct",
    calibrate="rarecache calibrate --source qwen2.5-coder-0.5b-instruct --target qwen2.5-coder-1.5b-instruct "
              "--preset general-v3 --tokens 65536 --heldout-tokens 8192 --token-inputs --exact-layer0 "
              "--dtype bfloat16",
    store="rarecache refit --map {fit} --weights-dtype bfloat16",
    # Rule 9 (issue #54): the best mean rank of agreement over the five long-context tasks at T 2048, no task
    # below the 0.5B alone, agreement on MMLU, ARC-C and HellaSwag not below suffix's (exact McNemar), >= 2.5x
    # sooner at T 2048. It reads the source's attention from its last queries, which the vLLM adapter's row
    # store does not hold: there the fallback runs, rule 9's runner-up, which the adapter runs in two passes.
    selector=ATTN_SOURCE_SPAN,
    rho=0.3,
    fallback=QUERY_W8,
)

# Below this many prompt tokens a server re-prefills instead of handing off (status fallback_reprefill, reason
# short_prompt; serve --min-handoff-tokens, issue #54 item 4). Set by ADOPTION.md rule 10 from `bench handoff` of
# the served configuration (docs/artifacts/bench-handoff-served-short.txt, attn-source-span, bf16, AVX512 with AMX,
# 2 cores): 1.66x sooner than the 1.5B's own prefill at T 256, 2.19x at 512, the first length of the grid at 2x
# or more (suffix read 1.66x and 2.22x). Below it the fixed cost of mapping (6.5% of the prefill at 256) and an
# approximate answer buy little time.
MIN_HANDOFF_TOKENS = 512



def selector_help(vllm: bool = False) -> str:
    """One `--selector` help for every command: the registry's selectors (oracles marked) and the default
    (`vllm`: a command that runs the vLLM adapter, whose default is SERVED's fallback)."""
    if vllm:
        return (f"position selector: {SELECTORS.help()} (default: {SERVED.fallback}, the served fallback: the served "
                f"default, {SERVED.selector}, needs the source's attention, which the vLLM adapter does not have)")
    return f"position selector: {SELECTORS.help()} (default: {SERVED.selector}, the served default)"


def default_selector(runs: tuple[str, ...] | None = None) -> tuple[str, str]:
    """The selector a handoff uses when nobody names one, and why: SERVED's, where the engine runs it
    (`runs`: the selectors it can; None: all), else SERVED's fallback, else rank disagreement."""
    if runs is None or SERVED.selector in runs:
        return SERVED.selector, "the served default (measured best through the served general map)"
    if SERVED.fallback in runs:
        return SERVED.fallback, (f"the served fallback (the served default, {SERVED.selector}, needs the source's "
                                 "attention, which this engine does not have)")
    return RANK, f"rank disagreement (the served default, {SERVED.selector}, does not run in this engine)"


def general_map_path(source: str, target: str, cache_dir: Path | None = None) -> Path:
    """Where `calibrate --preset general` writes a pair's general map by default, and `serve` looks for it."""
    from .packages import default_cache_dir

    name = lambda m: Path(m).name.removesuffix(".gguf")  # noqa: E731  (a model name, HF dir or .gguf)
    root = Path(cache_dir or default_cache_dir()).expanduser()
    return root / "maps" / f"general-{name(source)}-to-{name(target)}.safetensors"


def served_map_file() -> Path:
    """SERVED's file, checked against its recorded sha256 (a damaged install is refused, not served)."""
    from .packages import sha256_file

    path = SERVED.path
    if not path.is_file():
        raise RarecacheError(f"the served map {path} is missing from this install of rarecache: reinstall it, "
                             f"or make the map again ({remake('FILE')}) and pass --map FILE")
    if sha256_file(path) != SERVED.sha256:
        raise RarecacheError(f"the served map {path} is not the recorded one (sha256 differs): reinstall rarecache")
    return path


def remake(out: str) -> str:
    """The commands that make SERVED's file again, written to `out`."""
    fit = f"{out}.fit.safetensors"
    return f"`{SERVED.calibrate} --out {fit}`, then `{SERVED.store.format(fit=fit)} --out {out}`"


def pair_map(source: str, target: str, cache_dir: Path | None = None) -> Path | None:
    """The map a handoff source -> target uses when none is named: the general map `calibrate --preset
    general` made for the pair (`general_map_path`), else SERVED's file for the pair it maps; else None."""
    made = general_map_path(source, target, cache_dir)
    if made.is_file():
        return made
    if (source, target) == (SERVED.source, SERVED.target):
        return served_map_file()
    return None
