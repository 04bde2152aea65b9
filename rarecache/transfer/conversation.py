"""Multi-turn chat in which any turn may be answered by a different model.

Each model keeps its own cache and the token ids that cache holds. When a turn
goes to a model, the conversation is rendered again; the model keeps its rows for
the longest prefix it already holds, and the rest is either prefilled by itself
(it was the last to speak) or handed off: the model that spoke last prefills what
it has not seen, the map translates everything the receiving model has not seen,
and the receiving model recomputes the selected positions of that span. Switching
back works the same way.

Rows a model holds from a handoff stay approximate for the rest of the conversation, and so does every
row it computes after them (they attended to the mapped ones): on CoQA the error grows turn by turn
(docs/RESULTS.md 9). `heal` puts that right off the critical path: once a turn is answered, the model
prefills itself again from its first mapped row on, so its next turn reuses only its own rows and a
handoff costs accuracy on the turn it serves, not on every turn after.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..engine.cache import KVCache
from ..engine.generate import Generation, SamplingConfig, decode
from ..engine.llm import LLM
from ..engine.runner import Runner, spans
from ..errors import RarecacheError
from .gate.ladder import gated_handoff
from .gate.policy import GatePolicy, GateResult
from .handoff import HandoffConfig, HandoffResult, _now, handoff
from .mapper import Mapper
from .selectors import SELECTORS


@dataclass
class Held:
    """One model's cache of one token sequence: the rows of `ids`, from position 0."""

    cache: KVCache | None = None
    ids: list[int] = field(default_factory=list)  # tokens whose rows `cache` holds, from position 0
    approximate: list[int] = field(default_factory=list)  # positions whose rows came from a map, not the model
    # the first position whose row may not be the model's own: a handoff's first handed-off position (rows the
    # target recomputed there attended to mapped rows); None: all exact
    inexact_from: int | None = None

    def keep(self, n: int) -> None:
        """Hold only the first n positions (the rest are about to be rewritten)."""
        self.ids = self.ids[:n]
        self.approximate = [p for p in self.approximate if p < n]
        if self.inexact_from is not None and self.inexact_from >= n:
            self.inexact_from = None

    def reserve(self, runner: Runner, length: int) -> KVCache:
        """Make the cache hold `length` positions (allocated on first use, else grown) and return it."""
        self.cache = runner.new_cache(1, length) if self.cache is None else self.cache.grown(length)
        return self.cache

    @property
    def nbytes(self) -> int:
        return 0 if self.cache is None else self.cache.k.nbytes + self.cache.v.nbytes


@torch.inference_mode()
def heal(runner: Runner, st: Held, limit: int | None = None) -> int:
    """Make `st`'s rows the model's own again: every row from the first one that may not be
    (`Held.inexact_from`) to the end of what it holds is prefilled afresh over the rows before it (the
    model's own), which is exactly the model's prefill of `st.ids`. `limit`: at most that many positions
    now (the server heals between requests in such steps); the rows after them stay inexact, and the next
    call goes on from there. Returns the positions recomputed (0: all were its own)."""
    start = st.inexact_from
    if start is None or start >= len(st.ids):
        st.inexact_from, st.approximate = None, []
        return 0
    end = len(st.ids) if limit is None else min(len(st.ids), start + max(1, limit))
    toks, pos = spans([st.ids[:end]], [start], runner.device)
    runner.forward(toks, pos, st.cache, logits_at=None)
    done = end == len(st.ids)
    st.inexact_from = None if done else end
    st.approximate = [] if done else [p for p in st.approximate if p >= end]
    return end - start


@dataclass
class Turn:
    model: str
    text: str
    tokens: list[int]
    prompt_tokens: int
    reused: int  # positions the answering model already held
    handoff: HandoffResult | None  # set when the turn was handed off from another model
    seconds: dict[str, float]
    gate: GateResult | None = None  # set when a handoff went through the quality gate
    bpb: float | None = None  # `Conversation.score`: bits per byte of the given answer
    healed: int = 0  # positions the model prefilled again after answering (`heal`), in seconds["heal"]


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens `a` and `b` share (the one helper: evaluation, serving and benches use it)."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def kept(held: list[int], ids: list[int]) -> int:
    """The positions a model keeps of what it holds when it is given the prompt `ids`: their common
    prefix, short of the last position (always computed: it gives the logits)."""
    return min(common_prefix(held, ids), len(ids) - 1)


def check_maps(models: dict[str, LLM], maps: dict[tuple[str, str], Mapper], holder: str) -> None:
    """Refuse maps between models `holder` (e.g. "the conversation") does not have, or fitted for other models."""
    for (a, b), mapper in maps.items():
        if a not in models or b not in models:
            raise RarecacheError(f"map {a} -> {b} names a model {holder} does not have")
        mapper.check_pair(models[a].runner, models[b].runner)


