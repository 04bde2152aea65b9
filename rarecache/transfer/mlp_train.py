"""Training a map's nonlinear option: ridge + a residual MLP per target layer and side.

`rarecache mlp` runs this on the map's own calibration text: rows of its fit documents train,
the documents after them stop early and give the held-out R². It lives apart from the command
so the command stays flags and printing, and apart from `mlp.py`, which holds the network.
"""

from __future__ import annotations

from ..engine.runner import Runner
from ..errors import RarecacheError
from .corpus import Corpus
from .fit import Layout
from .mapper import SIDES, Mapper
from .calibrate import collect_rows
from .mlp import MLPConfig, train_side


def fit_mlp(mapper: Mapper, source: Runner, target: Runner, tokenizer, corpus: Corpus, cfg: MLPConfig,
            tokens: int, heldout_tokens: int, seq_len: int, name: str = "the map") -> tuple[Mapper, dict]:
    """The map with an MLP trained per target layer and side on ridge's residual, and the held-out R²
    ({side: {"ridge": [...], "mlp": [...]}}). `corpus` must be the map's own calibration text; `name` says
    which map in the error if it is not."""
    if mapper.info.token_inputs:  # (before collecting rows: Mapper.with_mlp refuses it)
        raise RarecacheError(f"{name} reads token inputs, which a residual MLP would not: no MLP for it")
    mapper.check_corpus(corpus, name)
    train = collect_rows(source, target, tokenizer, corpus, tokens, seq_len)
    held = collect_rows(source, target, tokenizer, corpus, heldout_tokens, seq_len,
                        first_document=mapper.info.calibration.get("documents_used", 0))
    src = Layout(source.num_layers, source.config.kv_dim)
    tgt = Layout(target.num_layers, target.config.kv_dim)
    mlps, r2 = {}, {}
    for s in SIDES:
        mlps[s], r2[s] = train_side(mapper.sides[s], *train[s], *held[s], src, tgt, cfg)
    return mapper.with_mlp(mlps, cfg.hidden), r2
