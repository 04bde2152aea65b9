"""`rarecache demo`: the bundled pair end to end, in minutes on a laptop CPU.

Pulls Qwen2.5-Coder 0.5B and 1.5B if needed, calibrates a small map (or loads
the cached one: the calibration checkpoints, so an interrupted demo resumes),
then hands a few fixed prompts from the 0.5B to the 1.5B at several ρ and prints
the answers, the phase timings and the speed-up over the 1.5B's own prefill of
the same prompt, timed in the same run.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .engine.generate import SamplingConfig
from .engine.llm import LLM
from .models.store import default_cache_dir, pull
from .transfer.calibrate import Calibration, CalibrationConfig
from .transfer.corpus import load_corpus
from .transfer.handoff import HandoffConfig
from .transfer.mapper import Mapper
from .transfer.pipeline import Pipeline

SOURCE, TARGET = "qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct"
PROMPTS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May? Answer with the number only.",
    "Write a Python function `is_prime(n)` that returns True when n is a prime number. "
    "Reply with the code only.",
    "In one sentence: what does a KV cache store in a transformer language model?",
]


@dataclass(frozen=True)
class DemoConfig:
    rhos: tuple[float, ...] = (0.0, 0.3, 1.0)
    selector: str = "rank"
    corpus: str = "code"  # chat-formatted code snippets: the template and code the prompts look like
    tokens: int = 16384
    max_new_tokens: int = 64
    dtype: str = "bfloat16"
    cache_dir: Path | None = None


def demo_map(cfg: DemoConfig, source: LLM, target: LLM) -> Mapper:
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
    pipe = Pipeline(source, target, demo_map(cfg, source, target))
    prompts = PROMPTS + [long_prompt(cfg, pipe.mapper)]
    sampling = SamplingConfig(max_new_tokens=cfg.max_new_tokens)
    print(f"\nhandoff {SOURCE} -> {TARGET}, selector {cfg.selector}, {cfg.dtype}, greedy, "
          f"{cfg.max_new_tokens} new tokens at most\n")
    for i, text in enumerate(prompts, 1):
        prompt = [{"role": "user", "content": text}]
        shown = text if len(text) < 300 else f"{text[:150]} [... {len(text)} characters ...] {text[-120:]}"
        print(f"=== prompt {i}: {shown}")
        alone = target.generate([prompt], sampling)[0]
        prefill = target.timings["prefill_s"]
        print(f"--- {TARGET} alone (prefill {prefill * 1e3:.0f} ms for {alone.prompt_tokens} tokens):")
        print(_indent(alone.text))
        for rho in cfg.rhos:
            out, res = pipe.generate([prompt], HandoffConfig(rho=rho, selector=cfg.selector), sampling)
            t = res.timings
            handoff_s = t["map"] + t["score"] + t["recompute"]
            agree = sum(a == b for a, b in zip(out[0].tokens, alone.tokens)) / max(len(alone.tokens), 1)
            print(f"--- handoff rho={rho:g}: recomputed {len(res.positions[0])}/{out[0].prompt_tokens} positions; "
                  f"map {t['map'] * 1e3:.0f} ms + score {t['score'] * 1e3:.0f} ms + recompute "
                  f"{t['recompute'] * 1e3:.0f} ms = {handoff_s * 1e3:.0f} ms vs prefill {prefill * 1e3:.0f} ms "
                  f"({prefill / handoff_s:.2f}x); source prefill {t['source_prefill'] * 1e3:.0f} ms (paid "
                  f"before the switch); tokens agreeing with target alone {agree:.0%}")
            print(_indent(out[0].text))
        print()
    print(f"demo finished in {time.perf_counter() - t0:.0f} s. Short prompts are dominated by fixed per-layer "
          "costs; `rarecache bench map` times longer ones.")
    return 0


def long_prompt(cfg: DemoConfig, mapper: Mapper, chars: int = 6000) -> str:
    """A long-context question about code the map was not calibrated on (the corpus's last documents)."""
    docs = load_corpus(cfg.corpus, cache_dir=cfg.cache_dir).documents
    used = mapper.info.calibration.get("documents_used", 0)
    code, i = "", len(docs) - 1
    while len(code) < chars and i >= used:
        code = docs[i] + "\n\n" + code
        i -= 1
    return f"{code[-chars:]}\n\nIn two sentences: what does the code above do?"


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.strip().splitlines()) or "    (empty)"
