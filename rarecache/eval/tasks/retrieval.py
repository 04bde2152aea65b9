"""Facts to find again: `retrieval` (key -> value facts hidden in a long text) and `multiturn` (a fact stated in an
early turn of a long conversation, asked for at its end).

Both score the exact 7-digit value in the reply (`correct`). The handoff's failure these measure (issue 54): the
handed-off 1.5B starts the right value and stops after a few digits, or gives a distractor's value.

`retrieval` cycles its items over three haystacks (`KINDS`): one fact in repeated filler sentences; the fact
among three distractor facts in filler; the fact and one distractor in Paul Graham's essays; and over the
depths 0-100% of the fact (distractors at random depths). `multiturn` states the fact in one of the first
three user turns, then runs exchanges about HotpotQA paragraphs (the user asks about a title, the assistant
answers with its paragraph), with a distractor fact in a later turn on every other item, and asks last. The
whole conversation is the prompt the other model reads.

Keys are an adjective and a noun; the evaluated items use every other noun and the calibration pool the
rest, so no fact is in both.
"""

from __future__ import annotations

from .longctx import DEPTHS, LongContextTask, place, seeded, value_score
from .longctx_data import essay_tails, hotpot_pool

ADJECTIVES = ("amber", "brisk", "calm", "dusty", "eager", "faint", "gentle", "hollow", "icy", "jolly", "keen",
              "lively", "mellow", "noble", "odd", "plain", "quiet", "rapid", "silent", "tidy", "upper", "vivid",
              "wary", "young", "zesty", "bold", "crisp", "dim", "early", "fresh")
NOUNS = ("anchor", "badger", "canyon", "dagger", "engine", "falcon", "garden", "harbor", "island", "jacket",
         "kettle", "lantern", "meadow", "needle", "orchard", "pepper", "quarry", "river", "saddle", "tunnel",
         "umbrella", "valley", "walnut", "yarrow", "zipper", "beacon", "cellar", "dune", "ember", "forge",
         "glacier", "hammock", "igloo", "jungle", "kiosk", "ledger", "mirror", "nectar", "oyster", "parcel")
KINDS = ("filler", "distractors", "essays")
DISTRACTORS = {"filler": 0, "distractors": 3, "essays": 1}
# the noise haystack of needle-in-a-haystack tests (RULER's): content-free sentences, repeated
NOISE = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again.")
RETRIEVAL_ASK = ("Some special magic numbers are hidden in the text below. Read it, then answer the question "
                 "after it briefly.")


def keys_and_values(split: str, rng, n: int, avoid: str = "") -> list[tuple[str, str]]:
    """`n` distinct facts (key, 7-digit value) of the split's nouns; no value occurs in `avoid`."""
    nouns = NOUNS[0::2] if split == "eval" else NOUNS[1::2]
    facts: list[tuple[str, str]] = []
    while len(facts) < n:
        key = f"{rng.choice(ADJECTIVES)}-{rng.choice(nouns)}"
        value = str(rng.randrange(1_000_000, 10_000_000))
        if all(key != k and value != v for k, v in facts) and value not in avoid:
            facts.append((key, value))
    return facts


