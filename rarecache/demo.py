"""`rarecache demo`: the product on the bundled pair, in a minute or two on a laptop CPU.

Pulls Qwen2.5-Coder 0.5B and 1.5B if needed, loads the general map rarecache ships
(`defaults.SERVED`: the map, selector and budget `serve` uses; nothing is calibrated),
then hands four fixed prompts (three short, one long about code) from the 0.5B to the 1.5B
at ρ = 0, the served budget and 1, decodes every arm's answers together, and prints the
answers, the phase timings, the speed-up over the 1.5B's own prefill of the same prompts
(timed in the same run, after a warm-up) and how many greedy tokens agree with the 1.5B's
own. It says what it is doing all along (a line per phase, bars with rates), since on a
2-core AVX2 CPU in float32 it takes about two minutes.
"""

from __future__ import annotations

import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from .defaults import MIN_HANDOFF_TOKENS, SERVED, served_map_file
from .dtypes import cpu_capability, dtype_name
from .engine.generate import Generation, SamplingConfig, decode
from .engine.llm import LLM
from .engine.runner import pad_batch
from .errors import RarecacheError
from .models.store import default_cache_dir, pull
from .transfer.fitting.calibrate import Calibration, CalibrationConfig
from .transfer.fitting.corpus import load_corpus
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


def served_or_quick_map(cfg: DemoConfig, source: LLM, target: LLM,
                        shipped: Mapper | None = None) -> tuple[Mapper, Path, str]:
    """The map the bundled pair is handed off through by `demo` and `serve`: the shipped general map
    (`shipped`, if the caller loaded it already), or a quick map (`demo_map`) where it does not fit the models
    as converted here. With its file and how to name it."""
    mapper = shipped if shipped is not None else Mapper.load(served_map_file())
    try:
        mapper.check_pair(source.runner, target.runner)
        return mapper, served_map_file(), f"the shipped map {Path(SERVED.file).name}"
    except RarecacheError as e:
        print(f"the shipped general map does not fit the models as converted here ({e}); using a quick map "
              "instead", file=sys.stderr)
    return demo_map(cfg, source, target), quick_map_path(cfg), f"a quick map fitted on chat-formatted '{cfg.corpus}'"


def quick_map_path(cfg: DemoConfig) -> Path:
    """Where `demo_map` keeps its map (cached after first use)."""
    root = Path(cfg.cache_dir or default_cache_dir()) / "maps"
    return root / f"demo-{SOURCE}-to-{TARGET}-{cfg.corpus}-chat-{cfg.tokens}-{cfg.dtype}.safetensors"


def demo_map(cfg: DemoConfig, source: LLM, target: LLM) -> Mapper:
    """A small map fitted on chat-formatted `cfg.corpus` (cached; resumable): the fallback where the shipped
    map does not fit the pair as converted here."""
    path = quick_map_path(cfg)
    path.parent.mkdir(parents=True, exist_ok=True)
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


class _Progress:
    """What the demo says while it works, on stderr: a line per phase with the seconds since the start and
    what it took, and a bar (rate, ETA) over the prompts of the arms and over the decoding steps, whose
    elapsed time ticks every second even inside one long forward pass, so no stretch is silent."""

    def __init__(self):
        self.start = self.last = time.perf_counter()

    def lap(self) -> float:
        """Seconds since the last line."""
        return time.perf_counter() - self.last

    def line(self, what: str) -> None:
        self.last = time.perf_counter()
        tqdm.write(f"[{self.last - self.start:5.1f} s] {what}", file=sys.stderr)

    @contextmanager
    def bar(self, total: int, unit: str, desc: str):
        bar = tqdm(total=total, unit=unit, desc=desc, file=sys.stderr, dynamic_ncols=True, leave=False,
                   disable=None)  # a terminal only: a log keeps the lines
        stop = threading.Event()

        def tick():
            while not stop.wait(1.0):
                bar.refresh()

        ticker = threading.Thread(target=tick, daemon=True)
        ticker.start()
        try:
            yield bar
        finally:
            stop.set()
            ticker.join()
            bar.close()


