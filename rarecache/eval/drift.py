"""Drift over conversations that switch model every turn: CoQA stories read turn by turn with their
gold answers, the models taking turns (source on odd turns, target on even), against each model
reading the whole conversation itself.

Each turn is scored, not generated (`Conversation.score`): the answering model reads the gold
answer and its bits per byte are recorded, so the only thing that differs between arms is how
the model came by its rows. Every switch hands off only what the model has not seen since it
last spoke, and it keeps the rows it computed, mapped or recomputed before: any error that
accumulates over a conversation shows up turn by turn. Arms: `alone` (each model its own
conversation, every turn scored by both), `switch/RHO:SELECTOR` (a fixed budget) and
`switch/gate` (the quality gate's policy). One JSON line per (story, turn, arm), written a story
and arm at a time; a rerun continues where it stopped. The stories are CoQA's evaluated ones
(the calibration pool, the last 100, is never read here).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tqdm import tqdm

from ..engine.llm import LLM
from ..errors import RarecacheError
from ..transfer.conversation import Conversation
from ..transfer.gate import GatePolicy
from ..transfer.handoff import HandoffConfig
from ..transfer.mapper import Mapper
from .results import read_done
from .tasks.coqa import CALIBRATION_STORIES, INSTRUCTION, MAX_TURNS, _stories


def parse_arm(spec: str) -> tuple[str, HandoffConfig | None]:
    """"alone", "gate" or "RHO:SELECTOR" -> (arm name, config)."""
    if spec in ("alone", "gate"):
        return (spec if spec == "alone" else "switch/gate"), None
    rho, _, sel = spec.partition(":")
    try:
        cfg = HandoffConfig(float(rho), sel or "rank")
    except ValueError:
        raise RarecacheError(f"bad drift arm {spec!r}: use alone, gate or RHO:SELECTOR (e.g. 0.2:attn-source)") from None
    return f"switch/{cfg.rho:g}:{cfg.name}", cfg


def conversations(cache_dir: Path | None, stories: int) -> list[tuple[str, list[tuple[str, str]]]]:
    """The first `stories` evaluated CoQA stories as (story id, [(user message, gold answer)] up to 10 turns)."""
    all_stories = _stories(cache_dir)[:-CALIBRATION_STORIES]
    out = []
    for story, passage, qa, _ in all_stories[:stories]:
        turns = [(f"{INSTRUCTION}Passage: {passage.strip()}\n\nQuestion: {qa[0]['question']}", qa[0]["answer"])]
        turns += [(f"Question: {qa[k]['question']}", qa[k]["answer"]) for k in range(1, min(MAX_TURNS, len(qa)))]
        out.append((story, [(u, a if a.strip() else "unknown") for u, a in turns]))
    return out


def _switch(story: str, turns, arm: str, models: dict[str, LLM], maps: dict[tuple[str, str], Mapper],
            cfg: HandoffConfig | None, gate: GatePolicy | None) -> list[dict]:
    conv = Conversation(models, maps, cfg or HandoffConfig(), gate=gate if cfg is None else None)
    rows = []
    for t, (user, answer) in enumerate(turns, 1):
        who = "source" if t % 2 else "target"
        turn = conv.score(user, answer, who)
        row = {"story": story, "turn": t, "arm": arm, "model": who, "bpb": turn.bpb, "prompt_tokens": turn.prompt_tokens,
               "reused": turn.reused, "seconds": turn.seconds}
        if turn.handoff is not None:
            start, end = turn.handoff.handed_off[0]
            row.update(handed_off=end - start, recomputed=len(turn.handoff.positions[0]))
        if turn.gate is not None:
            row["gate"] = turn.gate.record()
        rows.append(row)
    return rows


def _alone(story: str, turns, models: dict[str, LLM]) -> list[dict]:
    rows = []
    for who in ("source", "target"):
        conv = Conversation({who: models[who]}, {})
        for t, (user, answer) in enumerate(turns, 1):
            turn = conv.score(user, answer, who)
            rows.append({"story": story, "turn": t, "arm": "alone", "model": who, "bpb": turn.bpb,
                         "prompt_tokens": turn.prompt_tokens, "seconds": turn.seconds})
    return rows


def run_drift(convs, source: LLM, target: LLM, maps: dict[tuple[str, str], Mapper], arms: list[str],
              gate: GatePolicy | None, out: Path, progress: bool = True) -> Path:
    """Every (story, arm) not yet in `out`, appended a story and arm at a time. `maps` are keyed by
    ("source", "target") and, if given, ("target", "source")."""
    parsed = [parse_arm(a) for a in arms]
    if any(name == "switch/gate" for name, _ in parsed) and gate is None:
        raise RarecacheError("the gate arm needs a policy (--gate-policy)")
    models = {"source": source, "target": target}
    done = read_done(out, key=("story", "arm"))
    out.parent.mkdir(parents=True, exist_ok=True)
    jobs = [(s, turns, name, cfg) for s, turns in convs for name, cfg in parsed if (s, name) not in done]
    with open(out, "a") as f:
        for story, turns, name, cfg in tqdm(jobs, desc="drift", unit="conversation", disable=not progress,
                                            file=sys.stderr, dynamic_ncols=True):
            rows = _alone(story, turns, models) if name == "alone" else _switch(story, turns, name, models, maps,
                                                                                 cfg, gate)
            f.write("".join(json.dumps(r) + "\n" for r in rows))
            f.flush()
    return out


def report(path: Path) -> tuple[str, dict]:
    """Per switching arm, on the turns the target answered after a handoff: the bpb drift against the
    target reading it all itself (mean over stories of each story's mean, 95% CI over stories), by
    turn, and for the gate its fallbacks and recomputed share (a fallback counts 1.0)."""
    import numpy as np

    from .metrics import mean_ci

    if not path.is_file():
        raise RarecacheError(f"no drift results file {path}")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    alone = {(r["story"], r["turn"], r["model"]): r["bpb"] for r in rows if r["arm"] == "alone"}
    arms = sorted({r["arm"] for r in rows if r["arm"] != "alone"})
    lines = ["| arm | stories | target turns | Δ bpb vs target alone (95% CI over stories) | by turn (2, 4, 6, 8, 10) "
             "| fell back | recomputed share |", "|---|---|---|---|---|---|---|"]
    out = {}
    for arm in arms:
        per_story: dict[str, list[float]] = {}
        by_turn: dict[int, list[float]] = {}
        shares, fell = [], 0
        for r in rows:
            key = (r["story"], r["turn"], r["model"])
            if r["arm"] != arm or r["model"] != "target" or "handed_off" not in r or key not in alone:
                continue
            d = r["bpb"] - alone[key]
            per_story.setdefault(r["story"], []).append(d)
            by_turn.setdefault(r["turn"], []).append(d)
            g = r.get("gate")
            fell += bool(g and g["decision"] == "fallback")
            shares.append(1.0 if g and g["decision"] == "fallback" else r["recomputed"] / r["handed_off"])
        if not per_story:
            continue
        m, lo, hi = mean_ci([float(np.mean(v)) for v in per_story.values()])
        n = len(shares)
        turns = " ".join(f"{np.mean(by_turn[t]):+.4f}" if t in by_turn else "—" for t in (2, 4, 6, 8, 10))
        lines.append(f"| {arm} | {len(per_story)} | {n} | {m:+.4f} ({lo:+.4f}, {hi:+.4f}) | {turns} | "
                     f"{fell / n:.1%} | {np.mean(shares):.3f} |")
        out[arm] = {"unit": "bpb", "delta": m, "ci": [lo, hi], "n": n, "stories": len(per_story),
                    "fallback_share": fell / n, "mean_recomputed_share": float(np.mean(shares)),
                    "by_turn": {t: float(np.mean(v)) for t, v in sorted(by_turn.items())}}
    return "\n".join(lines), out
