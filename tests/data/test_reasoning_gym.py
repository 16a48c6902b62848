"""Reasoning Gym sources: parsing, splits, shots, options, and the task's own scorer as the verifier."""

from __future__ import annotations

from collections import Counter

import pytest

pytest.importorskip("reasoning_gym")

from prorl_async.data import reasoning_gym as rg  # noqa: E402
from prorl_async.data.datasets import load_rows  # noqa: E402
from prorl_async.metrics import answer_prior  # noqa: E402
from prorl_async.rewards import grade  # noqa: E402
from prorl_async.rewards.pool import GraderPool  # noqa: E402

EASY_SUM = "reasoning-gym:chain_sum?n=12&seed=3&min_terms=2&max_terms=2&min_digits=1&max_digits=1"


def test_rows_carry_what_the_scorer_needs_and_the_gold_answer_scores_one():
    rows = load_rows("reasoning-gym:spell_backward+chain_sum?n=6&seed=3")
    assert [r["domain"] for r in rows] == ["rg:spell_backward"] * 6 + ["rg:chain_sum"] * 6
    for r in rows:
        assert r["meta"]["task"] in ("spell_backward", "chain_sum") and r["meta"]["entry"]["answer"] == r["answer"]
        assert r["prompt"][-1] == {"role": "user", "content": r["meta"]["entry"]["question"]}
        assert grade(r, f"Let me think. <answer>{r['answer']}</answer>").reward == 1.0
        wrong = grade(r, "<answer>not it</answer>")
        assert wrong.valid and wrong.reward < 1.0 and wrong.reason in ("wrong", "partial")
    assert len({r["id"] for r in rows}) == 12


def test_options_pass_through_to_the_task_config():
    rows = load_rows(EASY_SUM + "&level=easy")
    assert {r["domain"] for r in rows} == {"rg:chain_sum@easy"}
    for r in rows:  # two one-digit terms: "a + b" with a, b < 10
        terms = [int(t) for t in r["meta"]["entry"]["question"].split("=")[0].replace("?", "").split() if t.isdigit()]
        assert len(terms) == 2 and all(0 <= t <= 9 for t in terms), r["meta"]["entry"]["question"]
    both = load_rows("reasoning-gym:chain_sum+gcd?n=3&chain_sum.max_terms=2&max_value=9")
    assert all(int(r["answer"]) <= 9 for r in both if r["domain"] == "rg:gcd")  # a bare option: every task having it


def test_train_eval_and_demo_splits_never_share_a_question():
    train = load_rows("reasoning-gym:gcd?n=150&seed=1&max_value=20")
    evals = load_rows("reasoning-gym:gcd?n=40&seed=1&split=eval&max_value=20&shots=3")
    q = lambda r: r["meta"]["entry"]["question"]  # noqa: E731
    assert not {q(r) for r in train} & {q(r) for r in evals}
    demos = {m["content"] for m in evals[0]["prompt"][1:-1:2]}
    assert len(demos) == 3 and not demos & {q(r) for r in train + evals}
    assert all(rg.split_of(d) == "demo" for d in demos)
    # the shots are the same for every prompt, and for the train source of the same settings
    assert all(r["prompt"][:-1] == evals[0]["prompt"][:-1] for r in evals)
    assert load_rows("reasoning-gym:gcd?n=2&seed=9&max_value=20&shots=3")[0]["prompt"][:-1] == evals[0]["prompt"][:-1]


def test_two_shots_are_found_where_the_first_100_items_hold_one_demo():
    # the demo split is 5 %: of the first 100 items of these options only one is a demo, which the scan
    # used to give up on (2 shots x 50 tries); rows and shots now come from further down the same index
    opts = {"min_terms": 4, "max_terms": 4, "min_digits": 1, "max_digits": 2}
    first = rg._dataset("chain_sum", opts, rg.DEMO_SEED, 100)
    assert sum(rg.split_of(first[i]["question"]) == "demo" for i in range(100)) == 1
    rows = load_rows("reasoning-gym:chain_sum?n=3&seed=2&split=eval&shots=2&worked=true"
                     "&min_terms=4&max_terms=4&min_digits=1&max_digits=2")
    demos = [m["content"] for m in rows[0]["prompt"][1:-1:2]]
    assert len(rows) == 3 and len(demos) == 2 and all(rg.split_of(d) == "demo" for d in demos)


