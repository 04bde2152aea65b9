"""Time to first token when a conversation changes model: handoff vs re-reading.

A router that moves a conversation to another model mid-session normally pays
that model's prefill of the whole conversation; through the chat service's shared
store it pays a map and a partial recompute instead. Both are timed here in the
same run, on the same scripted conversations, through the same `ChatService` code
(the baseline service simply holds no maps), after a warm-up. Each arm continues
its conversations with its own answers, and the table says whether the two arms'
answers agree (exactly, and in how many leading tokens). Passages come from documents the map was
not calibrated on.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from ..engine.generate import SamplingConfig
from ..engine.llm import LLM
from ..errors import RarecacheError
from ..serve.service import ChatService, Reply, ServiceConfig
from ..transfer.conversation import common_prefix
from ..transfer.corpus import load_corpus
from ..transfer.handoff import HandoffConfig
from ..transfer.mapper import Mapper

QUESTIONS = (
    "Summarise the passage in two sentences.",
    "Which names, dates or numbers does the passage mention?",
    "What would be a good title for the passage?",
    "Explain the passage to a ten-year-old in three sentences.",
)


@dataclass(frozen=True)
class SwitchBenchConfig:
    conversations: int = 3
    passage_tokens: int = 1024
    schedule: tuple[str, ...] = ("source", "target", "target")  # who answers each turn
    max_new_tokens: int = 32
    corpus: str = "wiki"
    handoff: HandoffConfig = HandoffConfig(rho=0.3)
    questions: tuple[str, ...] = QUESTIONS  # the user's message at each turn (after the passage in the first)

    def __post_init__(self):
        if not 1 <= len(self.schedule) <= len(self.questions):
            raise RarecacheError(f"the schedule has 1 to {len(self.questions)} turns")
        if any(s not in ("source", "target") for s in self.schedule):
            raise RarecacheError("schedule entries are 'source' or 'target'")
        if self.conversations < 1 or self.passage_tokens < 16 or self.max_new_tokens < 1:
            raise RarecacheError("need conversations >= 1, passage tokens >= 16 and max new tokens >= 1")


def passages(cfg: SwitchBenchConfig, llm: LLM, maps: list[Mapper], cache_dir=None) -> list[str]:
    """`cfg.conversations` passages of about `passage_tokens` tokens from the end of the corpus,
    from documents none of the maps was calibrated on (checked)."""
    corpus = load_corpus(cfg.corpus, cache_dir=cache_dir)
    # calibration reads a corpus's documents in order: the first `documents_used` are the map's
    same = [m.info.calibration for m in maps if m.info.corpus.get("fingerprint") == corpus.fingerprint]
    first_unused = max((c.get("documents_used", len(corpus.documents)) for c in same), default=0)
    out = []
    for index in range(len(corpus.documents) - 1, first_unused - 1, -1):
        doc = corpus.documents[index]
        ids = llm.tokenizer.encode(doc) if isinstance(doc, str) else []
        if len(ids) >= cfg.passage_tokens:
            out.append(llm.tokenizer.decode(ids[: cfg.passage_tokens]))
        if len(out) == cfg.conversations:
            return out
    raise RarecacheError(f"{cfg.corpus} has fewer than {cfg.conversations} unused documents of "
                         f"{cfg.passage_tokens} tokens")


def ttft(reply: Reply) -> float:
    """Seconds to the first token's logits: the prefill or handoff (the queue is empty here)."""
    return reply.seconds["prefill_or_handoff"]


