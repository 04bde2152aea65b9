"""How much the map's bf16 products add to the map's own error (research/PERFORMANCE-LOG.md, issue 20).

`--map-dtype bfloat16` runs a float32 handoff's map in bf16. This measures what that costs in the rows it
writes, against the target's own rows on text the map was not fitted on: per side, the map's relative error
‖mapped − own‖ / ‖own‖ in float32 and in bf16, and the bf16 rounding alone ‖bf16 − float32‖ / ‖own‖.
  python research/scripts/map_dtype_error.py MAP PASSAGES TOKENS OUT.json
"""

import json
import sys

import torch

from rarecache.engine.runner import Runner
from rarecache.models.store import pull
from rarecache.models.tokenizer import Tokenizer
from rarecache.transfer.fitting.corpus import load_corpus
from rarecache.transfer.mapper import Mapper

path, passages, tokens, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
mapper = Mapper.load(path)
dirs = [pull(m) for m in ("qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct")]
source, target = (Runner.load(d, dtype=torch.float32) for d in dirs)
tok = Tokenizer.from_dir(dirs[0])
docs = [ids for ids in map(tok.encode, load_corpus("wiki").documents) if len(ids) >= tokens][:passages]
sums = {s: {"own": 0.0, "f32": 0.0, "bf16": 0.0, "rounding": 0.0} for s in ("k", "v")}
with torch.inference_mode():
    for ids in docs:
        prompt = [ids[:tokens]]
        src, _ = source.prefill(prompt)
        own, _ = target.prefill(prompt)
        pos = torch.arange(tokens)[None]
        f32, bf16 = target.new_cache(1, tokens), target.new_cache(1, tokens)
        mapper.apply(source, src, target, f32, pos)
        mapper.computing_in(torch.bfloat16).apply(source, src, target, bf16, pos)
        for s in ("k", "v"):
            o, a, b = (getattr(c, s)[:, :, :, :tokens] for c in (own, f32, bf16))
            sums[s]["own"] += float(o.square().sum())
            sums[s]["f32"] += float((a - o).square().sum())
            sums[s]["bf16"] += float((b - o).square().sum())
            sums[s]["rounding"] += float((b - a).square().sum())
result = {"map": path, "passages": len(docs), "tokens": tokens, "corpus": "wiki",
          **{s: {k: (v / d["own"]) ** 0.5 for k, v in d.items() if k != "own"} for s, d in sums.items()}}
json.dump(result, open(out, "w"), indent=1)
print(json.dumps(result))
