"""Drift over conversations that switch model every turn: CoQA stories read turn by turn with their
gold answers, the models taking turns (source on odd turns, target on even), against each model
reading the whole conversation itself.

Each turn is scored, not generated (`Conversation.score`): the answering model reads the gold
answer and its bits per byte are recorded, so the only thing that differs between arms is how
the model came by its rows. Every switch hands off only what the model has not seen since it
last spoke, and it keeps the rows it computed, mapped or recomputed before: any error that
accumulates over a conversation shows up turn by turn. Arms: `alone` (each model its own
conversation, every turn scored by both), `switch/RHO:SELECTOR` (a fixed budget) and
`switch/gate` (the quality gate's policy); either with `:heal` (`RHO:SELECTOR:heal`, `gate:heal`)
heals after every answer (`transfer.conversation.heal`: the model prefills itself again from the
handoff's first position, timed apart as `seconds.heal`), so a handoff's error stays on its own turn. One JSON line per (story, turn, arm), written a story
and arm at a time; a rerun continues where it stopped. The stories are CoQA's evaluated ones
(the calibration pool, the last 100, is never read here).

`eval/drift_server.py` runs the same arms through a chat server (`rarecache serve`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Callable

import torch
from tqdm import tqdm

from ..engine.llm import LLM
from ..engine.runner import spans
from ..errors import RarecacheError
from ..registry import RANK
from ..transfer.conversation import Conversation, kept
from ..transfer.gate.policy import GatePolicy, gate_rule
from ..transfer.handoff import HandoffConfig, _now
from ..transfer.mapper import Mapper
from .results import check_meta, load_results, read_done, sibling
from .tasks.coqa import CALIBRATION_STORIES, INSTRUCTION, MAX_TURNS, _stories


HEAL = ":heal"


def parse_arm(spec: str) -> tuple[str, HandoffConfig | None]:
    """"alone", "gate" or "RHO:SELECTOR", the switching ones optionally ending ":heal" -> (arm name,
    config; None: alone or the gate)."""
    base = spec[: -len(HEAL)] if spec.endswith(HEAL) else spec
    tail = spec[len(base):]
    if spec == "alone":
        return spec, None
    if base == "gate":
        return "switch/gate" + tail, None
    rho, _, sel = base.partition(":")
    try:
        cfg = HandoffConfig(float(rho), sel or RANK)
    except ValueError:
        raise RarecacheError(f"bad drift arm {spec!r}: use alone, gate or RHO:SELECTOR (e.g. 0.2:attn-source), "
                             "a switching one optionally ending :heal") from None
    return f"switch/{cfg.rho:g}:{cfg.name}{tail}", cfg


def is_gate(arm: str) -> bool:
    """The arm hands off through the gate's policy (healing or not)."""
    return arm in ("switch/gate", "switch/gate" + HEAL)


def heals(arm: str) -> bool:
    return arm.endswith(HEAL)


def conversations(cache_dir: Path | None, stories: int) -> list[tuple[str, list[tuple[str, str]]]]:
    """The first `stories` evaluated CoQA stories as (story id, [(user message, gold answer)] up to 10 turns)."""
    all_stories = _stories(cache_dir)[:-CALIBRATION_STORIES]
    out = []
    for story, passage, qa, _ in all_stories[:stories]:
        turns = [(f"{INSTRUCTION}Passage: {passage.strip()}\n\nQuestion: {qa[0]['question']}", qa[0]["answer"])]
        turns += [(f"Question: {qa[k]['question']}", qa[k]["answer"]) for k in range(1, min(MAX_TURNS, len(qa)))]
        out.append((story, [(u, a if a.strip() else "unknown") for u, a in turns]))
    return out