@dataclass
class Started:
    """A prompt whose rows the answering model now holds, ready to decode from."""

    cache: KVCache  # the answering model's cache: rows of the whole prompt
    logits: torch.Tensor  # (1, V) at the prompt's last position
    keep: int  # positions the model already held
    handoff: HandoffResult | None  # set when the prompt was handed off
    sampling: SamplingConfig  # the request's, with the model's end tokens filled in
    seconds: float  # prefill or handoff
    gate: GateResult | None = None  # set when the handoff went through the quality gate
    reused_approximate: int = 0  # of the `keep` positions reused, how many may not be the model's own rows
    # (mapped, or computed over mapped rows: from `Held.inexact_from` on)


@torch.inference_mode()
def prefill_or_handoff(models: dict[str, LLM], maps: dict[tuple[str, str], Mapper], cfg: HandoffConfig,
                       sampling: SamplingConfig, model: str, ids: list[int], held: dict[str, Held],
                       source: str | None = None, gate: GatePolicy | None = None) -> Started:
    """Give `model` the rows of the prompt `ids`, starting from what it holds in `held[model]`.

    The model keeps its rows of the longest prefix it shares with `ids`; the rest is prefilled by
    itself, or, when `source` is given, handed off from `held[source]` (the source prefills what it
    has not seen, the map translates the span the model has not seen, the model recomputes the
    selected positions of that span; with a `gate`, its policy picks the budget or falls back to the
    model's own prefill instead of `cfg`'s fixed ρ). Both `held` entries then describe what their
    caches hold (the prompt); the caches have room for the answer.
    """
    llm = models[model]
    llm.check_fits(len(ids), sampling.max_new_tokens, model)
    need = len(ids) + sampling.max_new_tokens
    if source is not None and (source, model) not in maps:
        raise RarecacheError(f"no map from {source} to {model}")
    st = held[model]
    keep = kept(st.ids, ids)
    st.keep(keep)  # rows past `keep` are about to be overwritten
    reused_approximate = 0 if st.inexact_from is None else keep - st.inexact_from  # (st.keep: < keep)
    cache = st.reserve(llm.runner, need)
    cache.clear(keep)
    t0 = time.perf_counter()
    result = gated = None
    if source is not None:
        src = held[source]
        scorer = SELECTORS[gate.selector] if gate is not None else cfg.scorer
        # a selector reading the source's attention needs at least the last query: a source that holds the
        # whole prompt (a cascade re-asking the same turn of the other model) computes its last position again
        reads_attention = scorer is not None and scorer.needs_source_attention
        src_keep = min(common_prefix(src.ids, ids), len(ids) - reads_attention)
        src.keep(src_keep)
        src_cache = src.reserve(models[source].runner, need)
        src_cache.clear(src_keep)
        if gate is not None:
            _, logits, gated = gated_handoff(models[source].runner, llm.runner, maps[(source, model)], ids, gate,
                                             source_cache=src_cache, source_kept=src_keep, target_cache=cache,
                                             target_kept=keep)
            result = gated.handoff
        else:
            _, logits, result = handoff(models[source].runner, llm.runner, maps[(source, model)], [ids], cfg,
                                        source_cache=src_cache, source_kept=[src_keep], target_cache=cache,
                                        target_kept=[keep])
        if gated is None or gated.source_prefilled:  # the source now holds the whole prompt
            src.ids = list(ids)
        if gated is None or gated.decision != "fallback":  # rows the map wrote and nobody recomputed
            chosen = set(result.positions[0])
            mapped = [p for p in range(keep, len(ids)) if p not in chosen]
            st.approximate += mapped
            # rho 1 recomputes every position in one pass: the model's own rows (a gate's rungs are direct
            # handoffs, below 1: some rows stay mapped)
            if mapped:
                st.inexact_from = keep if st.inexact_from is None else min(st.inexact_from, keep)
    else:
        toks, pos = spans([ids], [keep], llm.runner.device)
        logits = llm.runner.forward(toks, pos, cache).logits
    st.ids = list(ids)
    return Started(cache, logits, keep, result, llm.with_eos(sampling), time.perf_counter() - t0, gated,
                   reused_approximate)


@torch.inference_mode()
def respond(models: dict[str, LLM], maps: dict[tuple[str, str], Mapper], cfg: HandoffConfig,
            sampling: SamplingConfig, model: str, ids: list[int], held: dict[str, Held],
            source: str | None = None, stop_check: Callable[[list[int]], bool] | None = None,
            gate: GatePolicy | None = None) -> tuple[Generation, int, Started, dict[str, float]]:
    """`prefill_or_handoff`, then decode the answer. `held[model]` then holds the prompt and the
    answer's fed tokens.

    `stop_check` goes to `decode` (it sees the tokens so far after each step; True ends the answer).
    Returns the generation, the positions kept, the start (its handoff and gate records) and phase seconds.
    """
    s = prefill_or_handoff(models, maps, cfg, sampling, model, ids, held, source, gate)
    t1 = time.perf_counter()
    gen = decode(models[model].runner, s.cache, s.logits, torch.tensor([len(ids)]), s.sampling, stop_check)[0]
    held[model].ids = ids + gen.fed
    return gen, s.keep, s, {"prefill_or_handoff": s.seconds, "decode": time.perf_counter() - t1}


