"""Every name a user types for a position selector, an evaluation task or a calibration preset, and where
the object it names lives.

One table per kind, one line per name: `"name": "module:attr"`, the way vLLM's `KVConnectorFactory`
registers a connector by its module path. `--help`, the command line's checks (argparse's choices) and
the lookup (`Names.load`) all read these tables, and reading them imports nothing: `--help` must not
import torch (tests/test_cli.py). Each name is written once in the package, here
(tests/test_registry.py greps the package for every name); code that means one name in particular
(the served selector, the plain-transfer arm, the task a probe draws from) uses the constant below
that names it. A new selector, task or preset is one line in its table (a constant too, if code refers
to it by name). A selector or task class reads its own name here (`Names.names_of`, in
`Selector.__init_subclass__` and `Task.__init_subclass__`) rather than spelling it, and `eval.tasks.TASKS`
is built from `TASKS` below, so a task is registered by its line here alone.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from typing import Any

from .errors import RarecacheError

# the names code refers to by name (each table below uses the constant, so the name is still written once)
RANK, RANDOM, SUFFIX, SUFFIX_RANK, ATTN_SOURCE = "rank", "random", "suffix", "suffix+rank", "attn-source"
LAYER_PREFIX = "layer-prefix"  # a schedule (the target's first layers for every position), named where selectors are
# the query-aware variants (transfer/query.py): one QuerySelector each, its settings in selectors.QUERY_VARIANTS
QUERY, QUERY_LAYER, QUERY_HEAD, QUERY_ALL = "query", "query-layer", "query-head", "query-all"
QUERY_VALUE, QUERY_COMMON, QUERY_RAW, QUERY_SPAN = "query-value", "query-common", "query-raw", "query-span"
QUERY_LAYER_SPAN, QUERY_RANK, QUERY_W8, QUERY_W64 = "query-layer-span", "query-rank", "query-w8", "query-w64"
ATTN_SOURCE_SPAN, ATTN_SOURCE_LINE, ATTN_SOURCE_BLOCK = "attn-source-span", "attn-source-line", "attn-source-block"
ATTN_SOURCE_MIX, QUERY_REFINE, ATTN_SOURCE_SPAN_RAW = "attn-source-mix", "query-refine", "attn-source-span-raw"
QUERY_BLEND = "query-blend"
QUERY_VARIANTS = (QUERY, QUERY_LAYER, QUERY_HEAD, QUERY_ALL, QUERY_VALUE, QUERY_COMMON, QUERY_RAW, QUERY_SPAN,
                  QUERY_LAYER_SPAN, QUERY_RANK, QUERY_W8, QUERY_W64, ATTN_SOURCE_SPAN, ATTN_SOURCE_LINE,
                  ATTN_SOURCE_BLOCK, ATTN_SOURCE_MIX, QUERY_REFINE, ATTN_SOURCE_SPAN_RAW, QUERY_BLEND)
GSM8K_BPB, ARC_CHALLENGE, MMLU = "gsm8k_bpb", "arc_challenge", "mmlu"
COQA_BPB, COQA_PASSAGE = "coqa_bpb", "coqa_passage"
MULTIDOC_QA, MULTITURN = "multidoc_qa", "multiturn"  # (their data pools are keyed by task: eval/tasks/longctx_data.py)
RETRIEVAL, CODE_QA, PASSAGE_QA_GEN = "retrieval", "code_qa", "passage_qa_gen"
LONG_TASKS = (RETRIEVAL, MULTIDOC_QA, CODE_QA, MULTITURN, PASSAGE_QA_GEN)  # the long-context suite
GENERAL, GENERAL_V2, GENERAL_V3 = "general", "general-v2", "general-v3"
GENERAL_V4, GENERAL_V5 = "general-v4", "general-v5"


class Names:
    """A kind's names in their order, each with the `module:attr` of the object it names, loaded on demand."""

    def __init__(self, kind: str, table: dict[str, str], oracles: dict[str, str] | None = None):
        self.kind, self.table, self.oracles = kind, {**table, **(oracles or {})}, tuple(oracles or ())

    def __iter__(self) -> Iterator[str]:
        return iter(self.table)

    def __contains__(self, name: object) -> bool:
        return name in self.table

    def __len__(self) -> int:
        return len(self.table)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.table)

    def check(self, name: str) -> str:
        """`name` if it is one of this kind's, else a RarecacheError listing them."""
        if name not in self.table:
            raise RarecacheError(f"unknown {self.kind} {name!r}; choose from {', '.join(self.table)}")
        return name

    def load(self, name: str) -> Any:
        """The object `name` names (its module imported now)."""
        module, attr = self.table[self.check(name)].split(":")
        return getattr(importlib.import_module(module), attr)

    def names_of(self, module: str, attr: str) -> tuple[str, ...]:
        """Every name registered for `module:attr`: one for a selector or task class, several for a class
        whose instances carry the names (`QuerySelector`), none for a base class or a test's own."""
        return tuple(n for n, where in self.table.items() if where == f"{module}:{attr}")

    def name_of(self, module: str, attr: str) -> str:
        """The one name registered for `module:attr` (a class may read its own name here rather than spell it)."""
        found = self.names_of(module, attr)
        if len(found) != 1:
            raise KeyError(f"{module}:{attr} is registered as {len(found)} {self.kind}s")
        return found[0]

    def help(self, default: str | None = None) -> str:
        """The names for a flag's help, oracles marked, and the default."""
        listed = ", ".join(f"{n} (oracle)" if n in self.oracles else n for n in self.table)
        return listed + (f" (default: {default})" if default is not None else "")


