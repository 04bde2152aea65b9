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
    max_new_tokens: int = 24
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
    texts = PROMPTS + [long_prompt(cfg, pipe.mapper)]
    prompts = [[{"role": "user", "content": t}] for t in texts]
    sampling = SamplingConfig(max_new_tokens=cfg.max_new_tokens)
    print(f"\nhandoff {SOURCE} -> {TARGET}, selector {cfg.selector}, {cfg.dtype}, greedy, at most "
          f"{cfg.max_new_tokens} new tokens; the {len(prompts)} prompts run as one batch per arm\n", file=sys.stderr)
    alone = target.generate(prompts, sampling)
    prefill = target.timings["prefill_s"]
    answers = {"target alone": alone}
    timing_rows = []
    for rho in cfg.rhos:
        outs, res = pipe.generate(prompts, HandoffConfig.named(rho, cfg.selector), sampling)
        answers[f"handoff rho={rho:g}"] = outs
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
    print(f"{'rho':>5} {'recomputed':>11} {'map ms':>8} {'score ms':>9} {'recompute ms':>13} {'handoff ms':>11} "
          f"{'speed-up':>9} {'agreement':>10}")
    for rho, n_rec, t, handoff_s, agree in timing_rows:
        print(f"{rho:>5g} {n_rec:>5}/{n_prompt:<5} {t['map'] * 1e3:>8.0f} {t['score'] * 1e3:>9.0f} "
              f"{t['recompute'] * 1e3:>13.0f} {handoff_s * 1e3:>11.0f} {prefill / handoff_s:>8.2f}x {agree:>10.0%}")
    print(f"speed-up = the 1.5B's own prefill / (map + score + recompute), timed in this run; the 0.5B's prefill "
          f"({timing_rows[0][2]['source_prefill'] * 1e3:.0f} ms) is paid before the switch in a cascade. "
          "Agreement = generated tokens equal to the 1.5B alone at the same step.")
    print(f"demo finished in {time.perf_counter() - t0:.0f} s")
    return 0


def long_prompt(cfg: DemoConfig, mapper: Mapper, chars: int = 2500) -> str:
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
