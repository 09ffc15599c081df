"""Row loading: located errors, jsonl/json/parquet, eval files, and per-schema parsing."""

import json

import pytest

from jaxgrpo import data
from jaxgrpo.data import MalformedRowError
from jaxgrpo.data.base import prompt_key, read_local
from jaxgrpo.grading.answers import last_boxed

GOOD = {"question": "What is 2 + 3?", "answer": "2 + 3 = <<2+3=5>>5\n#### 5"}


def _jsonl(path, rows):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return str(path)


def test_missing_field_names_file_row_and_field(tmp_path):
    path = _jsonl(tmp_path / "g.jsonl", [GOOD, {**GOOD, "question": "Q2?"}, {"question": "Q3?"}])
    task = data.get_task("gsm8k", source=path)
    with pytest.raises(MalformedRowError) as err:
        task.eval_examples()
    message = str(err.value)
    assert path in message and "row 3" in message and "'answer'" in message, message


def test_invalid_json_and_non_object_rows_are_located(tmp_path):
    path = _jsonl(tmp_path / "bad.jsonl", [GOOD, "", '{"question": "oops"', GOOD])
    with pytest.raises(MalformedRowError, match=r"bad.jsonl: row 3: invalid JSON"):
        read_local(path)
    path = _jsonl(tmp_path / "list.jsonl", [GOOD, "[1, 2]"])
    with pytest.raises(MalformedRowError, match=r"row 2: expected an object"):
        read_local(path)
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        read_local(str(tmp_path / "nope.jsonl"))