@dataclass
class Arms:
    """What the demo's arms did: each arm's answers (the target alone first, then a handoff per rho), the
    target's own prefill seconds, and per rho (rho, positions recomputed, phase seconds, handoff seconds)."""

    answers: dict[str, list[Generation]]
    prefill: float
    rows: list[tuple[float, int, dict[str, float], float]]


def run_arms(cfg: DemoConfig, pipe: Pipeline, ids: list[list[int]], progress: _Progress) -> Arms:
    """The target's own prefill of each prompt, then a handoff of each at every rho, each prompt into its own
    row of one cache; then one decode of every row together. Decoding is most of a CPU's time here, and
    reading the weights once per step for all the arms' rows costs little more than for one arm's (the
    answers are each arm's own: a row attends only to its own cache)."""
    target, n = pipe.target, len(ids)
    served = lambda r: r == SERVED.rho and cfg.selector == SERVED.selector  # noqa: E731  (the served arm: budget and selector)
    arms = ["target alone", *(f"handoff rho={r:g}{' (served)' if served(r) else ''}" for r in cfg.rhos)]
    cache = target.runner.new_cache(n * len(arms), max(len(i) for i in ids) + cfg.max_new_tokens)
    logits, rows = [], []
    with progress.bar(n * len(arms), "prompt", "prefill and handoffs") as bar:
        t = time.perf_counter()
        for b, p in enumerate(ids):  # a prompt at a time, as Runner.prefill on a CPU: no work on padding
            logits.append(target.runner.forward(*pad_batch([p], target.runner.device), cache.row(b)).logits)
            bar.update()
        prefill = time.perf_counter() - t
        progress.line(f"arm 1/{len(arms)}, {target.path.name} alone: prefill {prefill:.1f} s")
        for a, rho in enumerate(cfg.rhos, 1):
            spent, recomputed = {}, 0
            for b, p in enumerate(ids):
                lg, res = pipe.hand_off([p], HandoffConfig.named(rho, cfg.selector), [cache.row(a * n + b)])
                logits.append(lg)
                recomputed += res.recomputed(0)  # every pass counted
                spent = {k: spent.get(k, 0.0) + v for k, v in res.timings.items()}
                bar.update()
            handoff_s = spent["map"] + spent["score"] + spent["recompute"]
            rows.append((rho, recomputed, spent, handoff_s))
            progress.line(f"arm {a + 1}/{len(arms)}, handoff rho {rho:g}: {progress.lap():.1f} s (map + score + "
                          f"recompute {handoff_s:.1f} s{'; the 0.5B prefill before them' if a == 1 else ''})")
    sampling = target.with_eos(SamplingConfig(max_new_tokens=cfg.max_new_tokens))
    with progress.bar(cfg.max_new_tokens - 1, "step", f"decoding {n * len(arms)} answers together") as bar:
        gens = decode(target.runner, cache, torch.cat(logits), torch.tensor([len(i) for i in ids] * len(arms)),
                      sampling, on_step=bar.update)
    progress.line(f"decoded in {progress.lap():.1f} s")
    return Arms({arm: gens[a * n:(a + 1) * n] for a, arm in enumerate(arms)}, prefill, rows)


