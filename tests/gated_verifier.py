"""A verifier whose task becomes learnable while a run goes on, registered through ``reward.extra_modules``.

Family ``gated`` (row domains ``gated:NAME``, graded by this family through
:func:`prorl_async.rewards.verifier_domain`): a row's ``meta.gate`` names a file; while that file
does not exist every response is wrong (reward 0.0, valid), once it exists the row is graded as
``arithmetic``. A test creates the file mid-run to raise a held pool's pass rate from zero.
"""

import os

from prorl_async.rewards import register
from prorl_async.rewards.arithmetic import verify as arithmetic
from prorl_async.rewards.base import Grade


def gated(row, response):
    domain = row.get("domain", "gated")
    if not os.path.exists((row.get("meta") or {}).get("gate", "")):
        return Grade(0.0, True, "wrong", domain)
    g = arithmetic(row, response)
    return Grade(g.reward, g.valid, g.reason, domain)


register("gated", gated)
