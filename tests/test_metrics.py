"""prorl_async/metrics.py: the correctness rule, per-step rollout metrics, pass@1 / pass@k -- worked by hand."""

import numpy as np
import pytest
import torch

from prorl_async.metrics import (Difference, PromptOutcome, answer_prior, domain_metrics, is_correct, mean_of,
                                 paired_difference, pass_at_k, pass_at_k_stderr, prompt_outcomes, rollout_metrics,
                                 utilisation_metrics)


def test_is_correct_is_one_rule_for_floats_arrays_and_tensors():
    assert is_correct(1.0) and is_correct(1.0 - 1e-7)
    assert not is_correct(0.999) and not is_correct(0.5)  # partial credit is not correct
    assert is_correct(np.array([1.0, 0.5, 0.0])).tolist() == [True, False, False]
    assert is_correct(torch.tensor([0.0, 1.0])).tolist() == [False, True]


def test_rollout_metrics_from_window_sums():
    w = {"samples": 8.0, "valid": 6.0, "correct": 3.0, "reward_sum": 4.5, "response_tokens": 80.0, "gen_time_s": 0.5}
    m = rollout_metrics(w, dt=2.0)
    assert m["reward/mean"] == 0.75 and m["reward/accuracy"] == 0.5 and m["reward/invalid"] == 2.0
    assert m["len/generated_mean"] == 10.0 and m["perf/gen_tok_s"] == 40.0 and m["perf/samples_s"] == 4.0
    assert m["perf/gen_engine_tok_s"] == 160.0  # 80 tokens in 0.5 s of engine time (the step took 2 s)
    assert m["perf/step_s"] == 2.0
    empty = rollout_metrics({}, dt=0.0)  # no samples: no means (not a fake 0), no division by zero
    assert not {"reward/mean", "reward/accuracy", "len/generated_mean"} & set(empty)
    assert empty["perf/step_s"] == 1e-9 and empty["perf/gen_engine_tok_s"] == 0.0 and empty["reward/invalid"] == 0.0
    invalid = rollout_metrics({"samples": 3.0, "response_tokens": 6.0}, dt=1.0)  # graded, none valid
    assert "reward/mean" not in invalid and invalid["reward/invalid"] == 3.0 and invalid["len/generated_mean"] == 2.0


def test_domain_metrics():
    w = {"domain_valid/math": 4.0, "domain_correct/math": 1.0, "domain_reward/math": 2.0, "valid": 4.0}
    assert domain_metrics(w) == {"math": {"reward/accuracy": 0.25, "reward/mean": 0.5}}


def test_utilisation_metrics():
    m = utilisation_metrics(10.0, 4.0, [5.0, 10.0], {"grade": 1.0, "sync": 0.5})
    assert m["async/learner_idle_frac"] == pytest.approx(0.6)
    assert m["async/generator_idle_frac"] == pytest.approx(0.25)
    assert m["async/grader_idle_frac"] == pytest.approx(0.9)
    assert m["time/generate_s"] == 15.0 and m["time/sync_s"] == 0.5 and m["time/eval_s"] == 0.0


def test_pass_at_k_overall_and_per_domain():
    samples = [("p1", "math", 1.0, True), ("p1", "math", 0.0, True),   # 1 of 2 right
               ("p2", "math", 1.0, False), ("p2", "math", 0.0, True),  # an invalid sample never counts
               ("p3", "code", 1.0, True), ("p3", "code", 1.0, True)]   # both right
    out = pass_at_k(samples, k=2)
    assert out["val/pass@1"] == pytest.approx((0.5 + 0.0 + 1.0) / 3)
    assert out["val/pass@2"] == pytest.approx(2 / 3)
    assert out["val/pass@1/math"] == 0.25 and out["val/pass@2/math"] == 0.5
    assert out["val/pass@1/code"] == 1.0 and out["val/pass@2/code"] == 1.0
    greedy = pass_at_k([("p1", "math", 1.0, True)], k=None, prefix="val/greedy")
    assert greedy == {"val/greedy/pass@1": 1.0, "val/greedy/pass@1/math": 1.0}


