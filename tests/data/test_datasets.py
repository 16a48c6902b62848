"""Dataset loading and validation (JSONL, Parquet, built-in sources) and domain mixing."""

import json
import warnings

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from prorl_async.data import builtin
from prorl_async.data.datasets import load_rows, mix, parse_builtin
from prorl_async.rewards import grade

GOOD = [
    {"id": "m1", "domain": "math", "prompt": "1/2+1/2?", "answer": "1"},
    {"id": "c1", "domain": "code", "prompt": [{"role": "user", "content": "add"}],
     "tests": [{"input": "1 2\n", "output": "3\n"}, {"fn_name": "f", "args": [1], "expected": 2}]},
    {"id": "i1", "domain": "instruction", "prompt": "write", "constraints": [{"type": "no_commas", "kwargs": {}}]},
    {"id": "s1", "domain": "stem", "prompt": "?", "answer": "B", "choices": ["x", "y"], "meta": {"src": "t"}},
    {"id": "l1", "domain": "logic", "prompt": "?", "answer": 7},
    {"id": "a1", "domain": "arithmetic", "prompt": "1+1=", "answer": "2"},
]

BAD = [  # (row, words the reason must contain)
    ({"domain": "math", "prompt": "?", "answer": "1"}, "missing id"),
    ({"id": "x1", "domain": "alchemy", "prompt": "?", "answer": "1"}, "unknown domain"),
    ({"id": "x2", "domain": "math", "answer": "1"}, "missing prompt"),
    ({"id": "x3", "domain": "math", "prompt": [{"role": "user"}], "answer": "1"}, "prompt messages"),
    ({"id": "x4", "domain": "math", "prompt": "?"}, "needs a non-empty answer"),
    ({"id": "x5", "domain": "code", "prompt": "?", "tests": []}, "bad tests"),
    ({"id": "x6", "domain": "instruction", "prompt": "?", "constraints": [{"type": "rhyme"}]},
     "unknown constraint type 'rhyme'"),
    ({"id": "m1", "domain": "math", "prompt": "dup", "answer": "1"}, "duplicate id 'm1'"),
    ({"id": "x7", "domain": "math", "prompt": "?", "answer": "1", "meta": [1]}, "meta must be an object"),
]


def write_jsonl(path, rows, raw_lines=()):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
        for line in raw_lines:
            f.write(line + "\n")


def test_jsonl_good_rows_load(tmp_path):
    p = tmp_path / "d.jsonl"
    write_jsonl(p, GOOD)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rows = load_rows(str(p))
    assert [r["id"] for r in rows] == [r["id"] for r in GOOD]
    assert rows[1]["prompt"][0]["role"] == "user"


def test_bad_rows_are_skipped_with_line_numbers_and_count(tmp_path):
    p = tmp_path / "d.jsonl"
    write_jsonl(p, GOOD + [r for r, _ in BAD], raw_lines=["{not json"])
    with pytest.warns(UserWarning) as rec:
        rows = load_rows(str(p))
    assert len(rows) == len(GOOD)
    msg = str(rec[0].message)
    assert f"skipped {len(BAD) + 1} bad row(s) of {len(GOOD) + len(BAD) + 1}" in msg
    for k, (_, reason) in enumerate(BAD):
        assert f"line {len(GOOD) + k + 1}: " in msg and reason in msg
    assert f"line {len(GOOD) + len(BAD) + 1}: invalid JSON" in msg


@pytest.mark.parametrize("k", range(len(BAD)))
def test_strict_aborts_naming_file_line_and_reason(tmp_path, k):
    p = tmp_path / "d.jsonl"
    # GOOD[0] has id m1, so the duplicate-id case is a duplicate on line 3 too
    write_jsonl(p, GOOD[:1] + [{"id": "pad", "domain": "math", "prompt": "?", "answer": "2"}] + [BAD[k][0]])
    with pytest.raises(ValueError) as e:
        load_rows(str(p), strict=True)
    assert str(p) in str(e.value) and "line 3" in str(e.value) and BAD[k][1] in str(e.value)


def test_blank_lines_are_ignored_and_numbering_is_by_physical_line(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps(GOOD[0]) + "\n\n" + json.dumps({"id": "z"}) + "\n")
    with pytest.raises(ValueError, match="line 3"):
        load_rows(str(p), strict=True)


