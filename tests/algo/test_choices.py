"""``prorl_async.algo.choices``: the names a config chooses among, the same as the math implements,
and the processes that only read a config or count groups load no torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from prorl_async.algo import choices

ROOT = Path(__file__).resolve().parents[2]


def test_the_choices_are_the_implementations_names():
    from prorl_async.algo import ADVANTAGE_ESTIMATORS, IS_MODES, KL_KINDS, OVERLONG_MODES, losses, shaping

    assert tuple(ADVANTAGE_ESTIMATORS) == choices.ADVANTAGE_NAMES
    assert IS_MODES is choices.IS_MODES is losses.IS_MODES and KL_KINDS is choices.KL_KINDS
    assert OVERLONG_MODES is choices.OVERLONG_MODES is shaping.OVERLONG_MODES


def test_config_grader_and_buffer_modules_load_without_torch():
    """The grader and the replay buffer actors import these (the config arrives pickled): torch
    would cost each ~5 s of CPU at a run's start on 2 cores and ~200 MB resident. The learner's
    math still loads on first use through the package."""
    code = ("import sys\n"
            "import prorl_async.config, actors.grader, actors.replay_buffer, prorl_async.buffer\n"
            "from prorl_async.algo import DynamicSamplingCollector\n"
            "from prorl_async.config import load_config\n"
            "load_config(None, ['algo.advantage=rloo'])\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n"
            "from prorl_async.algo import policy_loss\n"
            "assert 'torch' in sys.modules and callable(policy_loss)\n"
            "print('ok')\n")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-3000:]


def test_an_unknown_name_is_an_attribute_error():
    import prorl_async.algo as algo

    try:
        algo.no_such_estimator  # noqa: B018
    except AttributeError as e:
        assert "no_such_estimator" in str(e)
    else:
        raise AssertionError("no AttributeError")