def run_demo(cfg: DemoConfig) -> int:
    progress = _Progress()
    for name in (SOURCE, TARGET):
        pull(name, cache_dir=cfg.cache_dir)
    progress.line(f"loading {SOURCE} and {TARGET} in {cfg.dtype} ...")
    source, target = (LLM(n, dtype=cfg.dtype, cache_dir=cfg.cache_dir) for n in (SOURCE, TARGET))
    progress.line(f"loaded both models in {progress.lap():.1f} s")
    mapper, _, map_name = served_or_quick_map(cfg, source, target)
    pipe = Pipeline(source, target, mapper)
    texts = PROMPTS + [long_prompt(cfg, pipe.mapper)]
    prompts = [[{"role": "user", "content": t}] for t in texts]
    ids = [target.encode(p) for p in prompts]
    target.check_fits(max(len(i) for i in ids), cfg.max_new_tokens)
    progress.line(f"handoff {SOURCE} -> {TARGET} through {map_name}, selector {cfg.selector}, served budget rho "
                  f"{SERVED.rho:g}, {cfg.dtype}; {len(ids)} prompts ({'+'.join(str(len(i)) for i in ids)} tokens) "
                  f"in each of {len(cfg.rhos) + 1} arms, then every arm's answers decoded together (greedy, at most "
                  f"{cfg.max_new_tokens} tokens)")
    warm = [prompts[0]]  # first calls pay one-time costs (allocation, kernel choice): not timed
    target.generate(warm, SamplingConfig(max_new_tokens=1))
    pipe.generate(warm, HandoffConfig.named(0.5, cfg.selector), SamplingConfig(max_new_tokens=1))
    progress.line(f"warmed up in {progress.lap():.1f} s (first calls pay one-time costs; not timed)")
    arms = run_arms(cfg, pipe, ids, progress)
    alone = arms.answers["target alone"]
    print(file=sys.stderr)
    for i, text in enumerate(texts):
        shown = text if len(text) < 300 else f"{text[:120]} [... {len(text)} characters ...] {text[-60:]}"
        short = (f"; under {MIN_HANDOFF_TOKENS} tokens `rarecache serve` re-reads it instead of handing off"
                 if len(ids[i]) < MIN_HANDOFF_TOKENS else "")
        print(f"=== prompt {i + 1} ({len(ids[i])} tokens{short}): {shown}")
        for arm, outs in arms.answers.items():
            print(f"--- {arm}:")
            print(_indent(target.tokenizer.decode(outs[i].tokens)))
        print()
    n_prompt = sum(len(i) for i in ids)
    print(f"{TARGET} own prefill of the batch ({n_prompt} tokens): {arms.prefill * 1e3:.0f} ms")
    print(f"{'rho':>7} {'recomputed':>11} {'map ms':>8} {'score ms':>9} {'recompute ms':>13} {'handoff ms':>11} "
          f"{'speed-up':>9} {'agreement':>10}")
    for (rho, n_rec, t, handoff_s), outs in zip(arms.rows, list(arms.answers.values())[1:]):
        agree = [sum(x == y for x, y in zip(o.tokens, ref.tokens)) / max(len(ref.tokens), 1)
                 for o, ref in zip(outs, alone)]
        mark = "*" if rho == SERVED.rho else ""
        print(f"{rho:>5g}{mark:<2}{n_rec:>5}/{n_prompt:<5} {t['map'] * 1e3:>8.0f} {t['score'] * 1e3:>9.0f} "
              f"{t['recompute'] * 1e3:>13.0f} {handoff_s * 1e3:>11.0f} {arms.prefill / handoff_s:>8.2f}x "
              f"{sum(agree) / len(agree):>10.0%}")
    served = (f", as `rarecache serve` hands off prompts of {MIN_HANDOFF_TOKENS} tokens or more"
              if cfg.selector == SERVED.selector else "")
    print(f"speed-up = the 1.5B's own prefill / (map + score + recompute), timed in this run; the 0.5B's prefill "
          f"({arms.rows[0][2]['source_prefill'] * 1e3:.0f} ms) is paid before the switch in a cascade. "
          "Agreement = generated tokens equal to the 1.5B alone at the same step. * the served budget "
          f"({cfg.selector}{served}).")
    print(f"demo finished in {time.perf_counter() - progress.start:.0f} s ({cfg.dtype}, CPU {cpu_capability()})")
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
