"""What a general map was fitted on: documents and positions per component of the mix.

The map records the ids of the documents its calibration read (fit, then held-out) and the sequence
length it cut them to; each id belongs to one component (`eval/mix.py: COMPONENTS`). Positions are
counted as the calibration counts them: the chat-rendered document, truncated to the sequence length;
the last document read counts whole, so the total can pass the map's fit + held-out positions.
    python research/scripts/mix_shares.py MAP [OUT.json]
"""

from __future__ import annotations

import json
import sys

from rarecache.eval import mix
from rarecache.models.tokenizer import Tokenizer
from rarecache.models.store import resolve_model
from rarecache.transfer.mapper import Mapper


def main(path: str, out: str | None = None) -> None:
    info = Mapper.load(path).info
    ids, seq_len = info.calibration["document_ids"], info.calibration["seq_len"]
    tokenizer = Tokenizer.from_dir(resolve_model(info.source["name"], pull_missing=False))
    comps = mix.components(mix.preset_of(info.corpus["name"]))  # the mix the map was calibrated with
    docs = {}
    for c in comps:
        docs.update({i: (c.name, d) for i, d in c.build(None)})
    counts = {c.name: [0, 0] for c in comps}
    for i in ids:
        name, doc = docs[i]
        messages = [{"role": "user", "content": doc}] if isinstance(doc, str) else list(doc)
        counts[name][0] += 1
        counts[name][1] += min(len(tokenizer.encode_chat(messages)), seq_len)
    docs_total, pos_total = len(ids), sum(p for _, p in counts.values())
    table = {name: {"documents": d, "document_share": d / docs_total, "positions": p, "position_share": p / pos_total}
             for name, (d, p) in counts.items()}
    print(f"{path}: {docs_total} documents, {pos_total} positions (seq_len {seq_len}; fit {info.tokens} + held-out "
          f"{info.calibration.get('heldout_tokens')})")
    for name, row in table.items():
        print(f"  {name:12s} {row['documents']:4d} documents ({row['document_share']:5.1%})  "
              f"{row['positions']:6d} positions ({row['position_share']:5.1%})")
    if out:
        json.dump({"map": info.corpus, "seq_len": seq_len, "components": table}, open(out, "w"), indent=1)


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        sys.exit(__doc__)
    main(*sys.argv[1:])
