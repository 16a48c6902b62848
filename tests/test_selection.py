"""prorl_async/selection.py: which evaluated policy is kept (train.keep_best), when a run stops
(train.stop_at), and what a resume keeps; the config errors they raise (prorl_async/config.py)."""

from __future__ import annotations

import pytest

from prorl_async.config import ConfigError, load_config
from prorl_async.selection import Best, improves, parse_stop_at, reconcile, require_logged


def test_stop_rule_parses_and_decides():
    rule = parse_stop_at("val/pass@1>=0.9", eval_samples=4)
    assert (rule.metric, rule.op, rule.threshold) == ("val/pass@1", ">=", 0.9)
    assert rule.reached({"val/pass@1": 0.9}) and not rule.reached({"val/pass@1": 0.899})
    below = parse_stop_at("val/pass@4/math < 0.25", eval_samples=4)
    assert below.reached({"val/pass@4/math": 0.2}) and not below.reached({"val/pass@4/math": 0.25})
    assert parse_stop_at("", 4) is None
    assert "val/pass@1 0.950 >= 0.9 at step 40" in rule.reason({"val/pass@1": 0.95}, 40)


@pytest.mark.parametrize("text, says", [("val/pass@1=0.9", "METRIC OP NUMBER"), ("val/pass@1>=high", "METRIC OP NUMBER"),
                                        ("val/pass@3>=0.5", "val/pass@1 or val/pass@4"),
                                        ("val/greedy/pass@1>=0.5", "only before and after"),
                                        ("reward/mean>=0.5", "not a metric the periodic evaluation logs")])
def test_bad_stop_rules_name_the_form(text, says):
    with pytest.raises(ValueError, match=says):
        parse_stop_at(text, eval_samples=4)


def test_best_improves_strictly_in_its_mode():
    b = Best("val/pass@1", "max", 10, 0.5)
    assert improves(None, "val/pass@1", "max", 0.0)
    assert improves(b, "val/pass@1", "max", 0.51) and not improves(b, "val/pass@1", "max", 0.5)  # a tie keeps step 10
    assert not improves(b, "val/pass@1", "max", 0.4)
    low = Best("val/pass@1", "min", 10, 0.5)
    assert improves(low, "val/pass@1", "min", 0.4) and not improves(low, "val/pass@1", "min", 0.6)
    assert improves(b, "val/pass@4", "max", 0.1)  # another metric starts afresh
    assert Best.from_dict(b.to_dict()) == b and Best.from_dict({}) is None


def test_a_resume_keeps_the_better_of_the_checkpoint_and_best_folder():
    saved, later = Best("val/pass@1", "max", 20, 0.6), Best("val/pass@1", "max", 40, 0.7)
    assert reconcile(saved, later, "val/pass@1", "max") == later  # best/ written after the checkpoint
    assert reconcile(saved, None, "val/pass@1", "max") == saved
    assert reconcile(later, saved, "val/pass@1", "max") == later
    assert reconcile(saved, later, "val/pass@1", "min") is None  # another mode: no best yet
    assert reconcile(saved, Best("val/pass@4", "max", 40, 0.9), "val/pass@1", "max") == saved


def test_require_logged_names_the_key_and_what_is_logged():
    val = {"val/pass@1": 0.5, "val/pass@1/arithmetic": 0.5}
    require_logged("val/pass@1/arithmetic", val, "train.keep_best")
    with pytest.raises(ValueError, match=r"train.keep_best: .*'val/pass@1/math'.* it logs val/pass@1, val/pass@1/arithmetic"):
        require_logged("val/pass@1/math", val, "train.keep_best")


@pytest.mark.parametrize("override, says", [
    ("train.keep_best=val/pass@8", "train.keep_best: 'val/pass@8' is not a metric the periodic evaluation logs; use val/pass@1 or val/pass@4"),
    ("train.keep_best=val/acc", "train.keep_best: 'val/acc' is not a metric"),
    ("train.keep_best_mode=highest", "train.keep_best_mode: must be max or min, got 'highest'"),
    ("train.stop_at=val/pass@1>0.9x", "train.stop_at: "),
    ("train.eval_temperature=-1", "train.eval_temperature: must be >= 0"),
])
def test_config_errors_name_the_key_and_the_fix(override, says):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert str(err.value).startswith(says)


def test_stop_at_needs_periodic_evaluations():
    with pytest.raises(ConfigError, match="train.stop_at: .*set train.eval_interval > 0"):
        load_config(None, ["train.stop_at=val/pass@1>=0.9", "train.eval_interval=0"])
    cfg = load_config(None, ["train.stop_at=val/pass@1>=0.9", "train.keep_best=val/pass@1/arithmetic", "train.eval_samples=8",
                             "train.keep_best=val/pass@8"])
    assert cfg.train.stop_at == "val/pass@1>=0.9" and cfg.train.keep_best == "val/pass@8"