def test_parquet_roundtrip_with_nested_columns(tmp_path):
    p = tmp_path / "d.parquet"
    # one Arrow type per column (string prompts, string answers) and every key in every row
    rows = [{**r, "prompt": "add"} if r["domain"] == "code" else dict(r) for r in GOOD if r["domain"] != "logic"]
    rows[2]["constraints"] = [{"type": "bullet_count", "kwargs": {"num": 2}}, {"type": "no_commas"}]
    keys = sorted({k for r in rows for k in r})
    pq.write_table(pa.Table.from_pylist([{k: r.get(k) for k in keys} for r in rows]), p)
    loaded = load_rows(str(p))
    assert [r["id"] for r in loaded] == [r["id"] for r in rows]
    code = next(r for r in loaded if r["domain"] == "code")
    assert code["tests"] == GOOD[1]["tests"]  # the nulls Parquet adds are gone
    instr = next(r for r in loaded if r["domain"] == "instruction")
    assert grade(instr, "* a\n* b").reward == 1.0 and grade(instr, "* a\n* b, c").reward == 0.5
    g = grade(code, "def f(x):\n    return x + 1\nif __name__ == '__main__':\n    print(sum(map(int, input().split())))\n")
    assert g.reward == 1.0


def test_parquet_bad_row_reports_row_number(tmp_path):
    p = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist([{"id": "a", "domain": "math", "prompt": "?", "answer": "1"},
                                         {"id": "b", "domain": "math", "prompt": "?", "answer": None}]), p)
    with pytest.raises(ValueError, match=r"row 2: domain math needs a non-empty answer"):
        load_rows(str(p), strict=True)


def test_json_string_columns_are_decoded(tmp_path):
    p = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist([{"id": "c", "domain": "code", "prompt": "?",
                                          "tests": json.dumps([{"input": "", "output": "1\n"}])}]), p)
    assert load_rows(str(p))[0]["tests"] == [{"input": "", "output": "1\n"}]