def run_switch_bench(source: LLM, target: LLM, forward: Mapper, backward: Mapper | None,
                     cfg: SwitchBenchConfig, cache_dir=None, emit=print) -> dict:
    names = {"source": source.path.name, "target": target.path.name}
    if names["source"] == names["target"]:
        raise RarecacheError("source and target are the same model")
    models = {names["source"]: source, names["target"]: target}
    maps = {(names["source"], names["target"]): forward}
    if backward is not None:
        maps[(names["target"], names["source"])] = backward
    arms = {"baseline": ChatService(models, {}, ServiceConfig(cfg.handoff)),
            "rarecache": ChatService(models, maps, ServiceConfig(cfg.handoff))}
    sampling = SamplingConfig(max_new_tokens=cfg.max_new_tokens)
    texts = passages(cfg, source, list(maps.values()), cache_dir)
    for llm in models.values():  # warm-up, outside both arms' stores
        ChatService({"m": llm}, {}).complete("m", [{"role": "user", "content": texts[0][:200]}], sampling)

    emit(f"time to first token per turn, {names['source']} <-> {names['target']}, rho {cfg.handoff.rho:g} "
         f"({cfg.handoff.name}), {cfg.conversations} conversations of {len(cfg.schedule)} turns, "
         f"passages of {cfg.passage_tokens} tokens, {cfg.max_new_tokens} new tokens")
    emit(f"{'conv':>4} {'turn':>4} {'model':<7} {'prompt':>6}  {'baseline':<21}  {'rarecache':<40} {'speedup':>7} "
         f"{'agree':>7}")
    rows = []
    history = {arm: [[] for _ in texts] for arm in arms}
    for c, passage in enumerate(texts):
        for t, who in enumerate(cfg.schedule):
            question = cfg.questions[t]
            user = f"Read this passage.\n\n{passage}\n\n{question}" if t == 0 else question
            order = list(arms) if (c + t) % 2 == 0 else list(reversed(arms))  # neither arm always runs first
            replies = {}
            for arm in order:
                messages = history[arm][c]
                messages.append({"role": "user", "content": user})
                replies[arm] = arms[arm].complete(names[who], messages, sampling)
                messages.append({"role": "assistant", "content": replies[arm].text})
            b, r = replies["baseline"], replies["rarecache"]
            how = (f"handoff {r.recomputed}/{r.handed_off} recomputed" if r.handed_off_from
                   else f"kept {r.reused}" if r.reused else "prefill")
            row = {"conversation": c, "turn": t, "model": who, "prompt_tokens": r.prompt_tokens,
                   "baseline_ttft_s": ttft(b), "baseline_reused": b.reused, "rarecache_ttft_s": ttft(r),
                   "rarecache_reused": r.reused, "handed_off_from": r.handed_off_from, "handed_off": r.handed_off,
                   "recomputed": r.recomputed, "speedup": ttft(b) / ttft(r), "same_answer": b.text == r.text,
                   "agree_tokens": common_prefix(b.tokens, r.tokens), "new_tokens": len(b.tokens),
                   "switched": t > 0 and who != cfg.schedule[t - 1]}
            rows.append(row)
            emit(f"{c:>4} {t:>4} {who:<7} {r.prompt_tokens:>6}  {ttft(b) * 1e3:>8.0f} ms kept {b.reused:<5}  "
                 f"{ttft(r) * 1e3:>8.0f} ms {how:<29} {row['speedup']:>6.2f}x "
                 f"{row['agree_tokens']:>3}/{len(b.tokens):<3}")
    switched = [r for r in rows if r["switched"]]
    summary = {"bench": "serve-switch", "source": names["source"], "target": names["target"],
               "rho": cfg.handoff.rho, "selector": cfg.handoff.name, "conversations": cfg.conversations,
               "passage_tokens": cfg.passage_tokens, "schedule": list(cfg.schedule),
               "median_switch_speedup": statistics.median(r["speedup"] for r in switched) if switched else None,
               "switch_same_answer": sum(r["same_answer"] for r in switched), "switches": len(switched),
               "rows": rows}
    if switched:
        emit(f"switched turns: median time-to-first-token speed-up {summary['median_switch_speedup']:.2f}x over "
             f"re-reading; same answer as the baseline in {summary['switch_same_answer']} of {len(switched)} (agree: "
             f"leading tokens equal to the baseline's answer)")
    return summary
