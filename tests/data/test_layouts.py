"""Datasets in other frameworks' layouts load through the same loader: verl parquet, key mapping."""

import json
import warnings

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from prorl_async.config import load_config
from prorl_async.data.datasets import load_rows, load_source
from prorl_async.rewards import grade

# the exact Arrow shape verl's examples/data_preprocess/gsm8k.py writes (via datasets.to_parquet)
VERL_SCHEMA = pa.schema([
    ("data_source", pa.string()),
    ("prompt", pa.list_(pa.struct([("content", pa.string()), ("role", pa.string())]))),
    ("ability", pa.string()),
    ("reward_model", pa.struct([("ground_truth", pa.string()), ("style", pa.string())])),
    ("extra_info", pa.struct([("answer", pa.string()), ("index", pa.int64()),
                              ("question", pa.string()), ("split", pa.string())])),
])


def verl_record(k, data_source="openai/gsm8k", ability="math", gt=None, question=None):
    question = question or f"Tom has {k} apples and buys {k + 1} more. How many apples does he have?"
    return {
        "data_source": data_source,
        "prompt": [{"content": question + " Let's think step by step and output the final answer after \"####\".",
                    "role": "user"}],
        "ability": ability,
        "reward_model": {"ground_truth": gt if gt is not None else str(2 * k + 1), "style": "rule"},
        "extra_info": {"answer": f"{k}+{k + 1} = <<{k}+{k + 1}={2 * k + 1}>>{2 * k + 1}\n#### {2 * k + 1}",
                       "index": k, "question": question, "split": "train"},
    }


def write_verl(path, records):
    pq.write_table(pa.Table.from_pylist(records, schema=VERL_SCHEMA), path)
    return str(path)


def test_verl_parquet_loads_as_math_rows_that_grade(tmp_path):
    path = write_verl(tmp_path / "train.parquet", [verl_record(k) for k in range(5)])
    assert pq.read_schema(path).field("reward_model").type.num_fields == 2  # really nested
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no row is skipped
        rows = load_rows(path, strict=True)
    assert [r["id"] for r in rows] == [f"openai/gsm8k-{k}" for k in range(1, 6)]
    r = rows[3]
    assert r["domain"] == "math" and r["answer"] == "7"
    assert r["prompt"] == [{"content": r["meta"]["extra_info"]["question"]
                            + " Let's think step by step and output the final answer after \"####\".",
                            "role": "user"}]
    assert r["meta"]["data_source"] == "openai/gsm8k" and r["meta"]["extra_info"]["index"] == 3
    assert grade(r, "3 + 4 = 7, so \\boxed{7}").reward == 1.0
    assert grade(r, "\\boxed{8}").reward == 0.0


@pytest.mark.parametrize("ability,data_source,domain", [
    ("math", "anything", "math"),
    ("MATH", "x", "math"),
    ("", "lighteval/MATH", "math"),
    (None, "DigitalLearningGmbH/MATH-lighteval", "math"),
    ("", "aime2024", "math"),
    ("", "math_dapo", "math"),
    ("unknown_skill", "AI-MO/NuminaMath-CoT", "math"),
    ("coding", "x", "code"),
    ("", "likaixin/TACO-verified", "code"),
    ("", "google/IFEval", "instruction"),
    ("", "Idavidrein/gpqa", "stem"),
    ("", "MiniMaxAI/SynLogic", "logic"),
])
def test_verl_domain_from_ability_then_data_source(tmp_path, ability, data_source, domain):
    gt = json.dumps({"inputs": ["1 2\n"], "outputs": ["3\n"]}) if domain == "code" else \
        json.dumps([{"type": "no_commas", "kwargs": {}}]) if domain == "instruction" else "3"
    rec = verl_record(1, data_source=data_source, ability=ability, gt=gt)
    rows = load_rows(write_verl(tmp_path / "d.parquet", [rec]), strict=True)
    assert rows[0]["domain"] == domain


def test_verl_code_ground_truth_in_the_apps_form_becomes_stdio_tests(tmp_path):
    gt = json.dumps({"inputs": ["1 2\n", "5 5\n"], "outputs": ["3\n", "10\n"]})
    rec = verl_record(1, data_source="codecontests", ability="code", gt=gt, question="Add two ints.")
    row = load_rows(write_verl(tmp_path / "d.parquet", [rec]), strict=True)[0]
    assert row["tests"] == [{"input": "1 2\n", "output": "3\n"}, {"input": "5 5\n", "output": "10\n"}]
    assert grade(row, "```python\na, b = map(int, input().split())\nprint(a + b)\n```").reward == 1.0