def test_pass_at_k_standard_errors_by_hand():
    samples = [("p1", "math", 1.0, True), ("p1", "math", 0.0, True),   # 1 of 2 right
               ("p2", "math", 1.0, False), ("p2", "math", 0.0, True),  # an invalid sample is drawn, not right
               ("p3", "code", 1.0, True), ("p3", "code", 1.0, True)]
    outcomes = prompt_outcomes(samples)
    assert outcomes == {"p1": PromptOutcome("math", 1, 2), "p2": PromptOutcome("math", 0, 2),
                        "p3": PromptOutcome("code", 2, 2)}
    se = pass_at_k_stderr(outcomes, 2)
    # math: per-prompt pass@1 0.5 and 0 (mean 0.25, sample variance 0.125): sqrt(0.125 / 2) = 0.25;
    # pass@2 1 and 0 (variance 0.5): sqrt(0.5 / 2) = 0.5; all: 0.5, 0, 1 (variance 0.25): sqrt(0.25 / 3)
    assert se["se@1/math"] == pytest.approx(0.25) and se["se@2/math"] == pytest.approx(0.5)
    assert se["se@1"] == pytest.approx((0.25 / 3) ** 0.5) and se["se@2"] == pytest.approx((1 / 3 / 3) ** 0.5)
    assert "se@1/code" not in se  # one prompt has no spread to read
    assert "se@1" in pass_at_k_stderr(outcomes, 1) and "se@1/math" in pass_at_k_stderr(outcomes, 1)
    assert not any(key.startswith("se@2") for key in pass_at_k_stderr(outcomes, 1))


def test_paired_difference_reads_the_per_prompt_differences():
    before = {"a": PromptOutcome("m", 0, 4), "b": PromptOutcome("m", 2, 4), "c": PromptOutcome("m", 4, 4)}
    after = {"a": PromptOutcome("m", 2, 4), "b": PromptOutcome("m", 2, 4), "c": PromptOutcome("m", 4, 4)}
    d = paired_difference(before, after, ["a", "b", "c"])
    # differences 0.5, 0, 0: mean 1/6, sample variance 1/12, standard error sqrt(1/12 / 3) = 1/6
    assert d == pytest.approx(Difference(0.5, 2 / 3, 1 / 6, 1 / 6, 3))
    # unpaired, the two means' errors combined (sqrt(1/12 + 1/36) = 1/3) are twice that: the prompts'
    # own spread (0 .. 1 in both) cancels prompt by prompt
    unpaired = (pass_at_k_stderr(before, 4)["se@1"] ** 2 + pass_at_k_stderr(after, 4)["se@1"] ** 2) ** 0.5
    assert unpaired == pytest.approx(1 / 3) == pytest.approx(2 * d.se)
    k = paired_difference(before, after, ["a", "b", "c"], any_correct=True)
    assert k == pytest.approx(Difference(2 / 3, 1.0, 1 / 3, (1 / 3 / 3) ** 0.5, 3))
    with pytest.raises(ValueError, match="1 of 2 prompts are not in both evaluations.*same --data"):
        paired_difference(before, {"a": after["a"]}, ["a", "b"])
    # the mean of two domains' differences: errors add in quadrature, over the number of domains
    m = mean_of([Difference(0.0, 1.0, 1.0, 0.3, 4), Difference(0.5, 0.5, 0.0, 0.4, 6)])
    assert m == pytest.approx(Difference(0.25, 0.75, 0.5, 0.25, 10))


def test_answer_prior_scores_what_guessing_from_the_other_prompts_answers_passes():
    rows = ([{"domain": "count", "answer": a} for a in ["1", "1", "1", "2"]]
            + [{"domain": "tie", "answer": a} for a in ["1", "1", "2", "2", "1"]]
            + [{"domain": "distinct", "answer": a} for a in ["5", "6", "7"]]
            + [{"domain": "code", "tests": ["assert f() == 1"]}, {"domain": "code", "tests": ["assert g()"]},
               {"domain": "alone", "answer": "3"}])
    out = answer_prior(rows, k=2)
    # each "1" sees two "1"s and one "2" among the others: always answering "1" passes it; the "2" sees only "1"s
    assert out["prior@1/count"] == pytest.approx(3 / 4)
    assert out["prior@2/count"] == pytest.approx(3 * (1 - (1 / 3) ** 2) / 4)
    # a "1" sees two "1"s and two "2"s (a tie: half a pass); a "2" sees three "1"s and one "2"
    assert out["prior@1/tie"] == pytest.approx((3 * 0.5) / 5)
    assert out["prior@2/tie"] == pytest.approx((3 * (1 - 0.5 ** 2) + 2 * (1 - 0.75 ** 2)) / 5)
    # no prompt's own answer counts for it: distinct answers cannot be guessed
    assert out["prior@1/distinct"] == 0.0 and out["prior@2/distinct"] == 0.0
    # rows without an answer, and a domain of one answered row, have no prior; "all" is over the 12 scored
    assert not any(key.endswith(("/code", "/alone")) for key in out)
    assert out["prior@1"] == pytest.approx((3 + 1.5 + 0) / 12)
    assert set(answer_prior(rows, k=1)) == {key for key in out if key.startswith("prior@1")}
