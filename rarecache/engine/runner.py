"""The forward pass over token sets at explicit positions, against a KV cache.

`Runner.forward` runs every layer; `Runner.embed`, `Runner.layer` and
`Runner.logits` are the same pass in pieces, so callers (the transfer package) can
drive the layers one at a time and overwrite cache rows in between without the
model knowing.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from ..models.config import ModelConfig
from ..models.llama import CausalLM
from ..models.loader import load_model
from ..models.packed import can_pack, pack_float32, pack_model, packs_by_default
from ..models.rope import Rope
from . import attention as kernels
from .attention import Plan, attend
from .cache import KVCache


@dataclass
class ForwardOutput:
    logits: torch.Tensor | None  # float32; (B, V) for "last", (B, T, V) for "all", (B, K, V) for indices
    attn: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> (B, H, R, S) probabilities


@dataclass(frozen=True)
class AttnCapture:
    """Record attention probabilities of `layers` for query rows `rows` (B, R), indices into T."""

    layers: frozenset[int]
    rows: torch.Tensor


@dataclass(frozen=True)
class Step:
    """What a pass's layers need to know about its positions (B, T), read on the host once per pass: the
    highest position (the cache's visible length) and whether the pass is a plain prefill (every row is
    positions 0..T-1, so the causal kernel applies). On a GPU, reading either from the device at every
    layer would wait for the device's queue each time."""

    top: int
    plain: bool
    host: torch.Tensor | None = field(default=None, compare=False, repr=False)  # the positions, on the host
    plan: Plan | None = field(default=None, compare=False, repr=False)  # the attention's, built once per pass

    @classmethod
    def of(cls, positions: torch.Tensor) -> "Step":
        host = positions.cpu()  # (one read per pass for positions on the device; none for those on the host)
        if not host.numel():
            return cls(-1, False, host)
        return cls(int(host.max()), bool((host == torch.arange(host.shape[1])).all()), host)