def test_rows_are_deterministic_in_the_seed():
    a, b = load_rows(EASY_SUM), load_rows(EASY_SUM)
    c = load_rows(EASY_SUM.replace("seed=3", "seed=4"))
    assert a == b and [r["answer"] for r in a] != [r["answer"] for r in c]


@pytest.mark.parametrize("source, words", [
    ("reasoning-gym:chain_sums?n=5", ["unknown Reasoning Gym task", "'chain_sums'", "chain_sum", "spell_backward"]),
    ("reasoning-gym:chain_sum?n=5&min_term=2", ["unknown option 'min_term'", "min_terms", "max_digits"]),
    ("reasoning-gym:chain_sum?n=5&gcd.max_value=3", ["names task 'gcd'"]),
    ("reasoning-gym:chain_sum?n=x", ["integers"]),
    ("reasoning-gym:gcd?n=4&max_value=6 reasoning-gym:lcm?n=4&max_value=10", ["two sources run together", "';'"]),
    ("reasoning-gym:chain_sum?answer=boxed", ["answer must be tags or stated"]),
    ("reasoning-gym:chain_sum?split=test", ["split must be train or eval"]),
    ("reasoning-gym:chain_sum+syllogism?shots=2&worked=true", ["worked=true", "'syllogism'", "chain_sum", "spell_backward"]),
    ("reasoning-gym:chain_sum?worked=true", ["worked=true", "set shots"]),
    ("reasoning-gym:chain_sum?shots=2&worked=maybe", ["worked must be true or false"]),
    ("reasoning-gym:chain_sum?max_share=0", ["max_share must be a number in (0, 1]"]),
    ("reasoning-gym:aiw?n=40&max_entities=3&max_share=0.2", ["8 rows per answer", "3 distinct answers", "higher max_share"]),
])
def test_a_bad_source_is_one_error_naming_what_is_valid(source, words):
    with pytest.raises(ValueError) as err:
        load_rows(source)
    msg = str(err.value)
    assert "\n" not in msg and all(w in msg for w in words), msg


def test_max_share_caps_the_rows_of_any_one_answer():
    """At three to five words a letter's count is mostly 1: always answering 1 passes most rows
    (prior@1); with ``max_share=0.25`` no answer has more than 10 of 40 rows, taken in index order
    from the same split, and always answering one value passes at most a quarter."""
    source = "reasoning-gym:letter_counting?n=40&seed=1&min_words=3&max_words=5"
    plain, capped = load_rows(source), load_rows(source + "&max_share=0.25")
    count = lambda rows: Counter(r["answer"] for r in rows)  # noqa: E731
    assert count(plain).most_common(1)[0][1] > 10 and max(count(capped).values()) <= 10 and len(capped) == 40
    index = [int(r["id"].rsplit(":", 1)[1]) for r in capped]
    assert index == sorted(index) and all(rg.split_of(r["meta"]["entry"]["question"]) == "train" for r in capped)
    assert {r["id"] for r in plain if count(plain)[r["answer"]] <= 10} <= {r["id"] for r in capped}
    assert answer_prior(plain, 16)["prior@1"] > 0.5 >= 0.25 >= answer_prior(capped, 16)["prior@1"]
    assert load_rows(source + "&max_share=0.25") == capped and load_rows(source + "&max_share=1") == plain


def test_the_stated_answer_format():
    row = load_rows(EASY_SUM + "&answer=stated&shots=1")[0]
    gold = row["answer"]
    assert row["prompt"][2] == {"role": "assistant", "content": f"The answer is {row['prompt'][2]['content'][14:-1]}."}
    assert grade(row, f"We add them. The answer is {gold}.").reason == "correct"
    assert grade(row, f"{gold}").reason == "correct"  # a bare short answer
    assert grade(row, f"1 + 2 = 3, so the answer is **{gold}**").reason == "correct"
    assert grade(row, f"The answer is {gold}. No wait, the answer is {int(gold) + 1}.").reason == "wrong"
    assert grade(row, "We need to add the two numbers together and then\nreport it").reason == "no_answer"


