"""Verifiers that fail on purpose, registered through ``reward.extra_modules``.

Domain ``flaky`` grades like ``arithmetic`` except on the last digit of the prompt's first
operand: 3 makes the verifier raise, 5 returns a NaN reward, 7 sleeps forever (the pool must
kill it at ``reward.timeout_s``). Used to show that grader failures mark samples invalid, are
counted under their reason in ``grader/*`` metrics, and that the run goes on.
"""

import time

from prorl_async.rewards import VERIFIERS, register


def fault_of(row) -> str:
    """What ``flaky`` does with this row: ``error``, ``non_finite``, ``timeout`` or ``ok``."""
    last = row["prompt"].split("+")[0].split("-")[0][-1]
    return {"3": "error", "5": "non_finite", "7": "timeout"}.get(last, "ok")


def flaky(row, response):
    fault = fault_of(row)
    if fault == "error":
        raise RuntimeError("verifier crashed on purpose")
    if fault == "timeout":
        time.sleep(3600)
    g = VERIFIERS["arithmetic"](row, response)
    reward = float("nan") if fault == "non_finite" else g.reward
    return type(g)(reward=reward, valid=g.valid, reason=g.reason, domain="flaky")


register("flaky", flaky)
