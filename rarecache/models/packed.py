"""Linear layers with their weights prepacked into oneDNN's blocked layout (CPU, bfloat16).

`F.linear` on a CPU reorders the weight into the kernel's blocked layout on every
call. That is a fixed cost per matrix product, paid again for every layer of every
forward pass, so it weighs most where the product is small: one decoded token, or
the few hundred rows a selective recompute runs through each layer. Packing once at
load time removes it (bf16, measured on the bundled 1.5B's shapes: decode products
1.4-2.7x faster, 154-row products 5-10%, 512-row ones 3-5%). In bfloat16 the packed
product runs the same oneDNN kernel and gives bit-identical results; in float32
`F.linear` takes a different library (MKL) whose rounding differs, so float32 is
left unpacked and stays the reference path. `pack_model` swaps the decoder layers'
linear modules in place and packs the LM head (a copy beside the plain weight, which the
embedding or a float32 head reads: one decoded token's head product drops from 27 to 13 ms
on the 1.5B); an unpacked copy of the model is the reference it is tested against.
"""

from __future__ import annotations

from functools import cache

import torch
from torch import nn


def packs_by_default(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether a `Runner` prepacks its weights when not told (`pack=None`): the one place that is decided,
    by dtype, device and what this CPU's oneDNN does. bfloat16: wherever oneDNN packs bf16 (`can_pack`;
    exact and faster: 1.2x on one decoder layer's products for a decoded token, 1.07-1.26x at 154-2048
    rows, AVX-512 + AMX). float32: never by default; oneDNN's float32 products against MKL's `F.linear`
    over one decoder layer (research/scripts/time_packed_products.py, AVX-512, one thread) are 1.1-1.2x
    at 52-154 rows, 0.94-1.02x at 614, 0.88-0.94x at a 2048-row prefill and 0.53-0.63x for a decoded
    token, and float32-close, not bitwise (`pack_float32`: opt-in, `Runner.pack`, `bench --pack`). Not
    measured on an AVX2-only CPU, where bfloat16 does not pack (oneDNN refuses) and float32 is what runs."""
    return can_pack(dtype, device)


def can_pack(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether prepacking applies: bfloat16 on a CPU whose oneDNN build can pack bf16 weights."""
    return torch.device(device).type == "cpu" and dtype == torch.bfloat16 and _cpu_packs_bf16()


@cache
def _cpu_packs_bf16() -> bool:
    # The ops exist in every CPU build, but oneDNN refuses bf16 packing at call time on CPUs without
    # AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT, so probe by packing a tiny weight.
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        w = torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=torch.bfloat16))
        torch.ops.mkldnn._linear_pointwise(torch.zeros(1, 8, dtype=torch.bfloat16), w, None, "none", [], "")
    except (AttributeError, RuntimeError):
        return False
    return True


def pack_float32(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether float32 weights can be prepacked here (a CPU build with oneDNN): opt-in (`packs_by_default`)."""
    return (dtype == torch.float32 and torch.device(device).type == "cpu" and torch.backends.mkldnn.is_available()
            and _onednn_float32())


@cache
def _onednn_float32() -> bool:
    try:
        w = torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8))
        torch.ops.mkldnn._linear_pointwise(torch.zeros(1, 8), w, None, "none", [], "")
    except (AttributeError, RuntimeError):
        return False
    return True


class PackedLinear(nn.Module):
    """`nn.Linear` with a prepacked (opaque oneDNN) weight; same inputs, same outputs."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", torch.ops.mkldnn._reorder_linear_weight(weight.detach()), persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed"


def pack_linears(module: nn.Module) -> int:
    """Replace every `nn.Linear` under `module` by a `PackedLinear`, in place; returns how many."""
    n = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, PackedLinear(child.weight, child.bias))
            n += 1
        else:
            n += pack_linears(child)
    return n


def pack_model(model) -> int:
    """Pack a `CausalLM`'s decoder-layer linears and its LM head; returns how many products were packed."""
    n = pack_linears(model.model.layers)
    head = model.model.embed_tokens.weight if model.config.tie_word_embeddings else model.lm_head.weight
    model.packed_head = PackedLinear(head)  # (an untied model keeps its plain head too: float32 logits read it)
    return n + 1