def test_missing_file_and_unknown_format(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_rows(str(tmp_path / "nope.jsonl"))
    (tmp_path / "d.csv").write_text("id\n")
    with pytest.raises(ValueError, match="unknown dataset format"):
        load_rows(str(tmp_path / "d.csv"))


def test_parse_builtin():
    assert parse_builtin("builtin:multidomain?n=5&seed=3&split=eval") == ("multidomain", 5, 3, "eval")
    assert parse_builtin("builtin:math") == ("math", 1000, 0, "train")
    for bad in ["builtin:math?n=x", "builtin:math?split=test", "builtin:math?count=3"]:
        with pytest.raises(ValueError):
            parse_builtin(bad)


def test_builtin_multidomain_is_deterministic_and_covers_all_domains():
    a = load_rows("builtin:multidomain?n=50&seed=1&split=train")
    b = load_rows("builtin:multidomain?n=50&seed=1&split=train")
    c = load_rows("builtin:multidomain?n=50&seed=2&split=train")
    assert a == b and a != c and len(a) == 50
    assert {r["domain"] for r in a} == {"math", "code", "stem", "logic", "instruction"}
    assert len({r["id"] for r in a}) == 50


def test_builtin_train_and_eval_are_disjoint():
    train = load_rows("builtin:multidomain?n=600&seed=0&split=train")
    evals = load_rows("builtin:multidomain?n=250&seed=9&split=eval")
    assert {r["prompt"] for r in train}.isdisjoint({r["prompt"] for r in evals})
    assert all(builtin.split_of(r["prompt"]) == "eval" for r in evals)


def test_builtin_unknown_name():
    with pytest.raises(ValueError, match="unknown built-in task"):
        load_rows("builtin:poetry?n=3")


def test_builtin_arithmetic_dispatch():
    from prorl_async.data import arithmetic

    rows = load_rows("builtin:arithmetic?n=20&seed=4&split=eval")
    assert rows == arithmetic.generate(20, 4, "eval")
    assert all(grade(r, r["answer"]).reward == 1.0 for r in rows)


@pytest.mark.parametrize("domain", ["math", "stem", "logic"])
def test_builtin_gold_answers_grade_correct(domain):
    for r in load_rows(f"builtin:{domain}?n=40&seed=5&split=eval"):
        g = grade(r, f"Reasoning.\n\\boxed{{{r['answer']}}}")
        assert (g.reward, g.valid) == (1.0, True), (r, g)


REFERENCE = {  # reference programs for the built-in code templates, keyed by meta["task"]
    "filtered_sum": lambda m: f"input()\nprint(sum(x for x in map(int, input().split()) if x % {m['k']} == 0))\n",
    "reverse_words": lambda m: f"print({m['sep']!r}.join(input().split()[::-1]))\n",
    "vowels": lambda m: f"for _ in range(int(input())):\n    print(sum(c in {m['letters']!r} for c in input()))\n",
    "max_subarray": lambda m: "input()\nxs = list(map(int, input().split()))\nb = c = xs[0]\n"
                              "for x in xs[1:]:\n    c = max(x, c + x)\n    b = max(b, c)\nprint(b)\n",
    "fizzbuzz": lambda m: f"for i in range(1, int(input()) + 1):\n"
                          f"    s = ({m['wa']!r} if i % {m['a']} == 0 else '') + ({m['wb']!r} if i % {m['b']} == 0 else '')\n"
                          "    print(s or i)\n",
    "rotate": lambda m: ("def rotate(nums, k):\n    if not nums:\n        return []\n    k %= len(nums)\n"
                         + ("    return nums[k:] + nums[:k]\n" if m["direction"] == "left"
                            else "    return nums[len(nums) - k:] + nums[:len(nums) - k]\n")),
}


def test_builtin_code_tasks_are_solvable():
    rows = load_rows("builtin:code?n=12&seed=2&split=train")
    assert {r["meta"]["task"] for r in rows} <= set(REFERENCE)
    for r in rows:
        g = grade(r, "```python\n" + REFERENCE[r["meta"]["task"]](r["meta"]) + "```")
        assert (g.reward, g.reason) == (1.0, "passed"), (r, g)
    assert grade(rows[0], "print('nope')").reward < 1.0


def test_builtin_instruction_rows_use_known_constraints_and_grade():
    rows = load_rows("builtin:instruction?n=30&seed=1&split=train")
    for r in rows:
        g = grade(r, "some text")
        assert g.valid and 0.0 <= g.reward <= 1.0
        assert len(r["constraints"]) >= 2


def test_mix_weights_counts_and_determinism():
    sources = {d: load_rows(f"builtin:{d}?n=30&seed=0") for d in ("math", "code", "logic")}
    a = mix(sources, {"math": 2, "code": 1, "logic": 1}, n=100, seed=3)
    assert a == mix(sources, {"math": 2, "code": 1, "logic": 1}, n=100, seed=3)
    assert a != mix(sources, {"math": 2, "code": 1, "logic": 1}, n=100, seed=4)
    counts = {d: sum(r["domain"] == d for r in a) for d in sources}
    assert counts == {"math": 50, "code": 25, "logic": 25}
    assert len({r["id"] for r in a}) == 100  # repeats of a 30-row source get fresh ids
    assert any(r["id"].endswith("~1") for r in a if r["domain"] == "math")


def test_mix_rounding_and_zero_weights():
    sources = {"x": [{"id": f"x{i}", "domain": "math"} for i in range(10)],
               "y": [{"id": f"y{i}", "domain": "math"} for i in range(10)]}
    out = mix(sources, {"x": 1, "y": 2}, n=10, seed=0)
    assert sum(r["id"].startswith("x") for r in out) == 3  # 3.33 -> 3, 6.67 -> 7
    only_x = mix(sources, {"x": 1, "y": 0}, n=5, seed=0)
    assert all(r["id"].startswith("x") for r in only_x)


def test_mix_errors():
    with pytest.raises(ValueError, match="unknown source"):
        mix({"a": [{"id": "1"}]}, {"b": 1.0}, n=1, seed=0)
    with pytest.raises(ValueError, match="positive"):
        mix({"a": [{"id": "1"}]}, {"a": 0.0}, n=1, seed=0)
    with pytest.raises(ValueError, match="empty"):
        mix({"a": []}, {"a": 1.0}, n=1, seed=0)
