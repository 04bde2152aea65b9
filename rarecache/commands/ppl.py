"""`rarecache ppl`: prefix-conditioned perplexity, an evaluation of what a map keeps (eval/perplexity.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from .common import add_model_options, add_pair_options, load_pair, ran_in, write_out


def register(sub) -> None:
    _add_ppl(sub)


def _add_ppl(sub) -> None:
    p = sub.add_parser("ppl", help="prefix-conditioned perplexity: own prefix vs mapped prefix vs source alone",
                       description="Score each held-out passage's continuation with the target conditioned on its "
                                   "own prefix cache, on the mapped source cache, and with the source alone. "
                                   "Passages come from documents the map was not fitted on.")
    add_pair_options(p)
    p.add_argument("--corpus", default="wiki", help="corpus to cut passages from (default: wiki)")
    p.add_argument("--passages", type=int, default=20, help="number of passages (default: 20)")
    p.add_argument("--prefix", type=int, default=512, help="prefix tokens (default: 512)")
    p.add_argument("--continuation", type=int, default=512, help="scored continuation tokens (default: 512)")
    p.add_argument("--first-document", type=int, default=None,
                   help="start at this document (default: the first one the map did not see)")
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    add_model_options(p)
    p.set_defaults(func=cmd_ppl)


def cmd_ppl(args) -> int:
    from ..eval.perplexity import ARMS, heldout_passages, prefix_perplexity
    from ..transfer.fitting.corpus import load_corpus

    source, target, mapper, tokenizer = load_pair(args)
    corpus = load_corpus(args.corpus, cache_dir=args.cache_dir)
    passages, first = heldout_passages(corpus, tokenizer, mapper, args.passages, args.prefix + args.continuation,
                                       args.first_document)
    res = prefix_perplexity(source, target, mapper, passages, args.prefix, first)
    labels = {"target": "target, own prefix prefill", "mapped": "target, mapped prefix cache",
              "source": "source alone"}
    print(f"prefix-conditioned perplexity: {res.passages} passages of {corpus.name} from document {first} on, "
          f"prefix {res.prefix} + continuation {res.continuation} tokens, {args.dtype}")
    for arm in ARMS:
        print(f"  {labels[arm]:30s} ppl {res.ppl(arm):8.3f}")
    if args.out:
        write_out(args.out, json.dumps({"map": str(args.map), "corpus": corpus.describe(), "first_document": first,
                                        "prefix": res.prefix, "continuation": res.continuation,
                                        **ran_in(args), "map_dtype": args.map_dtype or args.dtype,
                                        "ppl": {a: res.ppl(a) for a in ARMS},
                                        "nll_per_passage": res.nll}, indent=1))
        print(f"wrote {args.out}", file=sys.stderr)
    return 0