class Runner:
    def __init__(self, model: CausalLM, path: Path | None = None, pack: bool | None = None):
        """`pack`: prepack the decoder layers' linear weights and the LM head for oneDNN (in place; see
        models.packed). None packs where `packs_by_default` says (bfloat16 on a CPU whose oneDNN packs
        it); True also packs float32 on a CPU (`pack_float32`); False keeps plain `F.linear`."""
        self.model = model
        self.path = path  # checkpoint directory, when loaded from one
        self.attention = attend  # the kernel; benchmarks swap in the dense reference to measure the gain
        self.float32_head = False  # logits from a float32 LM head (`float32_logits`)
        self.config: ModelConfig = model.config
        p = model.model.embed_tokens.weight
        self.dtype, self.device = p.dtype, p.device
        self.kernel = kernels.choose(self.device)  # what `attend` runs for scattered queries here
        self.packed = False
        if pack or (pack is None and packs_by_default(self.dtype, self.device)):
            self.pack()
        self.rope = Rope(self.config.rope, self.config.head_dim, self.device)
        self._break_flags: torch.Tensor | None = None
        self._lines_from = None  # the tokenizer `learn_lines` was given: its table is built when first read

    @property
    def break_flags(self) -> torch.Tensor | None:
        """(V,) uint8 per token id: how its text sits in lines (models.tokenizer.line_flags), for the selectors
        that pick whole lines or paragraphs; built from `learn_lines`' tokenizer on first read (decoding the
        whole vocabulary: not a cost every load pays), None without one."""
        if self._break_flags is None and self._lines_from is not None:
            flags = self._lines_from.break_flags(self.config.vocab_size)
            self._break_flags = torch.tensor(flags, dtype=torch.uint8, device=self.device)
        return self._break_flags

    @break_flags.setter
    def break_flags(self, table: torch.Tensor | None) -> None:
        self._break_flags = table

    def learn_lines(self, tokenizer) -> "Runner":
        """Take where each token of `tokenizer` (models.tokenizer.Tokenizer) breaks lines, for the selectors that
        recompute whole lines or paragraphs (whoever loads the weights with their tokenizer calls this)."""
        self._lines_from, self._break_flags = tokenizer, None
        return self

    def pack(self) -> "Runner":
        """Prepack the linear weights in place (once). In float32 this swaps MKL's `F.linear` for oneDNN's
        kernel, which rounds differently (float32-close, not bitwise) and keeps small products fast: MKL
        re-reads and re-blocks each weight on every call, which a recompute of a few dozen rows per layer
        pays in full (measured in `bench ablate`); `Runner(..., pack=False)` stays the reference."""
        if not (can_pack(self.dtype, self.device) or pack_float32(self.dtype, self.device)):
            raise ValueError("prepacked weights need a CPU with oneDNN, in bfloat16 (AVX-512) or float32")
        if not self.packed:
            self.packed = pack_model(self.model) > 0
        return self

    @classmethod
    def load(cls, path: str | Path, dtype: torch.dtype = torch.float32, device="cpu",
             pack: bool | None = None) -> "Runner":
        return cls(load_model(path, dtype=dtype, device=device), Path(path), pack)

    @property
    def num_layers(self) -> int:
        return self.config.num_layers

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        return KVCache.for_model(self.config, batch, max_len, self.dtype, self.device)

    # -- the pass in pieces ------------------------------------------------------------

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model.embed(tokens.to(self.device))

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rope.cos_sin(positions, self.dtype)

    def qkv(self, i: int, h: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]):
        """Layer i's rotated q (B, H, T, D), k and v (B, Hkv, T, D) for residual h (B, T, C)."""
        return self.model.layers[i].qkv(h, *cos_sin)

    def attend(self, i: int, q: torch.Tensor, positions: torch.Tensor, cache: KVCache, capture_rows=None,
               step: Step | None = None):
        """q of layer i at positions (B, T) over the cache's filled slots -> (B, H, T, D), probs. `step`:
        what the pass already read on the host about the positions (None: read here; a pass gives it after
        marking the positions filled, which is what makes its `plain` hold for the keys too)."""
        length = (step or Step.of(positions)).top + 1  # no query sees a slot past its own position
        k, v = cache.layer(i, length)
        return self.attention(q, positions, k, v, cache.filled[:, :length], capture_rows,
                              plain=step.plain if step is not None else None,
                              plan=step.plan if step is not None else None)

    def planned(self, step: Step, positions: torch.Tensor, cache: KVCache) -> Step:
        """`step` with its attention plan, for positions (B, T) on the device once `cache` has them marked
        filled: built once, read by every layer of the pass."""
        plan = kernels.prepare(self.kernel, positions, cache.filled[:, : step.top + 1], step.host, step.plain)
        return replace(step, plan=plan)

    def finish(self, i: int, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        return self.model.layers[i].finish(h, attn)

    def layer(
        self,
        i: int,
        h: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None,
        capture_rows: torch.Tensor | None = None,
        step: Step | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One decoder layer: write this layer's k, v at `positions`, attend, MLP."""
        q, k, v = self.qkv(i, h, cos_sin or self.cos_sin(positions))
        cache.write(i, positions, k, v, step.top if step is not None else None)
        out, probs = self.attend(i, q, positions, cache, capture_rows, step)
        return self.finish(i, h, out), probs

    @contextlib.contextmanager
    def float32_logits(self):
        """Inside, every pass's logits come from a float32 LM head (`CausalLM.logits`): what scoring choices
        by their log-likelihoods reads in a bfloat16 model, whose own head ties choices that differ. Decoding
        and serving keep the model's own head."""
        was, self.float32_head = self.float32_head, True
        try:
            yield self
        finally:
            self.float32_head = was

    def logits(self, h: torch.Tensor, positions: torch.Tensor, at: str | torch.Tensor = "last"):
        """Logits of h (B, T, C): at the highest position per row ("last"), everywhere ("all"),
        or at row indices (B, K); None for at=None."""
        if at is None:
            return None
        if isinstance(at, str):
            if at == "all":
                return self.model.logits(h, self.float32_head)
            if at != "last":
                raise ValueError(f"logits_at must be 'last', 'all', None or an index tensor, not {at!r}")
            at = positions.argmax(dim=1, keepdim=True)  # (B, 1)
            return self.logits(h, positions, at)[:, 0]
        sel = h.gather(1, at[..., None].expand(-1, -1, h.shape[-1]))  # (B, K, C)
        return self.model.logits(sel, self.float32_head)

    # -- the whole pass -----------------------------------------------------------------

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        logits_at: str | torch.Tensor | None = "last",
        capture: AttnCapture | None = None,
    ) -> ForwardOutput:
        """Run tokens (B, T) at positions (B, T) (-1 = padding) through every layer.

        Each layer's k, v are written into `cache` at their positions; queries attend
        to every filled slot at a position <= their own.
        """
        step = Step.of(positions)  # on the host, once: what every layer asks of the positions
        positions = positions.to(self.device)
        cache.mark(positions, step.top)
        step = self.planned(step, positions, cache)
        h = self.embed(tokens)
        cos_sin = self.cos_sin(positions)
        attn: dict[int, torch.Tensor] = {}
        for i in range(self.num_layers):
            rows = capture.rows if capture is not None and i in capture.layers else None
            h, probs = self.layer(i, h, positions, cache, cos_sin, rows, step)
            if probs is not None:
                attn[i] = probs
        return ForwardOutput(self.logits(h, positions, logits_at), attn)

    @torch.inference_mode()
    def decode_step(self, tokens: torch.Tensor, positions: torch.Tensor, caches: list[KVCache]) -> torch.Tensor:
        """One token (B,) at positions (B,) for each of B sequences held in B separate one-row caches
        -> last logits (B, V).

        The linear layers and the MLP run as one batch (their weights are read once per step, which
        is what decoding costs), attention runs per cache. Equals `forward` on each row alone.
        """
        if tokens.shape[0] != len(caches) or positions.shape[0] != len(caches):
            raise ValueError("decode_step needs one token, one position and one cache per sequence")
        steps = [Step(p, p == 0) for p in positions.tolist()]  # (one read of the positions for the whole step)
        pos = positions.to(self.device)[:, None]  # (B, 1)
        for b, c in enumerate(caches):
            c.mark(pos[b : b + 1], steps[b].top)
        h = self.embed(tokens[:, None])  # (B, 1, C)
        cos_sin = self.cos_sin(pos)
        for i in range(self.num_layers):
            q, k, v = self.qkv(i, h, cos_sin)  # q (B, H, 1, D), k, v (B, Hkv, 1, D)
            outs = []
            for b, c in enumerate(caches):
                c.write(i, pos[b : b + 1], k[b : b + 1], v[b : b + 1], steps[b].top)
                outs.append(self.attend(i, q[b : b + 1], pos[b : b + 1], c, step=steps[b])[0])
            h = self.finish(i, h, torch.cat(outs))
        return self.logits(h, pos)

    @torch.inference_mode()
    def read(self, tokens: list[int], start: int, cache: KVCache, before: torch.Tensor,
             logprobs: bool = True) -> torch.Tensor | None:
        """Read given tokens (a scored answer) after the `start` positions row 0 of `cache` holds:
        the rows of all but the last token are written at start, start + 1, ... (the next turn keeps
        them). `before` (V,): the logits at position start - 1. Returns (len(tokens), V): each token's
        log-softmax over the vocabulary, float32, from the logits before it; None when `logprobs` is False."""
        first = torch.log_softmax(before.float(), -1) if logprobs else None
        out = None
        if len(tokens) > 1:
            out = self.forward(torch.tensor([tokens[:-1]]), torch.arange(start, start + len(tokens) - 1)[None], cache,
                               logits_at="all" if logprobs else None)
        if not logprobs:
            return None
        if out is None:
            return first[None]
        return torch.cat([first[None], torch.log_softmax(out.logits[0].float(), -1)])  # (len, V)

    def prefill(self, prompts: list[list[int]], max_len: int | None = None) -> tuple[KVCache, ForwardOutput]:
        """Prefill prompts of different lengths into a new batch cache; last-position logits (B, V).

        On a CPU, where compute is the bottleneck, each prompt runs on its own (padding would be
        wasted work); elsewhere the batch runs right-padded in one pass.
        """
        cache = self.new_cache(len(prompts), max_len or max(len(p) for p in prompts))
        if self.device.type == "cpu" and len({len(p) for p in prompts}) > 1:
            outs = [self.forward(*pad_batch([p], self.device), cache.row(b)).logits for b, p in enumerate(prompts)]
            return cache, ForwardOutput(torch.cat(outs))
        return cache, self.forward(*pad_batch(prompts, self.device), cache)



def spans(prompts: list[list[int]], starts: list[int], device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and positions (B, W) of each prompt's [start, end), padding at position -1."""
    if not prompts or any(len(p) <= s for p, s in zip(prompts, starts)):
        raise ValueError("every span needs at least one token")
    width = max(len(p) - s for p, s in zip(prompts, starts))
    tokens = torch.zeros(len(prompts), width, dtype=torch.long)
    positions = torch.full((len(prompts), width), -1, dtype=torch.long)
    for b, (p, s) in enumerate(zip(prompts, starts)):
        tokens[b, : len(p) - s] = torch.tensor(p[s:])
        positions[b, : len(p) - s] = torch.arange(s, len(p))
    return tokens.to(device), positions.to(device)


def pad_batch(prompts: list[list[int]], device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Whole prompts -> tokens (B, T) and positions (B, T), padding at position -1."""
    return spans(prompts, [0] * len(prompts), device)
