"""GSM8K-shaped calibration prompts with other exemplars: the fair ceiling for a map that may not read them.

A GSM8K task map (`calibrate --task gsm8k`) fits on held-apart prompts that carry the same eight exemplars as
every evaluated prompt, 763 of its ~830 tokens: it has seen the exact rows it will map. A general map may not
(its data is disjoint from every evaluated item). These prompts keep GSM8K's format (an instruction in other words,
eight "Question: … Answer: … So the answer is N." exemplars, then one question) but draw all nine problems from the
held-apart pool (test items 1000–1318, which no task evaluates), so a map fitted on them knows the task's
distribution and layout and none of its evaluated text. Disjointness from every evaluated item of every task is
checked line by line, as the general mix is (`eval.disjoint.check_disjoint_from_tasks`).

    python research/scripts/ceiling_corpus.py OUT.jsonl     # then: calibrate --corpus OUT.jsonl:text --chat --seq-len 1024

(The prompts are `eval.mix.word_chain_prompts`', as the general-v3 mix's `word` component builds them, with other
exemplar draws and without the replies. They run to ~1,450 tokens, so a 1,024-token calibration sequence holds the
instruction and about six exemplars.)
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from rarecache.eval.disjoint import check_disjoint_from_tasks
from rarecache.eval.mix import word_chain_prompts, word_problems
from rarecache.eval.tasks import TASKS
from rarecache.models.store import resolve_model
from rarecache.models.tokenizer import Tokenizer
from rarecache.transfer.fitting.corpus import Corpus


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="JSONL to write, one {\"text\": user turn} per line")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--source", default="qwen2.5-coder-0.5b-instruct", help="the tokenizer tasks cut text with")
    args = ap.parse_args()
    tok = Tokenizer.from_dir(resolve_model(args.source))
    texts = word_chain_prompts(word_problems(), random.Random(args.seed))
    checked = check_disjoint_from_tasks(Corpus("gsm8k-reshot", tuple(texts), chat=True),
                                        {n: T(tokenizer=tok) for n, T in TASKS.items()})
    with open(args.out, "w") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")
    print(f"wrote {len(texts)} prompts to {args.out}; disjoint from the evaluated items of "
          + ", ".join(f"{n} ({k})" for n, k in checked.items()))


if __name__ == "__main__":
    main()
