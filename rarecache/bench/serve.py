"""Time to first token when a conversation changes model: handoff vs re-reading.

A router that moves a conversation to another model mid-session normally pays
that model's prefill of the whole conversation; through the chat service's shared
store it pays a map and a partial recompute instead. Both are timed here in the
same run, on the same scripted conversations, through the same `ChatService` code
(the baseline service simply holds no maps), after a warm-up. Each arm continues
its conversations with its own answers, and the table says whether the two arms'
answers agree (exactly, and in how many leading tokens). Passages come from documents the map was
not calibrated on.

Inside vLLM (`--engine vllm`, `run_vllm_switch_bench`) the question is the same for a serving
engineer: on the same two vLLM engines, does the switched turn's first token come sooner through
the connector than by vLLM prefilling the conversation itself? The baseline request is sent so
that vLLM must compute every prompt position (no handoff, a cache salt of its own so its prefix
cache holds nothing of the prompt), and each reply is checked for that, not assumed; the arms
alternate which goes first and the figure is a ratio of medians from the same run.
"""

from __future__ import annotations

import json
import statistics
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from ..engine.generate import SamplingConfig
from ..engine.llm import LLM
from ..errors import RarecacheError
from ..serve.service import ChatService, Reply, ServiceConfig
from ..transfer.conversation import common_prefix
from ..transfer.fitting.corpus import load_corpus
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
    handoff: HandoffConfig = HandoffConfig()  # the served default (defaults.SERVED)
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
    arms = {"baseline": ChatService(models, {}, ServiceConfig(cfg.handoff)),  # (timing handoffs at every length:
            "rarecache": ChatService(models, maps, ServiceConfig(cfg.handoff, min_handoff_tokens=0))}  # no floor)
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


# ---------------------------------------------------------------------------------------
# inside vLLM: `rarecache bench serve --engine vllm`
# ---------------------------------------------------------------------------------------
# The service is duck-typed (adapters/vllm/server/serving.VllmChatService: prepare, answer(reread=, rho=),
# models[name].tokenizer, cfg.max_batch), so this room does not import the adapter.

FOLLOW_UP = QUESTIONS[1]  # the switched turn's question


@dataclass(frozen=True)
class VllmSwitchConfig:
    lengths: tuple[int, ...] = (512, 2048, 4096)  # the switched turn's prompt length T
    rhos: tuple[float, ...] = (0.1, 0.3)
    repeats: int = 3  # timed runs of every arm, interleaved, after one warm-up
    answer_tokens: int = 16  # the source's answer to the first turn
    max_new_tokens: int = 8  # the switched turn's answer, in both arms
    corpus: str = "wiki"

    def __post_init__(self):
        check_lengths(self.lengths, "--lengths")
        if not self.rhos or len(set(self.rhos)) != len(self.rhos) or not all(
                isinstance(r, (int, float)) and not isinstance(r, bool) and 0 <= r <= 1 for r in self.rhos):
            raise RarecacheError(f"--rhos takes distinct numbers in [0, 1], not {list(self.rhos)}")
        if self.repeats < 1 or self.answer_tokens < 1 or self.max_new_tokens < 1:
            raise RarecacheError("need --repeats, --answer-tokens and --max-new-tokens >= 1")


def check_lengths(lengths, flag: str) -> None:
    if not lengths or len(set(lengths)) != len(lengths) or any(type(T) is not int or T < 64 for T in lengths):
        raise RarecacheError(f"{flag} takes distinct prompt lengths >= 64, not {list(lengths)}")


def switched_conversations(svc, source: str, target: str, T: int, n: int, answer_tokens: int, new_tokens: int,
                           maps, corpus: str, cache_dir=None) -> list[tuple[list[int], str]]:
    """`n` conversations whose second turn is about T tokens: the source answers the first (a held-out
    passage and a question; `answer_tokens` tokens, all n at once, untimed) and files its rows; the
    result is the target's prompt of turn 2 and the conversation's salt, for each."""
    tok = svc.models[target].tokenizer
    frame = tok.encode_chat([{"role": "user", "content": f"Read this passage.\n\n\n\n{QUESTIONS[0]}"},
                             {"role": "assistant", "content": ""}, {"role": "user", "content": FOLLOW_UP}])
    room = T - len(frame) - answer_tokens
    if room < 16:
        raise RarecacheError(f"a prompt of {T} tokens leaves {room} for the passage after the chat template and "
                             f"the first answer: take a longer one")
    texts = passages(SwitchBenchConfig(conversations=n, passage_tokens=room, corpus=corpus), svc.models[source],
                     maps, cache_dir)
    tag = uuid.uuid4().hex[:12]
    salts = [f"bench-{tag}-{T}-{i}" for i in range(n)]
    first = SamplingConfig(max_new_tokens=answer_tokens, ignore_eos=True)
    turn1 = [[{"role": "user", "content": f"Read this passage.\n\n{p}\n\n{QUESTIONS[0]}"}] for p in texts]

    def ask(i: int):
        return svc.answer(source, svc.prepare(source, turn1[i], first, salt=salts[i]), first, salt=salts[i])

    with ThreadPoolExecutor(max_workers=max(1, svc.cfg.max_batch)) as pool:
        answers = list(pool.map(ask, range(n)))
    later = SamplingConfig(max_new_tokens=new_tokens)  # prepare checks that the answer fits
    return [(svc.prepare(target, m + [{"role": "assistant", "content": a.text}, {"role": "user", "content": FOLLOW_UP}],
                         later, salt=s), s) for m, a, s in zip(turn1, answers, salts)]


