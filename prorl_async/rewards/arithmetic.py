"""Verifier of the built-in ``arithmetic`` task (``"12+34="`` -> ``"46"``).

The response is the raw completion after the ``=``. Reward 1.0 iff, after leading whitespace,
the response starts with an integer (``-?\\d+``) equal to ``int(row["answer"])``; whatever
follows the integer is ignored (small models keep generating). A response that does not start
with an integer is wrong, not invalid. Costs a few microseconds.
"""

from __future__ import annotations

import re

from prorl_async.rewards.base import Grade, invalid

_LEADING_INT = re.compile(r"-?\d+")


def verify(row: dict, response: str) -> Grade:
    try:
        gold = int(row["answer"])
    except (KeyError, TypeError, ValueError):
        return invalid("arithmetic", "malformed_row:answer is not an integer")
    match = _LEADING_INT.match(response.lstrip())
    if match is None:
        return Grade(0.0, True, "no_answer", "arithmetic")
    if int(match.group()) == gold:
        return Grade(1.0, True, "correct", "arithmetic")
    return Grade(0.0, True, "wrong", "arithmetic")
