"""`code_qa`: a long source listing and a question whose answer is defined at its top (issue 54: these are coder
models, and this is their users' case).

The listing opens with `settings.py`, six constants and four small functions, then runs on through code from
exllamav2's calibration set (`longctx_data.code_blocks`: the parts the general mix does not read) up to the
item's length. Even items ask the value assigned to one constant; odd ones the name of the function that does
a described thing (the functions carry no docstring: the answer is read from their bodies). Either answer is
one exact identifier or literal, scored by exact match and F1 after SQuAD normalisation (quotes, underscores
and case do not count), and no code block of the listing contains it.

Constant and function names come from word lists split in two: the evaluated items use one half, the
calibration pool the other.
"""

from __future__ import annotations

import re

from .longctx import LongContextTask, qa_score, seeded
from .longctx_data import code_blocks

PREFIXES = ("MAX", "MIN", "DEFAULT", "BASE", "INITIAL", "TOTAL")
SUBJECTS = ("RETRY", "CACHE", "BATCH", "UPLOAD", "SESSION", "WORKER", "BUFFER", "QUEUE", "TOKEN", "REQUEST",
            "SHARD", "LOG", "INDEX", "EXPORT", "SYNC", "PAGE", "REPLICA", "THREAD", "SOCKET", "JOB")
SUFFIXES = ("COUNT", "SIZE", "LIMIT", "TIMEOUT", "INTERVAL", "DEPTH", "WINDOW", "RATE")
STRING_SUFFIXES = ("NAME", "PATH", "REGION", "MODE", "PREFIX")
WORDS = ("amber", "birch", "cobalt", "delta", "ember", "fjord", "granite", "harbor", "indigo", "juniper", "krypton",
         "lumen", "marble", "nimbus", "onyx", "pylon", "quartz", "raven", "sierra", "tundra")
VERBS = ("handle", "process", "apply", "resolve", "transform", "dispatch", "collect", "prepare")
TAGS = ("alpha", "bravo", "cedar", "dorado", "eagle", "fable", "gusto", "helix", "ivory", "jasper", "karma", "lotus",
        "mango", "nova", "opal", "prism", "quill", "rhino", "sable", "topaz", "umber", "vortex", "willow", "zephyr")
# (what the function does, its parameters, its body)
FUNCTIONS = (
    ("returns the largest value in a list", "values", "best = values[0]\n    for v in values:\n        if v > best:\n"
     "            best = v\n    return best"),
    ("counts the vowels in a string", "text", "return sum(1 for c in text.lower() if c in \"aeiou\")"),
    ("reverses the order of the words in a sentence", "sentence", "return \" \".join(sentence.split()[::-1])"),
    ("checks whether a number is prime", "n", "if n < 2:\n        return False\n    return all(n % d for d in "
     "range(2, int(n ** 0.5) + 1))"),
    ("returns the sum of the squares of a list of numbers", "numbers", "return sum(x * x for x in numbers)"),
    ("removes duplicates from a list, keeping the first of each", "items", "seen = set()\n    out = []\n    for x "
     "in items:\n        if x not in seen:\n            seen.add(x)\n            out.append(x)\n    return out"),
    ("converts a temperature from Celsius to Fahrenheit", "celsius", "return celsius * 9 / 5 + 32"),
    ("returns the n-th Fibonacci number", "n", "a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n"
     "    return a"),
    ("checks whether a string reads the same backwards", "text", "s = text.lower()\n    return s == s[::-1]"),
    ("flattens a list of lists into one list", "nested", "return [x for inner in nested for x in inner]"),
    ("returns the average of a list of numbers", "numbers", "return sum(numbers) / len(numbers)"),
    ("returns the greatest common divisor of two integers", "a, b", "while b:\n        a, b = b, a % b\n"
     "    return a"),
    ("splits a list into chunks of a given size", "items, size", "return [items[i:i + size] for i in "
     "range(0, len(items), size)]"),
    ("returns the factorial of a number", "n", "result = 1\n    for k in range(2, n + 1):\n        result *= k\n"
     "    return result"),
    ("counts how many times each word occurs in a text", "text", "counts = {}\n    for w in text.split():\n"
     "        counts[w] = counts.get(w, 0) + 1\n    return counts"),
    ("returns the characters a string has in common with another", "a, b", "return sorted(set(a) & set(b))"),
)
ASK = ("Below is the source of a small project, file by file. Answer the question after it with the exact value "
       "or name only.")