def ask_target(svc, source: str, target: str, ids: list[int], salt: str, sampling: SamplingConfig,
               rho: float | None):
    """One switched turn on the target: rho None is vLLM alone (it reads the whole prompt itself, its
    prefix cache holding none of it), else the connector's handoff at rho. Checked, not assumed."""
    reply = svc.answer(target, ids, sampling, salt=salt, reread=rho is None, rho=rho)
    if rho is None and (reply.handed_off_from is not None or reply.reused or reply.prefilled != len(ids)):
        raise RarecacheError(f"the baseline did not read the whole prompt itself (reused {reply.reused}, handed off "
                             f"from {reply.handed_off_from}): the comparison would not be vLLM alone")
    return reply


def run_vllm_switch_bench(svc, source: str, target: str, cfg: VllmSwitchConfig, maps=(), settings=None,
                          cache_dir=None, emit=print) -> dict:
    """Time to first token of the switched turn, vLLM alone vs the connector's handoff at each ρ,
    on the same engines, arms interleaved (rotating which goes first), median of `repeats`."""
    sampling = SamplingConfig(max_new_tokens=cfg.max_new_tokens, ignore_eos=True)
    convs = {T: switched_conversations(svc, source, target, T, 1, cfg.answer_tokens, cfg.max_new_tokens, list(maps),
                                       cfg.corpus, cache_dir)[0] for T in sorted(cfg.lengths)}
    arms: list[float | None] = [None, *cfg.rhos]
    first_T = min(cfg.lengths)
    for rho in arms:  # warm-up, not counted
        ask_target(svc, source, target, *convs[first_T], sampling, rho)
    emit(f"time to first token of a switched conversation inside vLLM, {source} -> {target}: vLLM alone (it "
         f"reads the whole prompt) vs the connector's handoff, same engines, median of {cfg.repeats}, interleaved")
    emit(f"{'T':>5} {'prompt':>6} {'rho':>4} {'claimed':>7} {'recomp':>6} {'tail':>5} {'spent':>5} "
         f"{'vLLM ms':>9} {'handoff ms':>10} {'speedup':>7} {'agree':>7}")
    rows = []
    for T in sorted(cfg.lengths):
        ids, salt = convs[T]
        got: dict[float | None, list] = {rho: [] for rho in arms}
        for r in range(cfg.repeats):
            for rho in arms[r % len(arms):] + arms[: r % len(arms)]:  # neither arm always first
                reply = ask_target(svc, source, target, ids, salt, sampling, rho)
                if rho is not None and (reply.handed_off_from != source or reply.note):
                    raise RarecacheError(f"T={T}, rho={rho:g}: the target did not hand off "
                                         f"({reply.note or 'no note'})")
                got[rho].append(reply)
        base = [x.seconds["first_token"] for x in got[None]]
        for rho in cfg.rhos:
            hand = got[rho]
            h, b = hand[-1], got[None][-1]
            P, tail = len(ids), h.prefilled
            row = {"T": T, "prompt_tokens": P, "rho": rho, "claimed": h.handed_off, "recomputed": h.recomputed,
                   "tail": tail, "rho_spent": (h.recomputed + tail) / P,
                   "vllm_ttft_s": statistics.median(base), "handoff_ttft_s":
                       statistics.median(x.seconds["first_token"] for x in hand),
                   "vllm_ttft_all_s": base, "handoff_ttft_all_s": [x.seconds["first_token"] for x in hand],
                   "handoff_worker_s": statistics.median(x.seconds.get("handoff", 0.0) for x in hand),
                   "store_read_s": statistics.median(x.seconds.get("store_read", 0.0) for x in hand),
                   "bytes_per_handoff": statistics.median(
                       (getattr(x, "handoff", None) or {}).get("bytes_read") or 0 for x in hand),
                   "vllm_prefilled": b.prefilled, "vllm_reused": b.reused,
                   "same_answer": all(x.tokens == y.tokens for x, y in zip(hand, got[None])),
                   "agree_tokens": common_prefix(b.tokens, h.tokens), "new_tokens": len(b.tokens)}
            row["speedup"] = row["vllm_ttft_s"] / row["handoff_ttft_s"]
            row["transfer_share"] = row["store_read_s"] / row["handoff_ttft_s"]  # of the TTFT, moving rows
            rows.append(row)
            emit(f"{T:>5} {P:>6} {rho:>4g} {h.handed_off:>7} {h.recomputed:>6} {tail:>5} {row['rho_spent']:>5.2f} "
                 f"{row['vllm_ttft_s'] * 1e3:>9.0f} {row['handoff_ttft_s'] * 1e3:>10.0f} {row['speedup']:>6.2f}x "
                 f"{row['agree_tokens']:>3}/{row['new_tokens']:<3}")
    emit("spent: the share of prompt positions the target computed (recomputed + vLLM's tail); agree: leading "
         "tokens of the answer equal to vLLM alone's")
    return {"bench": "vllm-switch", "source": source, "target": target,
            "settings": {**(settings or {}), "lengths": list(cfg.lengths), "rhos": list(cfg.rhos),
                         "repeats": cfg.repeats, "answer_tokens": cfg.answer_tokens,
                         "max_new_tokens": cfg.max_new_tokens, "corpus": cfg.corpus},
            "rows": rows}


