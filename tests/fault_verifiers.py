"""Verifiers that fail on purpose, registered through ``reward.extra_modules``.

Domain ``flaky`` grades like ``arithmetic`` except: a prompt whose first operand ends in 3
makes the verifier raise, one ending in 7 makes it sleep forever (the pool must kill it at
``reward.timeout_s``), one ending in 5 returns a NaN reward. Used to show that grader failures mark samples invalid and the run
goes on.
"""

import time

from prorl_async.rewards import VERIFIERS, register


def flaky(row, response):
    first = row["prompt"].split("+")[0].split("-")[0]
    if first.endswith("3"):
        raise RuntimeError("verifier crashed on purpose")
    if first.endswith("7"):
        time.sleep(3600)
    g = VERIFIERS["arithmetic"](row, response)
    return type(g)(reward=g.reward, valid=g.valid, reason=g.reason, domain="flaky")


register("flaky", flaky)


def nan_on_5(row, response):
    """Like ``flaky`` but a first operand ending in 5 returns a NaN reward."""
    first = row["prompt"].split("+")[0].split("-")[0]
    if first.endswith("5"):
        return type(VERIFIERS["arithmetic"](row, response))(reward=float("nan"), valid=True, reason="nan", domain="flaky")
    return flaky(row, response)


register("flaky", nan_on_5)