def test_verl_unknown_domain_is_a_bad_row_naming_the_fix_and_data_domain_overrides(tmp_path):
    path = write_verl(tmp_path / "d.parquet", [verl_record(1, data_source="my/corpus", ability="chat")])
    with pytest.raises(ValueError) as e:
        load_rows(path, strict=True)
    assert f"{path}: row 1" in str(e.value) and "set data.domain" in str(e.value)
    assert load_rows(path, strict=True, domain="math")[0]["domain"] == "math"
    # data.domain wins over a known ability too
    path2 = write_verl(tmp_path / "e.parquet", [verl_record(1, ability="math")])
    assert load_rows(path2, domain="stem")[0]["domain"] == "stem"


def test_native_rows_next_to_verl_rows_are_untouched(tmp_path):
    native = {"id": "n1", "domain": "math", "prompt": "1+1?", "answer": "2"}
    p = tmp_path / "mixed.jsonl"
    p.write_text(json.dumps(native) + "\n" + json.dumps(verl_record(4)) + "\n")
    rows = load_rows(str(p), strict=True)
    assert rows[0] == native and rows[1]["id"] == "openai/gsm8k-2" and rows[1]["answer"] == "9"


# ---- OpenRLHF-style key mapping


def test_key_mapping_jsonl_with_data_domain(tmp_path):
    p = tmp_path / "openrlhf.jsonl"
    recs = [{"context_messages": [{"role": "user", "content": f"{k}+{k}?"}], "answer": str(2 * k)}
            for k in range(3)]
    p.write_text("".join(json.dumps(r) + "\n" for r in recs))
    rows = load_rows(str(p), strict=True, input_key="context_messages", label_key="answer", domain="math")
    assert [r["id"] for r in rows] == ["openrlhf-1", "openrlhf-2", "openrlhf-3"]
    assert rows[2]["prompt"] == recs[2]["context_messages"] and rows[2]["answer"] == "4"
    assert all(r["domain"] == "math" for r in rows) and "context_messages" not in rows[0]
    assert grade(rows[2], "\\boxed{4}").reward == 1.0


def test_key_mapping_dotted_label_row_domain_and_ids(tmp_path):
    p = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist([
        {"id": 7, "q": "Sum 1 2", "domain": "code",
         "gold": {"tests": json.dumps([{"input": "1 2\n", "output": "3\n"}])}},
        {"id": 8, "q": "What is 2*3?", "domain": "math", "gold": {"tests": "6"}},
    ]), p)
    rows = load_rows(str(p), strict=True, input_key="q", label_key="gold.tests")
    assert [r["id"] for r in rows] == ["7", "8"]
    assert rows[0]["tests"] == [{"input": "1 2\n", "output": "3\n"}] and rows[1]["answer"] == "6"
    assert grade(rows[0], "print(3)").reward == 1.0


@pytest.mark.parametrize("setting", ["input_key", "label_key"])
def test_key_absent_from_the_file_is_one_error_naming_key_file_and_fix(tmp_path, setting):
    p = tmp_path / "d.jsonl"
    p.write_text("".join(json.dumps({"question": "1+1?", "answer": "2"}) + "\n" for _ in range(3)))
    keys = {"input_key": "question", "label_key": "answer", setting: "prompt_text"}
    with pytest.raises(ValueError) as e:
        load_rows(str(p), domain="math", **keys)
    msg = str(e.value)
    assert str(p) in msg and f"data.{setting}='prompt_text'" in msg
    assert "['answer', 'question']" in msg and f"set data.{setting} to the column" in msg
    assert msg.count("\n") == 0


def test_key_missing_in_some_records_skips_those_rows(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps({"q": "1+1?", "a": "2"}) + "\n" + json.dumps({"q": "2+2?"}) + "\n")
    with pytest.warns(UserWarning, match=r"line 2: no 'a' \(data.label_key\)"):
        rows = load_rows(str(p), input_key="q", label_key="a", domain="math")
    assert [r["answer"] for r in rows] == ["2"]


def test_mapping_without_any_domain_names_the_setting(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps({"q": "1+1?", "a": "2"}) + "\n")
    with pytest.raises(ValueError, match=r"line 1: no domain: set data.domain"):
        load_rows(str(p), strict=True, input_key="q", label_key="a")


def test_bad_loader_settings_raise(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps({"q": "1+1?", "a": "2"}) + "\n")
    with pytest.raises(ValueError, match="data.domain='alchemy' is not a known domain"):
        load_rows(str(p), input_key="q", label_key="a", domain="alchemy")
    with pytest.raises(ValueError, match="go together"):
        load_rows(str(p), input_key="q")


def test_load_source_takes_the_settings_from_the_config(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps({"question": "1+1?", "label": "2"}) + "\n")
    cfg = load_config(None, [f"data.train={p}", "data.input_key=question", "data.label_key=label",
                             "data.domain=math", "data.strict=true"])
    rows = load_source(cfg.data.train, cfg.data)
    assert rows == [{"id": "d-1", "domain": "math", "prompt": "1+1?", "answer": "2"}]
    # builtin sources are never remapped
    assert load_source("builtin:arithmetic?n=3&seed=0&split=eval", cfg.data)[0]["domain"] == "arithmetic"