class Conversation:
    def __init__(self, models: dict[str, LLM], maps: dict[tuple[str, str], Mapper],
                 cfg: HandoffConfig = HandoffConfig(), sampling: SamplingConfig = SamplingConfig(),
                 system: str | None = None, gate: GatePolicy | None = None, heal: bool = False):
        """`gate`: hand off through the quality gate's policy (adaptive ρ, fallback) instead of `cfg`'s ρ.
        `heal`: after each answer, the model that gave it makes its rows its own again (`heal`; timed
        apart from the turn, as a server would run it while it waits for the next)."""
        self.models, self.maps, self.cfg, self.sampling, self.gate = models, maps, cfg, sampling, gate
        self.heal = heal
        check_maps(models, maps, "the conversation")
        self.messages: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
        self.state = {name: Held() for name in models}
        self.last: str | None = None  # the model that spoke last
        self.turns: list[Turn] = []

    def handoff_source(self, model: str) -> str | None:
        """The model whose rows `model`'s next turn is handed off from: the one that spoke last, if
        another and mapped to `model`; None: `model` prefills itself."""
        prev = self.last
        return prev if prev is not None and prev != model and (prev, model) in self.maps else None

    @torch.inference_mode()
    def say(self, content: str, model: str) -> Turn:
        """Add a user message and let `model` answer it."""
        if model not in self.models:
            raise RarecacheError(f"unknown model {model!r}; this conversation has {', '.join(self.models)}")
        llm = self.models[model]
        self.messages.append({"role": "user", "content": content})
        ids = llm.encode(self.messages)
        source = self.handoff_source(model)
        try:
            gen, keep, started, seconds = respond(self.models, self.maps, self.cfg, self.sampling, model, ids,
                                                  self.state, source, gate=self.gate)
        except RarecacheError:
            self.messages.pop()
            raise
        text = llm.tokenizer.decode(gen.tokens)
        self.messages.append({"role": "assistant", "content": text})
        self.last = model
        turn = Turn(model, text, gen.tokens, len(ids), keep, started.handoff, seconds, started.gate)
        self._heal(turn)
        self.turns.append(turn)
        return turn

    def _heal(self, turn: Turn) -> None:
        if self.heal:
            runner = self.models[turn.model].runner
            t = _now(runner)
            turn.healed = heal(runner, self.state[turn.model])
            turn.seconds["heal"] = _now(runner) - t

    @torch.inference_mode()
    def score(self, content: str, answer: str, model: str) -> Turn:
        """Add a user message and a given answer to it, which `model` reads instead of writing: the
        turn records the answer's bits per byte under `model` (after the same prefill or handoff
        `say` does), and the conversation goes on from that answer. Drift over a conversation that
        switches model is this, turn after turn, against the model reading it all itself."""
        if model not in self.models:
            raise RarecacheError(f"unknown model {model!r}; this conversation has {', '.join(self.models)}")
        llm = self.models[model]
        tokens = llm.tokenizer.encode(answer, add_special_tokens=False)
        if not tokens:
            raise RarecacheError("the answer to score is empty")
        self.messages.append({"role": "user", "content": content})
        ids = llm.encode(self.messages)
        source = self.handoff_source(model)
        sampling = SamplingConfig(max_new_tokens=len(tokens))
        try:
            s = prefill_or_handoff(self.models, self.maps, self.cfg, sampling, model, ids, self.state, source,
                                   self.gate)
            t1 = time.perf_counter()
        except RarecacheError:
            self.messages.pop()
            raise
        lps = llm.runner.read(tokens, len(ids), s.cache, s.logits[0])  # the answer's rows stay for the next turn
        lp = lps[0, tokens[0]].item()
        if len(tokens) > 1:
            lp += lps[1:][torch.arange(len(tokens) - 1), torch.tensor(tokens[1:])].sum().item()
        self.state[model].ids = ids + tokens[:-1]
        self.messages.append({"role": "assistant", "content": answer})
        self.last = model
        bpb = -lp / (math.log(2) * len(answer.encode("utf-8")))
        turn = Turn(model, answer, tokens, len(ids), s.keep, s.handoff,
                    {"prefill_or_handoff": s.seconds, "score": time.perf_counter() - t1}, s.gate, bpb)
        self._heal(turn)
        self.turns.append(turn)
        return turn