class _Local:
    """A `Conversation` scoring the turns: each turn's row fields. On a turn that is handed off, the
    answering model's own prefill of the same span is timed first (`own_prefill_s` over
    `own_prefill_tokens`, on a copy of its cache), the baseline the handoff's seconds are set against."""

    def __init__(self, conv: Conversation):
        self.conv = conv

    @torch.inference_mode()
    def _own_prefill(self, user: str, who: str) -> tuple[float, int] | None:
        conv = self.conv
        if conv.handoff_source(who) is None:
            return None  # not a handoff: the model prefills itself anyway
        llm, st = conv.models[who], conv.state[who]
        ids = llm.encode([*conv.messages, {"role": "user", "content": user}])
        keep = kept(st.ids, ids)  # what the turn keeps (prefill_or_handoff)
        scratch = llm.runner.new_cache(1, len(ids))
        if keep:
            scratch.copy_prefix(st.cache, keep)
        toks, pos = spans([ids], [keep], llm.runner.device)
        t = _now(llm.runner)
        llm.runner.forward(toks, pos, scratch)
        return _now(llm.runner) - t, len(ids) - keep

    def score(self, user: str, answer: str, who: str) -> dict:
        own = self._own_prefill(user, who)
        turn = self.conv.score(user, answer, who)
        row = {"model": who, "bpb": turn.bpb, "prompt_tokens": turn.prompt_tokens, "reused": turn.reused,
               "seconds": turn.seconds, **({"healed": turn.healed} if self.conv.heal else {})}
        if turn.handoff is not None:
            start, end = turn.handoff.handed_off[0]
            row.update(handed_off=end - start, recomputed=turn.handoff.recomputed(0),
                       own_prefill_s=own[0], own_prefill_tokens=own[1])
        if turn.gate is not None:
            row["gate"] = turn.gate.record()
        return row


def _switch(story: str, turns, arm: str, conv) -> list[dict]:
    """The models taking turns in one conversation (`conv.score(user, answer, who)` gives a turn's row fields)."""
    return [{"story": story, "turn": t, "arm": arm, **conv.score(user, answer, "source" if t % 2 else "target")}
            for t, (user, answer) in enumerate(turns, 1)]


def _alone(story: str, turns, conversation: Callable[[str], Any]) -> list[dict]:
    """Each model reading the whole conversation itself (`conversation(who)`: a conversation of its own)."""
    rows = []
    for who in ("source", "target"):
        conv = conversation(who)
        rows += [{"story": story, "turn": t, "arm": "alone", **conv.score(user, answer, who)}
                 for t, (user, answer) in enumerate(turns, 1)]
    return rows


def run_arms(convs, parsed: list[tuple[str, HandoffConfig | None]], out: Path, progress: bool,
             via: str | None, switch: Callable[[str, HandoffConfig | None], Any], alone: Callable[[str], Any]) -> Path:
    """Every (story, arm) not yet in `out`, appended a story and arm at a time: `switch(arm, cfg)` makes
    a switching arm's conversation, `alone(who)` a model's own; `via` is what the rows say they came
    through (None: `Conversation`), and a file of the other path's rows is refused."""
    done = read_done(out, key=("story", "arm"))
    if done:
        _check_via(out, via)
    out.parent.mkdir(parents=True, exist_ok=True)
    jobs = [(s, turns, name, cfg) for s, turns in convs for name, cfg in parsed if (s, name) not in done]
    with open(out, "a") as f:
        for story, turns, name, cfg in tqdm(jobs, desc="drift" if via is None else f"drift ({via})",
                                            unit="conversation", disable=not progress, file=sys.stderr,
                                            dynamic_ncols=True):
            rows = _alone(story, turns, alone) if name == "alone" else _switch(story, turns, name, switch(name, cfg))
            f.write("".join(json.dumps(r) + "\n" for r in rows))
            f.flush()
    return out


def _check_via(out: Path, via: str | None) -> None:
    for line in out.read_text().splitlines():
        if line.strip() and json.loads(line).get("via") != via:
            theirs = json.loads(line).get("via") or "Conversation (in process)"
            raise RarecacheError(f"{out} holds rows computed through {theirs}; write this run's "
                                 f"({via or 'Conversation'}) to another --out")