# every task a worked solution exists for, at the settings of the ProRL-in-miniature configs' levels
WORKED_SETTINGS = [
    ("chain_sum", dict(min_terms=3, max_terms=4, min_digits=1, max_digits=2)),
    ("products", dict(min_digits=1, max_digits=3)),
    ("gcd", dict(max_value=100)),
    ("leg_counting", dict(min_animals=1, max_animals=3, max_instances=6)),
    ("letter_counting", dict(min_words=3, max_words=10)),
    ("spell_backward", dict(min_word_len=3, max_word_len=6)),
    ("aiw", dict(max_entities=6)),  # configs/prorl_smollm2_wide_cpu.yaml's logic task (its hard level)
]


@pytest.mark.parametrize("task, options", WORKED_SETTINGS, ids=[t for t, _ in WORKED_SETTINGS])
def test_worked_solutions_end_on_the_gold_answer(task, options):
    """The writer's steps reach Reasoning Gym's own answer on 200 generated items (worked_steps
    raises otherwise), and a changed gold answer is caught."""
    import reasoning_gym

    from prorl_async.data.worked import WRITERS, worked_steps

    assert task in WRITERS
    items = reasoning_gym.create_dataset(task, seed=11, size=200, **options)
    steps = [worked_steps(task, rg._entry(item)) for item in items]
    assert all(s and s.endswith(".") for s in steps)
    item = rg._entry(items[0])
    with pytest.raises(ValueError, match="gold answer"):
        worked_steps(task, {**item, "answer": item["answer"] + "1"})


def test_worked_shots_show_the_steps_then_the_same_final_line():
    plain = load_rows(EASY_SUM + "&answer=stated&shots=2")
    worked = load_rows(EASY_SUM + "&answer=stated&shots=2&worked=true")
    assert [r["prompt"][-1] for r in worked] == [r["prompt"][-1] for r in plain]  # the questions are the same
    for p_msg, w_msg in zip(plain[0]["prompt"], worked[0]["prompt"]):
        if p_msg["role"] != "assistant":
            assert w_msg == p_msg
            continue
        a, b = p_msg["content"].removesuffix(".").split()[-1], w_msg["content"]  # "The answer is 7." -> 7
        x, op, y = b.split(" = ")[0].split()
        assert b == f"{x} {op} {y} = {a}. The answer is {a}." and p_msg["content"] == f"The answer is {a}."
    assert grade(worked[0], f"1 + 2 = 3. The answer is {worked[0]['answer']}.").reason == "correct"


def test_no_answer_is_apart_from_wrong_and_a_malformed_row_is_invalid():
    row = load_rows(EASY_SUM)[0]
    assert grade(row, "I think it is 5").reason == "no_answer"
    assert grade(row, "I think it is 5").valid
    assert grade(row, "<answer>-1000</answer>").reason == "wrong"
    bad = {**row, "meta": {"answer_format": "tags"}}
    g = grade(bad, f"<answer>{row['answer']}</answer>")
    assert not g.valid and g.reason.startswith("malformed_row")


def test_partial_credit_is_a_continuous_reward():
    row = load_rows("reasoning-gym:spell_backward?n=1&seed=2&min_word_len=6&max_word_len=6")[0]
    g = grade(row, f"<answer>{row['answer']}xx</answer>")  # the default scorer's partial credit
    assert g.valid and 0 < g.reward < 1 and g.reason == "partial"


def test_a_fresh_workers_first_sample_does_not_pay_the_import_in_its_time_limit():
    """Reasoning Gym's import takes 2-3 s (more on a busy CPU), above this pool's 1 s limit: a fresh
    worker pays it untimed, so the first samples of a run, or of a resumed one, are graded, not timed out."""
    rows = load_rows(EASY_SUM)[:4]
    with GraderPool(num_workers=1, timeout_s=1.0) as pool:
        grades = pool.grade_many(rows, [f"<answer>{r['answer']}</answer>" for r in rows])
        assert [(g.reason, g.valid) for g in grades] == [("correct", True)] * 4
        assert pool.metrics()["grader/timeouts"] == 0


def test_the_scorer_runs_in_the_grader_pool():
    rows = load_rows(EASY_SUM)[:4]
    with GraderPool(num_workers=1, timeout_s=20.0) as pool:
        grades = pool.grade_many(rows, [f"<answer>{r['answer']}</answer>" for r in rows[:2]] + ["<answer>x</answer>"] * 2)
    assert [g.reward for g in grades] == [1.0, 1.0, 0.0, 0.0] and all(g.valid for g in grades)
