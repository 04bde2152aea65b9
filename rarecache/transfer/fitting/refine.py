"""Output-aware refinement of a closed-form map: a few hundred gradient steps that make the target's
next-token distribution over a handed-off cache closer to its own, with the map's form unchanged.

Why: ridge fits each target row in squared error, weighing every row and every direction alike, while
the target reads the rows through attention. Where the answer is read from the mapped text (MMLU's
question, a passage), rows that fit well in squared error still move the answer (issue #41; the closed-form
KV mapping paper, arXiv 2608.03893, finds calibration R² does not predict retention across pairs). C2C
(ICLR 2026) trains its projector on the receiver's own loss; here the same idea is applied to the linear
map itself, starting from the closed-form fit, so the refined file serves at the same cost.

The objective is the handoff the map serves: a calibration sequence of T tokens is cut at T − n, where n is
what the `suffix` selector recomputes at a budget ρ (`handoff.budget`). The first T − n positions get mapped
rows (differentiable in the map's weight and bias); the target runs the last n tokens through every layer
over them, exactly as a handoff's recompute does, and the loss is KL(target's own distribution ‖ this one)
at those n positions. Only the last n tokens run with gradients, so a step costs about three times a forward
pass over ρT tokens. The target's own distribution comes from `suffix_logits` over its own rows, which is the
target's prefill (tested against `Runner.forward`).

The change is learnt on standardised inputs in units of each layer's output spread (`Delta`), so one learning
rate suits every layer; held-out sequences (documents after the training ones) decide the step kept.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from ...engine.runner import Runner
from ...errors import RarecacheError
from ..features import SIDES, rows, token_block, token_rows
from ..handoff import budget
from ..mapper import Mapper
from ..sidefit import SideFit
from .corpus import Corpus, token_sequences
from .refine_state import resume, save_state


WEIGHTINGS = ("uniform", "context")
LOCAL = 16  # tokens before the suffix a "context" weight lets the target see


@dataclass(frozen=True)
class RefineConfig:
    steps: int = 300  # one sequence per step
    lr: float = 1e-5  # Adam's step on standardised inputs, in units of the rows' spread (Delta)
    rhos: tuple[float, ...] = (0.1, 0.2, 0.3)  # budgets a step's cut is drawn from
    seq_len: int = 512
    min_len: int = 64  # sequences are cut to a length drawn from [min_len, seq_len]
    heldout: int = 12  # held-out sequences (each at a ρ drawn from `rhos`, as training's)
    every: int = 50  # steps between held-out checks
    first_document: int = 0  # training sequences come from here on; held-out ones after them
    seed: int = 0
    weighting: str = "uniform"  # the loss over recomputed positions: "uniform", or "context" (`Example`)
    prompt_share: float = 0.0  # share of training and held-out cuts that are whole task prompts (`prompt_cuts`)
    prompt_sets: tuple[tuple[str, str], ...] = ()  # (task, corpus fingerprint) of those prompts; set by `refine`
    temperature: float = 1.0  # both distributions' temperature in the KL (`kl`): below 1 it weighs the top choices

    def __post_init__(self):
        if self.weighting not in WEIGHTINGS:
            raise RarecacheError(f"unknown weighting {self.weighting!r}: {', '.join(WEIGHTINGS)}")
        if self.steps < 1 or self.heldout < 1 or self.every < 1 or not (self.lr > 0 and math.isfinite(self.lr)):
            raise RarecacheError("refinement needs steps >= 1, heldout >= 1, every >= 1 and lr > 0")
        if not self.rhos or not all(0 < r < 1 for r in self.rhos):
            raise RarecacheError("refinement budgets (rhos) must lie strictly between 0 and 1")
        if not 2 <= self.min_len <= self.seq_len:
            raise RarecacheError("refinement needs 2 <= min_len <= seq_len")
        if not (0 < self.temperature <= 1):
            raise RarecacheError(f"the KL's temperature must lie in (0, 1], got {self.temperature}")
        if not 0 <= self.prompt_share < 1:
            raise RarecacheError(f"the share of task prompts must lie in [0, 1), got {self.prompt_share}")


class Delta(torch.nn.Module):
    """The trainable change of a map's weight and bias per side, on standardised inputs and in units of the
    outputs' spread: per target layer l, ŷ' = ŷ + σ_y ⊙ (((x − μ_x) / σ_x) U + u), U and u starting at zero
    (float32). In these units a step of Adam moves every layer's rows by a like share of their spread,
    whatever the inputs' scale (keys carry a large common part; a raw-weight step moved them by far more).
    μ_x, σ_x, σ_y are measured on `inputs` (side -> per layer (N, K·ds [+ 2·dt]), e.g. the held-out
    examples'); `fitted` folds the change back into the map's own weight and bias."""

    def __init__(self, mapper: Mapper, inputs: dict[str, list[torch.Tensor]]):
        super().__init__()
        self.base = {s: mapper.sides[s] for s in SIDES}
        for s in SIDES:
            w, b = self.base[s].weight.float(), self.base[s].bias.float()  # (Lt, kd, dt), (Lt, dt)
            x = torch.stack([xl.float() for xl in inputs[s]])  # (Lt, N, kd)
            mu, sd = x.mean(1), x.std(1).clamp(min=1e-6)  # (Lt, kd)
            sy = torch.baddbmm(b[:, None], x, w).std(1).clamp(min=1e-6)  # (Lt, dt)
            for name, t in (("mu", mu), ("sd", sd), ("sy", sy)):
                self.register_buffer(f"{s}_{name}", t)
            self.register_parameter(f"{s}_w", torch.nn.Parameter(torch.zeros(w.shape)))
            self.register_parameter(f"{s}_b", torch.nn.Parameter(torch.zeros(b.shape)))

    def weight(self, side: str) -> torch.Tensor:
        """W0 + U σ_y / σ_x, (Lt, kd, dt)."""
        u, sd, sy = getattr(self, f"{side}_w"), getattr(self, f"{side}_sd"), getattr(self, f"{side}_sy")
        return self.base[side].weight.float() + u * sy[:, None, :] / sd[:, :, None]

    def bias(self, side: str) -> torch.Tensor:
        """b0 + σ_y ⊙ (u − (μ_x / σ_x) U), (Lt, dt)."""
        u, ub = getattr(self, f"{side}_w"), getattr(self, f"{side}_b")
        mu, sd, sy = (getattr(self, f"{side}_{n}") for n in ("mu", "sd", "sy"))
        shift = torch.bmm((mu / sd)[:, None], u)[:, 0]  # (Lt, dt)
        return self.base[side].bias.float() + sy * (ub - shift)

    def fitted(self, mapper: Mapper) -> dict[str, SideFit]:
        """The map's sides with this change applied, each added in the stored tensor's own precision (no change
        leaves the map's bytes as they were). The mean prediction (what rank disagreement centres on) moves by
        the change's mean over the measured inputs, μ_x ΔW + Δb; the rank basis is kept."""
        with torch.no_grad():
            out = {}
            for s in SIDES:
                f = mapper.sides[s]
                dw = self.weight(s) - f.weight.float()  # (Lt, kd, dt)
                db = self.bias(s) - f.bias.float()  # (Lt, dt)
                dmean = torch.bmm(getattr(self, f"{s}_mu")[:, None], dw)[:, 0] + db  # (Lt, dt)
                out[s] = replace(f, weight=f.weight + dw.to(f.weight.dtype), bias=f.bias + db.to(f.bias.dtype),
                                 mean=f.mean + dmean.to(f.mean.dtype))
            return out


def layer_inputs(mapper: Mapper, x: dict[str, torch.Tensor], own: dict[str, torch.Tensor] | None
                 ) -> dict[str, list[torch.Tensor]]:
    """What each mapped target layer reads: side -> per layer (P, K·ds [+ 2·dt]) float32, from source content
    rows x[side] (1, P, Ls·ds) and, for a token-input map, the token block of `own`."""
    extra = token_block(own).float() if mapper.info.token_inputs else None
    out = {}
    for s in SIDES:
        fit = mapper.sides[s]
        _, P, _ = x[s].shape
        layers = x[s][0].float().reshape(P, fit.r2_single.shape[1], -1)  # (P, Ls, ds)
        xs = [layers[:, fit.sources[l]].reshape(P, -1) for l in range(fit.weight.shape[0])]  # (P, K·ds)
        out[s] = [torch.cat([xl, extra[0]], dim=1) for xl in xs] if extra is not None else xs
    return out


def mapped_rows(mapper: Mapper, delta: Delta | None, x: dict[str, torch.Tensor], own: dict[str, torch.Tensor] | None,
                target: Runner, positions: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Target rows of source content rows x[side] (1, P, Ls·ds) at positions (1, P), as a handoff writes them
    (keys rotated), per layer (1, Hkv, P, D) in the target's dtype; differentiable in `delta` (None: the map
    as stored). Exact layers hold the target's own rows `own`. `Mapper.map_rows` is the reference (tested)."""
    cfg = target.config
    H, D = cfg.num_kv_heads, cfg.head_dim
    inputs = layer_inputs(mapper, x, own)
    out = {}
    for s in SIDES:
        fit = mapper.sides[s]
        w = delta.weight(s) if delta is not None else fit.weight.float()
        b = delta.bias(s) if delta is not None else fit.bias.float()
        side = []
        for l, xl in enumerate(inputs[s]):
            y = own[s][0].float() if l < mapper.exact_layers else xl @ w[l] + b[l]  # (P, dt)
            P = y.shape[0]
            y = y.to(target.dtype).reshape(1, P, H, D).transpose(1, 2)  # (1, Hkv, P, D)
            side.append(target.rope.apply(y, positions) if s == "k" else y)
        out[s] = side
    return out["k"], out["v"]


def suffix_logits(target: Runner, tokens: torch.Tensor, positions: torch.Tensor, past_k: list[torch.Tensor],
                  past_v: list[torch.Tensor]) -> torch.Tensor:
    """The target over tokens (1, n) at positions (1, n), after past rows per layer (1, Hkv, P, D) at
    positions 0..P-1 (the n positions follow them): every layer computes the tokens' own rows and attends to
    the past and, causally, to them. -> float32 logits (1, n, V). Differentiable; equal to a handoff's
    recompute of a suffix (and, over the target's own rows, to its prefill: tested)."""
    n, P = tokens.shape[1], past_k[0].shape[2]
    allowed = torch.ones(n, P + n, dtype=torch.bool, device=tokens.device)
    allowed[:, P:] = torch.ones(n, n, dtype=torch.bool, device=tokens.device).tril()
    h = target.embed(tokens)
    cos_sin = target.cos_sin(positions)
    for i in range(target.num_layers):
        q, k, v = target.qkv(i, h, cos_sin)  # (1, H, n, D), (1, Hkv, n, D)
        k, v = torch.cat([past_k[i], k], dim=2), torch.cat([past_v[i], v], dim=2)  # (1, Hkv, P + n, D)
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True)
        h = target.finish(i, h, attn)
    return target.model.logits(h)


def kl_each(teacher: torch.Tensor, student: torch.Tensor) -> torch.Tensor:
    """KL(teacher ‖ student) per position, logits (..., V) -> (...) in nats."""
    t, s = teacher.float().log_softmax(-1), student.float().log_softmax(-1)
    return (t.exp() * (t - s)).sum(-1)


def kl(teacher: torch.Tensor, student: torch.Tensor, weight: torch.Tensor | None = None,
       temperature: float = 1.0) -> torch.Tensor:
    """Mean over positions of KL(teacher ‖ student), logits (..., V) in nats; weighted by `weight` (...) when
    given (a weighted mean). Below temperature 1 both distributions are sharpened first: where the teacher is
    nearly flat between its top choices (a multiple-choice answer), KL at 1 pays almost nothing for putting
    the student's argmax on the wrong one; sharpened, it pays in proportion to the margins' error. The
    minimum is still the teacher itself."""
    each = kl_each(teacher / temperature, student / temperature)
    return each.mean() if weight is None else (each * weight).sum() / weight.sum().clamp(min=1e-12)


@dataclass(frozen=True)
class Cut:
    """One training or held-out example: a token sequence and how many of its newest positions are recomputed."""

    ids: tuple[int, ...]
    n: int


class Example:
    """What one cut needs, computed without gradients: the source's content rows and the target's own
    layer-0 rows of the mapped prefix, the target's own logits at the recomputed suffix and, under
    `weighting="context"`, each suffix position's weight: KL from the target's own distribution there to its
    distribution when it sees only the last LOCAL tokens before the suffix (its own rows: keys keep their
    positions), so positions that read the mapped text from further back (a question, a passage) count, and
    running text the suffix and its neighbourhood predict do not."""

    def __init__(self, cut: Cut, source: Runner, target: Runner, mapper: Mapper, weighting: str = "uniform",
                 temperature: float = 1.0):
        self.temperature = temperature  # the loss's (`kl`); the context weights read distributions at 1
        with torch.no_grad():
            ids = torch.tensor([cut.ids], device=target.device)
            T, self.n = ids.shape[1], cut.n
            P = T - cut.n
            self.prefix = torch.arange(P, device=target.device)[None]
            self.suffix = torch.arange(P, T, device=target.device)[None]
            self.tokens = ids[:, P:]
            s_cache, _ = source.prefill([list(cut.ids[:P])])
            self.x = {s: rows(source, s_cache, self.prefix, s) for s in SIDES}
            self.own = token_rows(target, ids[:, :P]) if mapper.needs_tokens else None
            t_cache, _ = target.prefill([list(cut.ids[:P])])
            past = [t_cache.layer(i, P) for i in range(target.num_layers)]
            self.teacher = suffix_logits(target, self.tokens, self.suffix, [k for k, _ in past], [v for _, v in past])
            self.weight = None  # (1, n) per recomputed position, under `weighting == "context"`
            if weighting == "context":  # how much each position's prediction reads the prefix beyond its last
                w = slice(max(0, P - LOCAL), P)  # LOCAL tokens: KL from the target over only those (own rows)
                near = suffix_logits(target, self.tokens, self.suffix, [k[:, :, w] for k, _ in past],
                                     [v[:, :, w] for _, v in past])
                self.weight = kl_each(self.teacher, near)  # (1, n)

    def loss(self, mapper: Mapper, delta: Delta | None, target: Runner) -> torch.Tensor:
        k, v = mapped_rows(mapper, delta, self.x, self.own, target, self.prefix)
        return kl(self.teacher, suffix_logits(target, self.tokens, self.suffix, k, v), self.weight, self.temperature)


def cuts(corpus: Corpus, tokenizer, cfg: RefineConfig, count: int, first_document: int, rng: random.Random
         ) -> tuple[list[Cut], int]:
    """`count` cuts from the corpus's sequences of documents >= first_document, each cut to a drawn length
    with a drawn ρ; and the first document after the last one used."""
    out, last = [], first_document
    for doc, ids in token_sequences(corpus, tokenizer, cfg.seq_len):
        if doc < first_document or len(ids) < cfg.min_len:
            continue
        if len(out) == count:
            return out, last
        T = rng.randint(cfg.min_len, len(ids))
        out.append(Cut(tuple(ids[:T]), min(T - 1, budget(rng.choice(cfg.rhos), T))))
        last = doc + 1
    if len(out) < count:
        raise RarecacheError(f"corpus {corpus.name} has {len(out)} sequences from document {first_document} on; "
                             f"refinement needs {count}")
    return out, last


def prompt_cuts(prompts: dict[str, Corpus], tokenizer, cfg: RefineConfig, count: int, skip: dict[str, int],
                rng: random.Random) -> tuple[list[Cut], dict[str, int]]:
    """`count` whole task prompts, taken in turn from each corpus (a task's calibration pool in its evaluated
    format, which ends where the answer is read), each cut at a drawn ρ; prompts longer than `cfg.seq_len`
    are passed over. `skip`: prompts already taken per task (held-out ones come after the training ones).
    Returns the cuts and the prompts taken per task so far, for the next call and the map's record."""
    streams = {name: ((doc, ids) for doc, ids in token_sequences(c, tokenizer, cfg.seq_len + 1) if doc >= skip[name])
               for name, c in prompts.items()}  # (one token past seq_len: a longer prompt shows itself)
    taken, out, names = dict(skip), [], sorted(prompts)
    while len(out) < count:
        name = names[len(out) % len(names)]
        for doc, ids in streams[name]:
            taken[name] = doc + 1
            if len(ids) <= cfg.seq_len:
                out.append(Cut(tuple(ids), min(len(ids) - 1, budget(rng.choice(cfg.rhos), len(ids)))))
                break
        else:
            raise RarecacheError(f"the {name} prompts ran out after {taken[name]}: refinement needs {count} prompts "
                                 "in all (lower --prompt-share or --steps)")
    return out, taken


def interleave(general: list[Cut], prompts: list[Cut]) -> list[Cut]:
    """The prompts spread evenly among the general cuts, in a fixed order."""
    n = len(general) + len(prompts)
    at = {(i * n) // len(prompts) + n // (2 * len(prompts)) for i in range(len(prompts))} if prompts else set()
    g, p = iter(general), iter(prompts)
    return [next(p) if i in at else next(g) for i in range(n)]


def heldout_kl(examples: list[Example], mapper: Mapper, delta: Delta | None, target: Runner) -> float:
    with torch.no_grad():
        return sum(e.loss(mapper, delta, target).item() for e in examples) / len(examples)


def refine(mapper: Mapper, source: Runner, target: Runner, tokenizer, corpus: Corpus, cfg: RefineConfig,
           progress: bool = True, log=print, state: Path | None = None, prompts: dict[str, Corpus] | None = None
           ) -> tuple[Mapper, dict]:
    """The map refined on `corpus` (the map's own calibration text, checked; from `cfg.first_document` on), and the
    record of the run (held-out KL before, at every check and kept). `target` must run with gradients
    through its layers: load it unpacked (`Runner.load(..., pack=False)`). `state`: a file the run saves
    itself to at every check and resumes from (the same map and settings only). `prompts`: task name ->
    its calibration pool (disjoint from its evaluated items: the caller's check), of which whole prompts make
    `cfg.prompt_share` of the training and held-out cuts; the record lists the prompts read, so an evaluation
    refuses the map on any of them (`Mapper.read_ids`)."""
    if mapper.info.mlp_hidden or mapper.info.heads:
        raise RarecacheError("refinement needs a dense linear map (not head-matched, no MLP)")
    if target.packed:
        raise RarecacheError("refinement runs gradients through the target: load it unpacked (pack=False)")
    if mapper.info.refined is not None:
        raise RarecacheError("this map is already refined: refine the closed-form map it came from")
    prompts = prompts or {}
    if bool(prompts) != (cfg.prompt_share > 0):
        raise RarecacheError("task prompts and a share of them (prompt_share > 0) go together")
    cfg = replace(cfg, prompt_sets=tuple(sorted((n, c.fingerprint) for n, c in prompts.items())))
    mapper.check_corpus(corpus)
    target.model.requires_grad_(False)
    source.model.requires_grad_(False)
    rng = random.Random(cfg.seed)
    torch.manual_seed(cfg.seed)
    n_train = round(cfg.steps * cfg.prompt_share)
    n_held = max(len(prompts), round(cfg.heldout * cfg.prompt_share / (1 - cfg.prompt_share))) if prompts else 0
    train, after = cuts(corpus, tokenizer, cfg, cfg.steps - n_train, cfg.first_document, rng)
    held_cuts, end = cuts(corpus, tokenizer, cfg, cfg.heldout, after, rng)
    read = {n: 0 for n in prompts}
    if prompts:
        task_train, read = prompt_cuts(prompts, tokenizer, cfg, n_train, read, rng)
        task_held, read = prompt_cuts(prompts, tokenizer, cfg, n_held, read, rng)
        train, held_cuts = interleave(train, task_train), held_cuts + task_held
    held = [Example(c, source, target, mapper, cfg.weighting, cfg.temperature)
            for c in tqdm(held_cuts, desc="held-out", unit="sequence", disable=not progress, leave=False)]
    delta = Delta(mapper, {s: [torch.cat(t) for t in zip(*(layer_inputs(mapper, e.x, e.own)[s] for e in held))]
                           for s in SIDES})
    opt = torch.optim.Adam(delta.parameters(), lr=cfg.lr)
    done, checks, best = 0, [], None
    if state is not None and state.exists():
        done, checks, best = resume(state, cfg, mapper, delta, opt)
        log(f"resumed {state} at step {done}")
    if not checks:
        before = heldout_kl(held, mapper, None, target)
        checks = [{"step": 0, "heldout_kl": before}]
        best = (before, 0, {k: v.clone() for k, v in delta.state_dict().items()})
    log(f"held-out KL before: {checks[0]['heldout_kl']:.4f} nats ({len(held)} sequences)")
    losses: list[float] = []
    bar = tqdm(train, desc="refine", unit="step", disable=not progress, initial=done, total=len(train),
               dynamic_ncols=True)
    for step, cut in enumerate(train[done:], done + 1):
        loss = Example(cut, source, target, mapper, cfg.weighting, cfg.temperature).loss(mapper, delta, target)
        if not math.isfinite(loss.item()):
            raise RarecacheError(f"refinement diverged at step {step} (loss {loss.item()}): lower --lr")
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        bar.update(1)
        bar.set_postfix(kl=f"{sum(losses[-20:]) / len(losses[-20:]):.4f}")
        if step % cfg.every == 0 or step == cfg.steps:
            now = heldout_kl(held, mapper, delta, target)
            if not math.isfinite(now):
                raise RarecacheError(f"refinement diverged at step {step} (held-out KL {now}): lower --lr")
            recent = losses[-cfg.every:]
            checks.append({"step": step, "heldout_kl": now, "train_kl": sum(recent) / len(recent)})
            if now < best[0]:
                best = (now, step, {k: v.clone() for k, v in delta.state_dict().items()})
            if state is not None:
                save_state(state, cfg, mapper, delta, opt, step, checks, best)
            log(f"step {step}: held-out KL {now:.4f} (train {checks[-1]['train_kl']:.4f})")
    bar.close()
    before = checks[0]["heldout_kl"]
    delta.load_state_dict(best[2])
    record = {"objective": "next-token KL at the suffix a handoff recomputes, over mapped rows",
              "weighting": cfg.weighting, "temperature": cfg.temperature,
              "steps": cfg.steps, "kept_step": best[1], "lr": cfg.lr, "rhos": list(cfg.rhos), "seq_len": cfg.seq_len,
              "min_len": cfg.min_len, "seed": cfg.seed, "documents": [cfg.first_document, after],
              "heldout_documents": [after, end], "prompt_share": cfg.prompt_share,
              "prompts": {n: {"corpus": prompts[n].name, "fingerprint": prompts[n].fingerprint,
                              "ids": list(prompts[n].ids[:read[n]])} for n in sorted(prompts)},
              "heldout_kl_before": before, "heldout_kl": best[0], "checks": checks}
    record["dtype"] = str(target.dtype).replace("torch.", "")  # what the models ran in (the map's products: float32)
    record["cpu"] = torch.backends.cpu.get_cpu_capability()  # and on which kernels
    # the closed-form fit's held-out R² is not this map's: left out, as a resharpened map's is (its KL is above)
    info = replace(mapper.info, refined=record, r2_heldout={})
    return Mapper(info, delta.fitted(mapper)), record