# what may differ between runs whose cells one summary holds: which cells, and how many repeats
PER_RUN = ("lengths", "rhos", "repeats")


def summary_group(result: dict) -> str:
    """The summary's group of a switch run: "switch" (rows through a directory store) or
    "switch_redis" (through a Redis server), each with keys of its own."""
    return "switch_redis" if (result.get("settings") or {}).get("store") == "redis" else "switch"


def switch_summary(result: dict, previous: dict | None = None) -> dict:
    """The summary's keys for the switch bench: vLLM alone / handoff, per "T/rho". `previous` (the
    summary file as it was): its cells are kept where this run measured none, if its switch settings
    are this run's but for PER_RUN (the same engines and environment), so the table can be run in
    parts; otherwise they are dropped. `settings` is this run's, with the lengths and rhos of every
    cell kept. Through a Redis store the keys end in `_redis` and add the bytes moved per handoff and
    the share of the TTFT spent moving rows."""
    group = summary_group(result)
    suffix = group.removeprefix("switch")
    key = f"switch_ttft_speedup{suffix}"
    cells = {f"{r['T']}/{r['rho']:g}": r["speedup"] for r in result["rows"]}
    settings = dict(result.get("settings") or {})
    old = ((previous or {}).get("settings") or {})
    old = old.get(group) if isinstance(old, dict) else None
    same = isinstance(old, dict) and {k: v for k, v in old.items() if k not in PER_RUN} == {
        k: v for k, v in settings.items() if k not in PER_RUN}
    kept = previous.get(key) if same else None
    if isinstance(kept, dict):
        cells = {**{k: v for k, v in kept.items() if isinstance(k, str) and isinstance(v, (int, float))}, **cells}
        for k in ("lengths", "rhos"):
            settings[k] = sorted(set(old.get(k) or []) | set(settings.get(k) or []))
        if old.get("repeats") != settings.get("repeats"):
            settings["repeats"] = sorted({old.get("repeats"), settings.get("repeats")} - {None})
    order = lambda kv: tuple(float(x) for x in kv[0].split("/"))  # noqa: E731
    cells = dict(sorted(cells.items(), key=order))
    if suffix:
        return {key: cells, "settings": settings,
                **{f"switch_{name}{suffix}": dict(sorted(({f"{r['T']}/{r['rho']:g}": r[name] for r in result["rows"]}
                                                          ).items(), key=order))
                   for name in ("bytes_per_handoff", "transfer_share")}}
    return {"switch_ttft_speedup_T2048_rho0.3": cells.get("2048/0.3"), key: cells, "settings": settings}


def update_summary(path: Path, keys: dict, bench: str, settings: dict) -> dict:
    """Read-modify-write the benches' summary file: this bench's keys and its settings, the rest kept
    (each bench writes its own, so they can run separately)."""
    data: dict = {}
    if path.exists():
        try:
            data = json.loads(path.read_text())
        except ValueError:
            data = None
        if not isinstance(data, dict):
            raise RarecacheError(f"{path} is not a JSON object; move it or give another --summary")
    data.update(keys)
    data.setdefault("settings", {})[bench] = settings
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)
    return data
