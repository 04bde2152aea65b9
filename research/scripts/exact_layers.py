"""Experiment behind research/LOG.md §8 ("the first layers made exact"): the target computes its own K/V of
the first m layers at every prefix position on top of the mapped cache, then plain transfer is scored by
prefix-conditioned perplexity (the `rarecache ppl` protocol and passages: wiki, 256 + 256 tokens, float32).
Layer 0 is a function of the tokens alone (its K/V cost ~0.2% of a prefill); layer j < m needs a full pass
of layers < j over every position (1/L of a prefill each).

    python research/scripts/exact_layers.py MAP PASSAGES M,M,... OUT.json
    python research/scripts/exact_layers.py $RARECACHE_HOME/maps/general-v1-64k-0.5b-to-1.5b.safetensors \
        12 0,1,2,3 docs/artifacts/exact-layers-ppl.json

The record went through the general map v1 (sha256 c374c4bf...), no longer in the tree: put it there first with
`git show 3415776:docs/artifacts/general-v1/general-64k-0.5b-to-1.5b.safetensors > FILE` (its exact bytes), or make
it again (docs/RESULTS.md, "Maps that are no longer in the tree").
"""
import json
import math
import sys

import torch
import torch.nn.functional as F

from rarecache.engine.runner import Runner
from rarecache.transfer.mapper import Mapper
from rarecache.transfer.fitting.corpus import load_corpus
from rarecache.eval.perplexity import heldout_passages
from rarecache.models.tokenizer import Tokenizer
from rarecache.models.store import resolve_model

torch.set_grad_enabled(False)
S, T = (resolve_model(m) for m in ("qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct"))
source, target = Runner.load(S), Runner.load(T)
mapper = Mapper.load(sys.argv[1])
tok = Tokenizer.from_dir(S)
passages, first = heldout_passages(load_corpus("wiki"), tok, mapper, int(sys.argv[2]), 512)
MS = [int(x) for x in sys.argv[3].split(",")]
prefix = 256

def exact_layers(cache, toks, pos, m):
    if m == 0:
        return
    h = target.embed(toks)
    cs = target.cos_sin(pos)
    for i in range(m - 1):
        h, _ = target.layer(i, h, pos, cache, cs)
    _, k, v = target.qkv(m - 1, h, cs)
    cache.write(m - 1, pos, k, v)

res = {m: [] for m in MS}
for n_, ids in enumerate(passages):
    tokens = torch.tensor([ids]); n = len(ids)
    src = source.new_cache(1, prefix)
    source.forward(tokens[:, :prefix], torch.arange(prefix)[None], src, logits_at=None)
    for m in MS:
        cache = target.new_cache(1, n)
        p = torch.arange(prefix)[None]
        mapper.plain().apply(source, src, target, cache, p)  # all rows mapped: plain transfer's view
        exact_layers(cache, tokens[:, :prefix], p, m)
        pos = torch.arange(prefix - 1, n - 1)[None]
        lg = target.forward(tokens[:, prefix - 1:n - 1], pos, cache, logits_at="all").logits[0]
        res[m].append(F.cross_entropy(lg.float(), torch.tensor(ids[prefix:])).item())
    print(n_, {m: round(math.exp(sum(v) / len(v)), 3) for m, v in res.items()}, flush=True)
json.dump({str(m): v for m, v in res.items()}, open(sys.argv[4], "w"))