DRIFT_KEYS = ("task", "source", "target", "dtype", "seed", "reverse")  # what a drift file's rows depend on


def drift_meta(meta: dict, reverse: bool, arms: list[str], gate: GatePolicy | None) -> dict:
    """A drift run's record (`results.models_meta`, checked on resume like an evaluation's): whether
    the target hands back through a map of its own, and the gate's rule when the gate arm runs."""
    runs = gate is not None and any(is_gate(parse_arm(a)[0]) for a in arms)
    return {"task": "coqa_drift", **meta, "reverse": reverse, "gate": gate_rule(gate) if runs else None}


def run_drift(convs, source: LLM, target: LLM, maps: dict[tuple[str, str], Mapper], arms: list[str],
              gate: GatePolicy | None, out: Path, progress: bool = True, meta: dict | None = None) -> Path:
    """Every (story, arm) not yet in `out`, appended a story and arm at a time. `maps` are keyed by
    ("source", "target") and, if given, ("target", "source"). `meta` (`drift_meta`): resuming a file
    made with other models, maps, dtype or gate rule is refused."""
    parsed = [parse_arm(a) for a in arms]
    if any(is_gate(name) for name, _ in parsed) and gate is None:
        raise RarecacheError("the gate arm needs a policy (--gate-policy)")
    if meta is not None:
        if read_done(out, key=("story", "arm")) and not out.with_suffix(".meta.json").is_file():
            raise RarecacheError(f"{out} holds rows but no run record ({out.with_suffix('.meta.json').name}): what "
                                 "they were run with is unknown; write this run to another --out")
        check_meta(out, meta, DRIFT_KEYS, once=("gate",))
    models = {"source": source, "target": target}
    return run_arms(convs, parsed, out, progress, None,
                lambda arm, cfg: _Local(Conversation(models, maps, cfg or HandoffConfig(),
                                                     gate=gate if cfg is None else None, heal=heals(arm))),
                lambda who: _Local(Conversation({who: models[who]}, {})))