def test_json_and_parquet_read_the_same_rows(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    rows = [{**GOOD, "question": f"What is {i} + 3?"} for i in range(5)]
    (tmp_path / "g.json").write_text(json.dumps({"data": rows}))
    pq.write_table(pa.Table.from_pylist(rows), str(tmp_path / "g.parquet"))
    from_jsonl = data.get_task("gsm8k", source=_jsonl(tmp_path / "g.jsonl", rows))
    for ext in ("json", "parquet"):
        task = data.get_task("gsm8k", source=str(tmp_path / f"g.{ext}"))
        assert task.eval_examples() == from_jsonl.eval_examples()
        assert task.train_examples(0) == from_jsonl.train_examples(0)
    bad = [rows[0], {"question": "no answer"}]
    pq.write_table(pa.Table.from_pylist(bad), str(tmp_path / "bad.parquet"))
    with pytest.raises(MalformedRowError, match=r"bad.parquet: row 2: missing field 'answer'"):
        data.get_task("gsm8k", source=str(tmp_path / "bad.parquet")).eval_examples()


def test_eval_file_overlap_is_removed_from_train(tmp_path):
    """A question in both files (differing only in case/whitespace) stays in eval only."""
    train_rows = [{**GOOD, "question": f"What is {i} + 3?"} for i in range(4)]
    train_rows.append({**GOOD, "question": "  what IS 7 +   3? "})
    eval_rows = [{**GOOD, "question": "What is 7 + 3?"}, {**GOOD, "question": "What is 9 + 9?"}]
    task = data.get_task(
        "gsm8k",
        source=_jsonl(tmp_path / "train.jsonl", train_rows),
        eval_source=_jsonl(tmp_path / "eval.jsonl", eval_rows),
    )
    train, evals = task.train_examples(0), task.eval_examples()
    assert len(evals) == 2 and len(train) == 4
    assert not {prompt_key(e) for e in train} & {prompt_key(e) for e in evals}


def test_gsm8k_parsing():
    task = data.get_task("gsm8k", source="fixture")
    rows = {e["messages"][-1]["content"].split("\n\n")[-1]: e for e in task.eval_examples()}
    rows.update({e["messages"][-1]["content"].split("\n\n")[-1]: e for e in task.train_examples()})
    shop = next(e for q, e in rows.items() if q.startswith("A shop sold 2,400 pens"))
    assert shop["answer"] == "7200", "thousands separators are removed after ####"
    assert "<<" not in shop["reference"] and "####" not in shop["reference"]
    assert shop["reference"].endswith("2400 + 4800 = 7,200 pens.")


def test_gsm8k_without_final_answer_fails(tmp_path):
    path = _jsonl(tmp_path / "g.jsonl", [GOOD, {"question": "Q?", "answer": "no marker"}])
    with pytest.raises(MalformedRowError, match=r"row 2: field 'answer' has no '####"):
        data.get_task("gsm8k", source=path).eval_examples()


def test_r1_traces_columns_are_configurable(tmp_path):
    rows = [
        {"q": f"Q{i}?", "final": f"#### {i}", "deepseek": f"<think>step {i}</think> done"}
        for i in range(5)
    ]
    path = _jsonl(tmp_path / "t.jsonl", rows)
    task = data.get_task(
        "gsm8k_r1_traces",
        source=path,
        question_column="q",
        answer_column="final",
        trace_column="deepseek",
    )
    example = (task.train_examples() + task.eval_examples())[0]
    i = example["answer"]
    assert example["reference"] == f"step {i} done"
    with pytest.raises(MalformedRowError, match=r"none of \['trace', 'reasoning'"):
        data.get_task(
            "gsm8k_r1_traces", source=path, question_column="q", answer_column="final"
        ).eval_examples()


@pytest.mark.parametrize(
    "text, boxed",
    [
        (r"so $x = \boxed{5}$.", "5"),
        (r"\boxed{1} then \boxed{\frac{1}{2}}", r"\frac{1}{2}"),
        (r"\boxed{\sqrt{2}+{3}}", r"\sqrt{2}+{3}"),
        (r"answer \fbox{7}", "7"),
        (r"answer is \boxed 9.", "9"),
        (r"unclosed \boxed{3", None),
        ("no box", None),
    ],
)
def test_last_boxed(text, boxed):
    assert last_boxed(text) == boxed


def test_math_answer_column_wins_and_missing_box_fails(tmp_path):
    rows = [
        {"problem": "P1", "solution": r"\boxed{1}", "answer": "one"},
        {"problem": "P2", "solution": r"so \boxed{\frac{2}{3}}"},
        {"problem": "P3", "solution": "no box here"},
    ]
    path = _jsonl(tmp_path / "m.jsonl", rows)
    with pytest.raises(MalformedRowError, match=r"row 3: field 'solution' has no \\boxed"):
        data.get_task("math", source=path).eval_examples()
    task = data.get_task("math", source=_jsonl(tmp_path / "m2.jsonl", rows[:2]), eval_fraction=0.5)
    answers = {
        e["messages"][-1]["content"][-2:]: e["answer"]
        for e in task.train_examples() + task.eval_examples()
    }
    assert answers == {"P1": "one", "P2": r"\frac{2}{3}"}


def test_jeebench_rejects_unknown_type(tmp_path):
    path = tmp_path / "j.json"
    path.write_text(json.dumps([{"question": "Q", "gold": "A", "type": "Essay"}]))
    with pytest.raises(MalformedRowError, match=r"j.json: row 1: field 'type' is 'Essay'"):
        data.get_task("jeebench", source=str(path)).eval_examples()


def test_sonnets_theme_and_reference_columns(tmp_path):
    rows = [{"topic": f"topic {i}.", "poem": f"poem {i}" if i % 2 else None} for i in range(6)]
    task = data.get_task("sonnets", source=_jsonl(tmp_path / "s.jsonl", rows))
    for e in task.train_examples() + task.eval_examples():
        i = int(e["theme"].split()[-1])
        assert e["messages"][-1]["content"] == f"Write a sonnet about topic {i}."
        assert e["reference"] == (f"poem {i}" if i % 2 else None)
        assert "master poet" in e["messages"][0]["content"]
    with pytest.raises(MalformedRowError, match="missing field 'title'"):
        data.get_task(
            "sonnets", source=str(tmp_path / "s.jsonl"), theme_column="title"
        ).eval_examples()


def test_code_reads_full_and_sanitized_schemas(tmp_path):
    rows = [
        {
            "prompt": f"Write f{i}.",
            "code": f"def f{i}(): return {i}",
            "test_list": [f"assert f{i}() == {i}"],
            "test_imports": ["import math"],
        }
        for i in range(5)
    ]
    task = data.get_task("code", source=_jsonl(tmp_path / "c.jsonl", rows))
    for e in task.train_examples() + task.eval_examples():
        i = e["reference"][5]
        assert e["tests"] == [f"assert f{i}() == {i}"] and e["setup"] == "import math"
        assert e["messages"][-1]["content"].endswith(f"assert f{i}() == {i}")
    bad = [{**rows[0], "test_list": "assert True"}]
    with pytest.raises(MalformedRowError, match="'test_list' must be a non-empty list"):
        data.get_task("code", source=_jsonl(tmp_path / "b.jsonl", bad)).eval_examples()


def test_jsonl_prompt_column_mapping_and_passthrough(tmp_path):
    rows = [{"input": f"Say {i}", "label": str(i), "meta": i} for i in range(4)] + [
        {"input": [{"role": "user", "content": "Say 9"}], "label": "9", "meta": 9}
    ]
    path = _jsonl(tmp_path / "u.jsonl", rows)
    task = data.get_task("jsonl", source=path, prompt_column="input", eval_fraction=0.4)
    examples = task.train_examples() + task.eval_examples()
    assert len(examples) == 5 and len(task.eval_examples()) == 2
    for e in examples:
        assert e["messages"] == [{"role": "user", "content": f"Say {e['label']}"}]
        assert e["meta"] == int(e["label"]) and "input" not in e
    mapped = data.get_task(
        "jsonl",
        source=path,
        prompt_column="input",
        column_map={"answer": "label"},
        template="answer_tag",
    )
    e = mapped.eval_examples()[0]
    assert set(e) == {"messages", "answer"} and mapped.columns == ("answer",)
    assert e["messages"][-1]["content"].startswith("Solve this question")
    with pytest.raises(MalformedRowError, match=r"u.jsonl: row 1: missing field 'prompt'"):
        data.get_task("jsonl", source=path).eval_examples()
    with pytest.raises(ValueError, match="needs source="):
        data.get_task("jsonl").eval_examples()