def _constant(rng, split: str, taken: set[str]) -> tuple[str, str, str]:
    """(name, the literal as written, the answer): an integer, or a string value (the answer without its quotes)."""
    subjects = SUBJECTS[0::2] if split == "eval" else SUBJECTS[1::2]
    while True:
        if rng.random() < 0.6:
            name = f"{rng.choice(PREFIXES)}_{rng.choice(subjects)}_{rng.choice(SUFFIXES)}"
            value = str(rng.randrange(100, 100_000))  # (above every number in the bodies)
            literal = value
        else:
            name = f"{rng.choice(subjects)}_{rng.choice(STRING_SUFFIXES)}"
            value = f"{rng.choice(WORDS)}-{rng.choice(WORDS)}-{rng.randrange(2, 99)}"
            literal = f'"{value}"'
        if name not in taken and value not in taken:
            taken |= {name, value}
            return name, literal, value


def header(rng, split: str) -> tuple[str, list[tuple[str, str]], list[tuple[str, str]]]:
    """settings.py: its text, its constants (name, answer) and functions (name, what it does)."""
    taken: set[str] = set()
    constants = [_constant(rng, split, taken) for _ in range(6)]
    tags = TAGS[0::2] if split == "eval" else TAGS[1::2]
    names = rng.sample([f"{v}_{t}" for v in VERBS for t in tags], 4)
    functions = [(name, *f) for name, f in zip(names, rng.sample(FUNCTIONS, 4))]
    text = '"""Settings and small helpers shared by the rest of the project."""\n\n' + "\n".join(
        f"{name} = {literal}" for name, literal, _ in constants) + "\n" + "".join(
        f"\n\ndef {name}({params}):\n    {body}\n" for name, _, params, body in functions)
    return text, [(n, v) for n, _, v in constants], [(n, what) for n, what, _, _ in functions]


class CodeQA(LongContextTask):
    metric = "f1"
    max_new_tokens = 32

    def build(self, split: str, T: int, k: int):
        rng = seeded(self.name, split, T, k)
        settings, constants, functions = header(rng, split)
        if k % 2 == 0:
            name, answer = constants[rng.randrange(len(constants))]
            question, kind = f"In settings.py, what value is assigned to {name}?", "constant"
        else:
            answer, what = functions[rng.randrange(len(functions))]
            question, kind = f"Which function defined in settings.py {what}? Give its name.", "function"
        blocks = self.memo(("blocks", split), lambda: code_blocks(split, self.cache_dir))
        start = rng.randrange(len(blocks))
        word = re.compile(rf"(?<![\w-]){re.escape(answer)}(?![\w-])")
        body = [b for b in blocks[start:] + blocks[:start] if not word.search(b[1])]

        def render(chosen: list[tuple[int, str]]) -> list[dict]:
            files, last = [], None
            for index, block in chosen:  # consecutive blocks of one source file form one listed file
                if index != last:
                    files.append(f"### file_{len(files) + 1:02d}.txt\n")
                files[-1] += block + "\n\n"
                last = index
            text = "\n".join([f"### settings.py\n{settings}\n", *files]).rstrip()
            return [{"role": "user", "content": f"{ASK}\n\n{text}\n\nQuestion: {question}"}]

        messages, chosen = self.fill(T, render, body, lambda b: self.cost(b[1] + "\n\n"), self._lines)
        sources = [f"code:{i}" for i, _ in chosen] + [f"const:{n}={v}" for n, v in constants] + \
            [f"function:{n}" for n, _ in functions]
        return self.item(split, T, k, messages, [answer], sources, kind=kind, depth=0.0)

    def _lines(self, block: tuple[int, str], tokens: int) -> tuple[int, str] | None:
        """The block's first lines, as many as fit in `tokens` (the listing's last file may end mid-way)."""
        lines = block[1].split("\n")
        for n in range(len(lines) - 1, 0, -1):
            if len(self.tokenizer.encode("\n".join(lines[:n]), add_special_tokens=False)) + 12 <= tokens:
                return block[0], "\n".join(lines[:n])
        return None

    def score(self, item, text: str) -> dict:
        return {**qa_score(item.gold, text), **self.fields(item)}