def report(path: Path) -> tuple[str, dict]:
    """Per switching arm, on the turns the target answered after a handoff: the bpb drift against the
    target reading it all itself (mean over stories of each story's mean, 95% CI over stories), by
    turn, and for the gate its fallbacks and recomputed share (a fallback counts 1.0). The expected
    speed-up sets the target's own prefill of each handed-off span, timed in the same run
    (`own_prefill_s`), against what the turn's handoff took (the source's prefill of what it had not
    seen, map, selection, recompute, and any fallback prefill); None for rows without the baseline."""
    import numpy as np

    from .significance import mean_ci

    if not path.is_file():
        raise RarecacheError(f"no drift results file {path}")
    rows = load_results(path)
    alone = {(r["story"], r["turn"], r["model"]): r["bpb"] for r in rows if r["arm"] == "alone"}
    arms = sorted({r["arm"] for r in rows if r["arm"] != "alone"})
    lines = ["| arm | stories | target turns | Δ bpb vs target alone (95% CI over stories) | by turn (2, 4, 6, 8, 10) "
             "| fell back | recomputed share | expected speed-up | healing (span + answer), × own prefill of the span |",
             "|---|---|---|---|---|---|---|---|---|"]
    out = {}
    for arm in arms:
        per_story: dict[str, list[float]] = {}
        own_bpb: dict[str, list[float]] = {}  # the target alone on the same turns
        small_bpb: dict[str, list[float]] = {}  # the source alone on them (absent in files without its rows)
        by_turn: dict[int, list[float]] = {}
        shares, fell, own, spent, healed = [], 0, [], [], []
        for r in rows:
            key = (r["story"], r["turn"], r["model"])
            if r["arm"] != arm or r["model"] != "target" or "handed_off" not in r or key not in alone:
                continue
            d = r["bpb"] - alone[key]
            per_story.setdefault(r["story"], []).append(d)
            own_bpb.setdefault(r["story"], []).append(alone[key])
            if (r["story"], r["turn"], "source") in alone:
                small_bpb.setdefault(r["story"], []).append(alone[r["story"], r["turn"], "source"])
            by_turn.setdefault(r["turn"], []).append(d)
            g = r.get("gate")
            fell += bool(g and g["decision"] == "fallback")
            shares.append(1.0 if g and g["decision"] == "fallback" else r["recomputed"] / r["handed_off"])
            own.append(r.get("own_prefill_s"))
            spent.append(r["seconds"]["prefill_or_handoff"])
            healed.append(r["seconds"].get("heal"))
        if not per_story:
            continue
        m, lo, hi = mean_ci([float(np.mean(v)) for v in per_story.values()])
        n = len(shares)
        turns = " ".join(f"{np.mean(by_turn[t]):+.4f}" if t in by_turn else "—" for t in (2, 4, 6, 8, 10))
        speedup = sum(own) / sum(spent) if own and None not in own and sum(spent) > 0 else None
        # what healing the handed-off turns costs after they are answered, against the target's own prefill
        heal = (sum(healed) / sum(own) if heals(arm) and own and None not in own and None not in healed
                and sum(own) > 0 else None)
        lines.append(f"| {arm} | {len(per_story)} | {n} | {m:+.4f} ({lo:+.4f}, {hi:+.4f}) | {turns} | "
                     f"{fell / n:.1%} | {np.mean(shares):.3f} | {'—' if speedup is None else f'{speedup:.2f}×'} | "
                     f"{'—' if heal is None else f'{heal:.2f}'} |")
        target = float(np.mean([np.mean(v) for v in own_bpb.values()]))
        source = float(np.mean([np.mean(v) for v in small_bpb.values()])) if small_bpb else None
        out[arm] = {"unit": "bpb", "delta": m, "ci": [lo, hi], "n": n, "stories": len(per_story),
                    "target": target, "gated": target + m, "source": source, "expected_speedup": speedup,
                    "fallback_share": fell / n, "mean_recomputed_share": float(np.mean(shares)),
                    "heal_over_own_prefill": heal,
                    "by_turn": {t: float(np.mean(v)) for t, v in sorted(by_turn.items())}}
    return "\n".join(lines), out


def run_record(path: Path, map_sha256: str | None, whose: str) -> dict:
    """A drift file's run record, after checking it handed off through the map `map_sha256` (`whose`: what
    else went through that map, for the message)."""
    meta_path = sibling(path, ".meta.json")
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError):
        raise RarecacheError(f"{path}: no readable run record {meta_path} (a drift file written before "
                             "drift runs recorded one cannot say what it ran)") from None
    sha = (meta.get("maps", {}).get("source->target") or {}).get("sha256")
    if map_sha256 is None or sha != map_sha256:
        raise RarecacheError(f"{path}: handed off through map {str(sha)[:12]}, {whose} through "
                             f"{str(map_sha256)[:12]}")
    return meta


def arm_figures(path: Path, arm: str) -> dict:
    """`report`'s figures of one arm of a drift file (refused when it has no target turn of that arm)."""
    figures = report(path)[1].get(arm)
    if figures is None:
        raise RarecacheError(f"{path} holds no target turn of arm {arm} yet")
    return figures


def gate_figures(path: Path, policy: GatePolicy, map_sha256: str | None) -> dict:
    """The gate arm of a drift file as one task of `eval gate report` (coqa_bpb), after checking from
    its record that it ran with this policy's rule through the map `map_sha256` (that of the ladders)."""
    meta = run_record(path, map_sha256, "the ladders")
    rule = gate_rule(policy)
    if meta.get("gate") != rule:
        raise RarecacheError(f"{path}: its gate arm ran with another rule ({meta.get('gate')}) than the policy's "
                             f"({rule})")
    return {**arm_figures(path, "switch/gate"), "auc": None, "auc_ci": None}
