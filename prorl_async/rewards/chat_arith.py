r"""Verifier of the built-in ``chat-arith`` task (:mod:`prorl_async.data.chat_arith`).

The answer of a response is the integer it *states as a result*: the number right after the
last ``=``, ``is`` or ``equals`` in the response (``"7 + 5 = 12."``, ``"The answer is 12"``,
``"the sum of 7 and 5 is 12"``), optionally wrapped in ``**`` / ``$``; or the whole response
when it is just an integer (``"12"``, what the prompt asks for). Reward 1.0 iff that
integer equals the gold answer. A response that states no result (``"To solve this, we add
7 and 5."``, or one cut off before its result) has no answer and gets 0 — the number merely
appearing somewhere (the operands, a step) earns nothing, and a later wrong statement
overrides an earlier right one. Decimals (``"12.5"``) are not integers and are wrong.
"""

from __future__ import annotations

import re

from prorl_async.rewards.base import Grade, invalid

_BARE = re.compile(r"\s*[*$]*\s*(-?\d+)\s*[*$]*\s*\.?\s*")
_STATED = re.compile(r"(?:=|\bis\b|\bequals\b)\s*[*$]*\s*(-?\d+(?:\.\d+)?)(?![\d])", re.IGNORECASE)


def extract_answer(response: str) -> str | None:
    """The last integer stated as a result (see the module doc), as text, or None."""
    bare = _BARE.fullmatch(response)
    if bare:
        return bare.group(1)
    matches = _STATED.findall(response)
    return matches[-1] if matches else None


def verify(row: dict, response: str) -> Grade:
    try:
        gold = int(row["answer"])
    except (KeyError, TypeError, ValueError):
        return invalid("chat-arith", "malformed_row:answer is not an integer")
    stated = extract_answer(response)
    if stated is None:
        return Grade(0.0, True, "no_answer", "chat-arith")
    if "." not in stated and int(stated) == gold:
        return Grade(1.0, True, "correct", "chat-arith")
    return Grade(0.0, True, "wrong", "chat-arith")
