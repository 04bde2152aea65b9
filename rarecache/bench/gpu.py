"""`rarecache bench gpu`: the handoff against the stronger of two prefills, at the papers' shapes.

The baseline is whichever is faster, per cell, of our Runner's prefill and transformers' SDPA prefill of the
same shapes: both run the same random weights (transformers' model is built around our model's tensors,
`hf_twin`), on the same device, in the same run as the handoff (one warm-up, then the median of repeats).
The source prefill is not counted (in a cascade the source has already paid it). `of_sparse_ceiling` divides
the speed-up by the sparse-causal FLOP ceiling (`bench.handoffbench.ceilings`); `map_score_share_of_prefill` is
map + score over the stronger prefill.

A cell of T x batch tokens past `max_tokens` is skipped and listed as skipped (8192 x 16 does not fit the
8-minute budget of scripts/gpu.sh on one card). `compile_layers` is the --compile option: the target's
decoder layers through torch.compile (a failure is recorded and the layer runs eagerly).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch

from ..engine import attention
from ..engine.runner import Runner
from ..registry import RANK, SUFFIX
from ..transfer.handoff import HandoffConfig, handoff
from ..transfer.mapper import SIDES, Mapper
from .ablate import median_time
from .handoffbench import ceilings, synchronize
from .shapes import CONFIGS, random_mapper, random_model, textless

ROW_KEYS = ("T", "batch", "rho", "selector", "speedup_vs_best_prefill", "of_sparse_ceiling",
            "map_score_share_of_prefill")


@dataclass(frozen=True)
class Grid:
    shapes: tuple[str, str]
    lengths: tuple[int, ...]
    batches: tuple[int, ...]
    rhos: tuple[float, ...]
    selectors: tuple[str, ...]
    max_tokens: int  # cells with T x batch above this are skipped (listed in the summary)


# most important first (the acceptance cells are at T 2048): a run cut short keeps what it finished
FULL = Grid(("qwen3-0.6b", "qwen3-14b"), (2048, 512, 8192, 149), (1, 16, 4), (0.2, 0.3, 0.5), (RANK, SUFFIX),
            32768)
SMOKE = Grid(("toy-source", "toy-target"), (96,), (1, 2), (0.2, 0.5), (RANK, SUFFIX), 32768)


def hf_twin(model: torch.nn.Module, name: str):
    """transformers' model (SDPA attention) of shape `name` whose parameters are `model`'s own tensors."""
    import transformers

    cfg = dict(CONFIGS[name])
    family = cfg.pop("model_type")
    cfg["num_hidden_layers"] = model.config.num_layers
    config_cls, model_cls = {"qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
                             "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM)}[family]
    config = config_cls(**cfg, attn_implementation="sdpa")
    with torch.device("meta"):
        hf = model_cls(config)
    ours = model.state_dict()
    missing, unexpected = hf.load_state_dict(ours, strict=False, assign=True)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise RuntimeError(f"weights do not line up: missing {missing}, unexpected {unexpected}")
    if tied:
        hf.lm_head.weight = hf.model.embed_tokens.weight
    device = model.model.embed_tokens.weight.device
    with torch.device(device):  # its inverse frequencies were left empty on meta
        hf.model.rotary_emb = type(hf.model.rotary_emb)(config)
    return hf.eval().requires_grad_(False)


def compile_layers(runner: Runner, failures: list[str]) -> None:
    """Each decoder layer's qkv and finish through torch.compile (dynamic shapes); a failure is appended to
    `failures` and that function runs eagerly from then on."""
    for i, layer in enumerate(runner.model.layers):
        for name in ("qkv", "finish"):
            setattr(layer, name, _guarded(getattr(layer, name), f"layer {i} {name}", failures))


def _guarded(fn, what: str, failures: list[str]):
    compiled, state = torch.compile(fn, dynamic=True), {"ok": True}

    def call(*args):
        if state["ok"]:
            try:
                return compiled(*args)
            except Exception as e:  # noqa: BLE001 -- any compile failure: eager, recorded
                state["ok"] = False
                failures.append(f"torch.compile {what}: {type(e).__name__}: {' '.join(str(e).split())}"[:300])
        return fn(*args)

    return call


@torch.inference_mode()
def time_cells(source: Runner, target: Runner, hf, mapper: Mapper, T: int, batch: int, grid: Grid,
               repeats: int) -> list[dict]:
    """Every (selector, rho) of one (T, batch): both prefills, then each handoff, in this process."""
    g = torch.Generator().manual_seed(T * 1000 + batch)
    vocab = min(source.config.vocab_size, target.config.vocab_size)
    prompts = torch.randint(0, vocab, (batch, T), generator=g).tolist()
    src_cache, _ = source.prefill(prompts)
    tokens = torch.tensor(prompts, device=target.device)
    pos = torch.arange(T, device=target.device).expand(batch, T)
    for side in SIDES:  # the map's tensors in the handoff's dtype, cast once before anything is measured
        mapper.tensors(side, mapper.dtype_for(target), target.device)
    ours = median_time(lambda: target.forward(tokens, pos, target.new_cache(batch, T)), repeats, target.device)
    theirs = median_time(lambda: hf(input_ids=tokens, use_cache=True, logits_to_keep=1), repeats, target.device)
    best = min(ours, theirs)
    rows = []
    for selector in grid.selectors:
        for rho in grid.rhos:
            cfg = HandoffConfig(rho=rho, selector=selector)
            phases: dict[str, list[float]] = {"map": [], "score": [], "recompute": []}
            for i in range(repeats + 1):
                _, _, res = handoff(source, target, mapper, prompts, cfg, source_cache=src_cache,
                                    source_kept=[T] * batch)
                synchronize(target.device)
                for k in phases if i else ():
                    phases[k].append(res.timings[k])
            med = {k: statistics.median(v) for k, v in phases.items()}
            total = med["map"] + med["score"] + med["recompute"]
            sparse = ceilings(target, mapper, T, rho)[1]
            rows.append({"T": T, "batch": batch, "rho": rho, "selector": selector,
                         "speedup_vs_best_prefill": best / total, "of_sparse_ceiling": best / total / sparse,
                         "map_score_share_of_prefill": (med["map"] + med["score"]) / best,
                         "speedup_vs_ours": ours / total, "ceiling_sparse": sparse,
                         "ours_prefill_ms": ours * 1e3, "transformers_prefill_ms": theirs * 1e3,
                         "baseline": "ours" if ours <= theirs else "transformers",
                         **{f"{k}_ms": v * 1e3 for k, v in med.items()}, "handoff_ms": total * 1e3})
    return rows


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads)"


def card_slug(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'h100-80gb-hbm3', for docs/artifacts/gpu-<card>."""
    words = [w for w in name.lower().replace("nvidia", " ").split() if w]
    return "-".join("".join(c for c in w if c.isalnum()) for w in words) or "unknown"