class Retrieval(LongContextTask):
    metric = "correct"

    def _haystack(self, split: str, kind: str, rng) -> tuple[list[str], str, list[str]]:
        """Filler units in order (more than any length needs), their separator, and the sources they come from:
        noise sentences, or essay lines from a random line of a random essay on through the next essays."""
        if kind != "essays":
            start = rng.randrange(len(NOISE))
            return [NOISE[(start + j) % len(NOISE)] for j in range(3000)], " ", []
        essays = essay_tails(split, self.cache_dir)
        e = rng.randrange(len(essays))
        units, sources = essays[e][1][rng.randrange(len(essays[e][1])):], [f"essay:{essays[e][0]}"]
        while len(units) < 1000:
            e = (e + 1) % len(essays)
            units, sources = units + essays[e][1], sources + [f"essay:{essays[e][0]}"]
        return units, "\n", sources

    def build(self, split: str, T: int, k: int):
        rng = seeded(self.name, split, T, k)
        kind, depth = KINDS[k % len(KINDS)], DEPTHS[k % len(DEPTHS)]
        filler, sep, sources = self._haystack(split, kind, rng)
        facts = keys_and_values(split, rng, 1 + DISTRACTORS[kind], avoid=" ".join(filler))
        sentences = [f"The special magic number for {key} is: {value}." for key, value in facts]
        needles = [(sentences[0], depth)] + [(s, rng.random()) for s in sentences[1:]]
        question = f"What is the special magic number for {facts[0][0]}? Answer with the number only."
        cost = lambda u: self.cost(sep + u)  # noqa: E731

        def render(units: list[str]) -> list[dict]:
            text = sep.join(place(units, needles, cost))
            return [{"role": "user", "content": f"{RETRIEVAL_ASK}\n\n{text}\n\n{question}"}]

        messages, _ = self.fill(T, render, filler, cost, in_order=True)
        return self.item(split, T, k, messages, facts[0][1], sources + [f"fact:{key}={v}" for key, v in facts],
                         kind=kind, depth=depth, distractors=[v for _, v in facts[1:]])

    def score(self, item, text: str) -> dict:
        return {**value_score(item.gold, text), **self.fields(item)}


TELL = ("Tell me about {}.", "What do you know about {}?", "Give me a short overview of {}.", "Can you describe {}?")
NOTED = "Noted, I will remember that."


class MultiTurn(Retrieval):

    def build(self, split: str, T: int, k: int):
        rng = seeded(self.name, split, T, k)
        pool = hotpot_pool(self.name, split, self.cache_dir).paragraphs
        start = rng.randrange(len(pool))
        exchanges = [(t, TELL[(start + j) % len(TELL)].format(t), text)
                     for j, (t, text) in enumerate(pool[start:] + pool[:start]) if len(text) > 200][:400]
        facts = keys_and_values(split, rng, 1 + k % 2, avoid=" ".join(x for *_, x in exchanges))
        statements = [("Please remember this for later: the access code for {} is {}.",
                       "Also remember: the access code for {} is {}.")[j].format(*f) for j, f in enumerate(facts)]
        question = f"What is the access code for {facts[0][0]} that I gave you earlier? Answer with the number only."
        fact_turn = k % 3  # the fact comes in one of the first three user turns
        later = rng.uniform(0.3, 0.9)  # the distractor's place, a share of the conversation after the fact

        def render(chosen: list[tuple[str, str, str]]) -> list[dict]:
            turns = [(user, reply) for _, user, reply in chosen]
            turns.insert(min(fact_turn, len(turns)), (statements[0], NOTED))
            if len(facts) > 1:
                at = fact_turn + 1 + round(later * (len(turns) - fact_turn - 1))
                turns.insert(min(at, len(turns)), (statements[1], NOTED))
            messages = [m for user, reply in turns for m in ({"role": "user", "content": user},
                                                            {"role": "assistant", "content": reply})]
            return messages + [{"role": "user", "content": question}]

        # (+ 10: the chat markup of two turns)
        messages, chosen = self.fill(T, render, exchanges, lambda e: self.cost(f"{e[1]}\n{e[2]}") + 10,
                                     lambda e, n: (e[0], e[1], x) if (x := self.sentences(e[2], n - 24)) else None)
        used = [t for t, _, _ in chosen]
        return self.item(split, T, k, messages, facts[0][1], [f"para:{t}" for t in used] +
                         [f"fact:{key}={v}" for key, v in facts], fact_turn=fact_turn,
                         distractors=[v for _, v in facts[1:]])

    def fields(self, item) -> dict:
        return {"length": item.extra["length"], "fact_turn": item.extra["fact_turn"]}