_SEL = "rarecache.transfer.selectors"
SELECTORS = Names("selector", {
    RANK: f"{_SEL}:RankDisagreement",
    RANDOM: f"{_SEL}:Random",
    ATTN_SOURCE: f"{_SEL}:SourceAttention",
    SUFFIX: f"{_SEL}:Suffix",
    "attn-rank": f"{_SEL}:AttentionTimesRank",
    "attn+rank": f"{_SEL}:AttentionPlusRank",
    "suffix+attn": f"{_SEL}:SuffixPlusAttention",
    SUFFIX_RANK: f"{_SEL}:SuffixPlusRank",
    **{name: f"{_SEL}:QuerySelector" for name in QUERY_VARIANTS},
    LAYER_PREFIX: "rarecache.transfer.handoff:LAYER_PREFIX",  # a schedule: no positions chosen
}, oracles={  # they read the target's own prefill: evaluation only, never a default or served
    "attn-target": f"{_SEL}:TargetAttention",
    "l2-oracle": f"{_SEL}:L2Oracle",
})

_TASKS = "rarecache.eval.tasks"
TASKS = Names("task", {
    "gsm8k": f"{_TASKS}.gsm8k:GSM8K",
    GSM8K_BPB: f"{_TASKS}.gsm8k:GSM8KBPB",
    ARC_CHALLENGE: f"{_TASKS}.multiple_choice:ARCChallenge",
    "arc_easy": f"{_TASKS}.multiple_choice:ARCEasy",
    "hellaswag": f"{_TASKS}.multiple_choice:HellaSwag",
    "winogrande": f"{_TASKS}.multiple_choice:WinoGrande",
    MMLU: f"{_TASKS}.mmlu:MMLU",
    "coqa": f"{_TASKS}.coqa:CoQA",
    COQA_BPB: f"{_TASKS}.coqa:CoQABPB",
    COQA_PASSAGE: f"{_TASKS}.coqa:CoQAPassage",
    "wiki_ppl": f"{_TASKS}.wiki_ppl:WikiPerplexity",
    # the long-context suite (eval/tasks/longctx.py): built at --length 1024, 2048 or 4096
    RETRIEVAL: f"{_TASKS}.retrieval:Retrieval",
    MULTIDOC_QA: f"{_TASKS}.documents:MultiDocQA",
    CODE_QA: f"{_TASKS}.code_qa:CodeQA",
    MULTITURN: f"{_TASKS}.retrieval:MultiTurn",
    PASSAGE_QA_GEN: f"{_TASKS}.documents:PassageQAGen",
})

PRESETS = Names("preset", {
    GENERAL: "rarecache.eval.mix:SERVED_COMPONENTS",  # the served map's mix: one of the others
    GENERAL_V2: "rarecache.eval.mix:COMPONENTS",
    GENERAL_V3: "rarecache.eval.mix:COMPONENTS_V3",
    GENERAL_V4: "rarecache.eval.mix:COMPONENTS_V4",  # v3 + the long-context tasks' held-apart items (a candidate)
    GENERAL_V5: "rarecache.eval.mix:COMPONENTS_V5",  # the same, four times the long share (a candidate)
})