def run(grid: Grid, device: str, dtype: torch.dtype, repeats: int, compile: bool = False,
        max_layers: int | None = None, rank: int = 128, progress=print, write=None) -> dict:
    """The whole grid -> the summary (`rows` of ROW_KEYS) and `detail` (every timing of every row);
    `write` is given the summary so far after every (T, batch)."""
    torch.manual_seed(0)
    source = textless(Runner(random_model(grid.shapes[0], dtype, device, max_layers)))
    model = random_model(grid.shapes[1], dtype, device, max_layers)
    hf = hf_twin(model, grid.shapes[1])  # before Runner packs our weights (CPU, bf16)
    target = textless(Runner(model))
    mapper = random_mapper(source, target, rank=rank)
    failures: list[str] = []
    if compile:
        compile_layers(target, failures)
    import transformers

    detail, skipped = [], []
    head = {"bench": "gpu", "device": device_name(target.device), "pair": ":".join(grid.shapes),
            "layers": [source.num_layers, target.num_layers], "dtype": str(dtype).removeprefix("torch."),
            "torch": torch.__version__, "transformers": transformers.__version__, "compile": compile,
            "attention": target.kernel, "repeats": repeats}

    def summary() -> dict:
        return {**head, "failures": [*attention.FAILURES, *failures], "skipped": skipped,
                "rows": [{k: r[k] for k in ROW_KEYS} for r in detail], "detail": detail}

    for T in grid.lengths:
        for batch in grid.batches:
            if T * batch > grid.max_tokens:
                skipped.append({"T": T, "batch": batch, "why": f"T x batch > {grid.max_tokens} tokens"})
                continue
            for r in time_cells(source, target, hf, mapper, T, batch, grid, repeats):
                detail.append(r)
                progress(f"T {T:>5} B {batch:>2} rho {r['rho']:.1f} {r['selector']:<6} "
                         f"{r['speedup_vs_best_prefill']:5.2f}x vs best prefill ({r['baseline']}), "
                         f"{r['of_sparse_ceiling']:5.1%} of ceiling, map+score {r['map_score_share_of_prefill']:5.1%}")
            if write is not None:
                write(summary())
    return summary()
