"""`rarecache demo`: the product on the bundled pair, in about a minute on a laptop CPU.

Pulls Qwen2.5-Coder 0.5B and 1.5B if needed, loads the general map rarecache ships
(`defaults.SERVED`: the map, selector and budget `serve` uses; nothing is calibrated),
then hands a few fixed prompts from the 0.5B to the 1.5B at ρ = 0, the served budget
and 1, and prints the answers, the phase timings, the speed-up over the 1.5B's own
prefill of the same prompts (timed in the same run, after a warm-up) and how many
greedy tokens agree with the 1.5B's own.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .defaults import SERVED, served_map_file
from .dtypes import dtype_name
from .engine.generate import SamplingConfig
from .engine.llm import LLM
from .errors import RarecacheError
from .models.store import default_cache_dir, pull
from .transfer.calibrate import Calibration, CalibrationConfig
from .transfer.corpus import load_corpus
from .transfer.handoff import HandoffConfig
from .transfer.mapper import Mapper
from .transfer.pipeline import Pipeline

SOURCE, TARGET = SERVED.source, SERVED.target
PROMPTS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May? Answer with the number only.",
    "Write a Python function `is_prime(n)` that returns True when n is a prime number. "
    "Reply with the code only.",
    "In one sentence: what does a KV cache store in a transformer language model?",
]


@dataclass(frozen=True)
class DemoConfig:
    rhos: tuple[float, ...] = (0.0, SERVED.rho, 1.0)
    selector: str = SERVED.selector
    corpus: str = "code"  # the long prompt's code; and the quick map's text (chat-formatted), when one is needed
    tokens: int = 16384  # the quick map's calibration tokens
    max_new_tokens: int = 24
    dtype: str = "auto"  # auto: what this machine runs fast (dtypes.py), resolved here
    cache_dir: Path | None = None

    def __post_init__(self):
        object.__setattr__(self, "dtype", dtype_name(self.dtype))


def served_or_quick_map(cfg: DemoConfig, source: LLM, target: LLM) -> tuple[Mapper, str]:
    """The shipped general map; a quick map (`demo_map`) only if it does not fit the models as converted
    here. With how the demo names it."""
    mapper = Mapper.load(served_map_file())
    try:
        mapper.check_pair(source.runner, target.runner)
        return mapper, f"the shipped map {Path(SERVED.file).name}"
    except RarecacheError as e:
        print(f"the shipped general map does not fit the models as converted here ({e}); calibrating a quick "
              "map instead", file=sys.stderr)
    return demo_map(cfg, source, target), f"a quick map fitted on chat-formatted '{cfg.corpus}'"


def demo_map(cfg: DemoConfig, source: LLM, target: LLM) -> Mapper:
    """A small map fitted on chat-formatted `cfg.corpus` (cached; resumable): the fallback where the shipped
    map does not fit the pair as converted here."""
    root = Path(cfg.cache_dir or default_cache_dir()) / "maps"
    root.mkdir(parents=True, exist_ok=True)
    path = root / f"demo-{SOURCE}-to-{TARGET}-{cfg.corpus}-chat-{cfg.tokens}-{cfg.dtype}.safetensors"
    if path.is_file():
        print(f"using the cached map {path}", file=sys.stderr)
        return Mapper.load(path)
    print(f"calibrating a {cfg.tokens}-token map on chat-formatted '{cfg.corpus}' (resumable) ...", file=sys.stderr)
    corpus = load_corpus(cfg.corpus, chat=True, cache_dir=cfg.cache_dir)
    calib = CalibrationConfig(tokens=cfg.tokens, heldout_tokens=0, seq_len=512)
    mapper = Calibration(source.runner, target.runner, source.tokenizer, corpus, calib, path).run()
    mapper.save(path)
    Path(str(path) + ".state").unlink(missing_ok=True)
    return mapper


def run_demo(cfg: DemoConfig) -> int:
    t0 = time.perf_counter()
    for name in (SOURCE, TARGET):
        pull(name, cache_dir=cfg.cache_dir)
    source, target = (LLM(n, dtype=cfg.dtype, cache_dir=cfg.cache_dir) for n in (SOURCE, TARGET))
    mapper, map_name = served_or_quick_map(cfg, source, target)
    pipe = Pipeline(source, target, mapper)
    texts = PROMPTS + [long_prompt(cfg, pipe.mapper)]
    prompts = [[{"role": "user", "content": t}] for t in texts]
    sampling = SamplingConfig(max_new_tokens=cfg.max_new_tokens)
    print(f"\nhandoff {SOURCE} -> {TARGET} through {map_name}, selector "
          f"{cfg.selector}, served budget rho {SERVED.rho:g}, {cfg.dtype}, greedy, at most "
          f"{cfg.max_new_tokens} new tokens; the {len(prompts)} prompts run as one batch per arm\n", file=sys.stderr)
    warm = [prompts[0]]  # first calls pay one-time costs (allocation, kernel choice): not timed
    target.generate(warm, SamplingConfig(max_new_tokens=1))
    pipe.generate(warm, HandoffConfig.named(0.5, cfg.selector), SamplingConfig(max_new_tokens=1))
    alone = target.generate(prompts, sampling)
    prefill = target.timings["prefill_s"]
    answers = {"target alone": alone}
    timing_rows = []
    for rho in cfg.rhos:
        outs, res = pipe.generate(prompts, HandoffConfig.named(rho, cfg.selector), sampling)
        answers[f"handoff rho={rho:g}{' (served)' if rho == SERVED.rho else ''}"] = outs
        t = res.timings
        handoff_s = t["map"] + t["score"] + t["recompute"]
        agree = [sum(a == b for a, b in zip(o.tokens, ref.tokens)) / max(len(ref.tokens), 1)
                 for o, ref in zip(outs, alone)]
        timing_rows.append((rho, sum(len(p) for p in res.positions), t, handoff_s, sum(agree) / len(agree)))
    for i, text in enumerate(texts):
        shown = text if len(text) < 300 else f"{text[:120]} [... {len(text)} characters ...] {text[-60:]}"
        print(f"=== prompt {i + 1} ({alone[i].prompt_tokens} tokens): {shown}")
        for arm, outs in answers.items():
            print(f"--- {arm}:")
            print(_indent(outs[i].text))
        print()
    n_prompt = sum(a.prompt_tokens for a in alone)
    print(f"{TARGET} own prefill of the batch ({n_prompt} tokens): {prefill * 1e3:.0f} ms")
    print(f"{'rho':>7} {'recomputed':>11} {'map ms':>8} {'score ms':>9} {'recompute ms':>13} {'handoff ms':>11} "
          f"{'speed-up':>9} {'agreement':>10}")
    for rho, n_rec, t, handoff_s, agree in timing_rows:
        mark = "*" if rho == SERVED.rho else ""
        print(f"{rho:>5g}{mark:<2}{n_rec:>5}/{n_prompt:<5} {t['map'] * 1e3:>8.0f} {t['score'] * 1e3:>9.0f} "
              f"{t['recompute'] * 1e3:>13.0f} {handoff_s * 1e3:>11.0f} {prefill / handoff_s:>8.2f}x {agree:>10.0%}")
    print(f"speed-up = the 1.5B's own prefill / (map + score + recompute), timed in this run; the 0.5B's prefill "
          f"({timing_rows[0][2]['source_prefill'] * 1e3:.0f} ms) is paid before the switch in a cascade. "
          "Agreement = generated tokens equal to the 1.5B alone at the same step. * the served budget "
          f"({cfg.selector}, as `rarecache serve` hands off).")
    print(f"demo finished in {time.perf_counter() - t0:.0f} s")
    return 0


def long_prompt(cfg: DemoConfig, mapper: Mapper, chars: int = 2500) -> str:
    """A long-context question about code the map was not calibrated on: the corpus's last documents
    that the map's calibration did not read (by the ids it records, or, for a map of this corpus, by
    how many documents it used)."""
    docs = load_corpus(cfg.corpus, cache_dir=cfg.cache_dir).documents
    cal = mapper.info.calibration
    seen = set(cal.get("document_ids", ()))  # the general mix names code documents "code-file:I"
    first = cal.get("documents_used", 0) if mapper.info.corpus.get("name") == cfg.corpus else 0
    code, i = "", len(docs) - 1
    while len(code) < chars and i >= first:
        if f"code-file:{i}" not in seen:
            code = docs[i] + "\n\n" + code
        i -= 1
    return f"{code[-chars:]}\n\nIn two sentences: what does the code above do?"


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.strip().splitlines()) or "    (empty)"
