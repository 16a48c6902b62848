"""The grade record every verifier returns, and small helpers shared by the verifiers.

ProRL v2 (and DeepSeek-R1 / DAPO before it) trains on *verifiable* rewards: a program, not a
model, decides whether a response is right. Following the lesson from verl's
PrimeRewardManager (a grader timeout scored as 0.0 looks like a wrong answer), a verifier
distinguishes three outcomes:

* ``Grade(reward=1.0, valid=True, ...)``: the response is right (or a fraction of it is);
* ``Grade(reward=0.0, valid=True, ...)``: the response is wrong, including a response with no
  parseable answer at all (a format failure is the policy's fault);
* ``Grade(valid=False, ...)``: the verifier itself could not decide (timeout, crash, malformed
  row, non-finite reward). The learner masks such samples out and counts them.

``reason`` is a short, low-cardinality code (``"correct"``, ``"wrong"``, ``"no_answer"``,
``"timeout"``, ``"error:KeyError"``, ``"malformed_row:missing answer"``...) so that it can be
used as a metric key.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Grade:
    """The verdict of one verifier on one response."""

    reward: float  # in [0, 1] for the built-in verifiers; 0.0 when not valid
    valid: bool  # False when the verifier could not decide; the sample must be masked out
    reason: str  # short code, usable as a metric key
    domain: str  # the row's domain


def invalid(domain: str, reason: str) -> Grade:
    """A grade for a sample the verifier could not decide."""
    return Grade(reward=0.0, valid=False, reason=reason, domain=domain)


def checked(grade: Grade) -> Grade:
    """``grade`` unless its reward is NaN or infinite, in which case an invalid ``non_finite`` grade."""
    try:
        finite = math.isfinite(grade.reward)
    except TypeError:
        finite = False
    if not finite:
        return invalid(grade.domain, "non_finite")
    return grade


def find_last_boxed(text: str) -> str | None:
    r"""The content of the last ``\boxed{...}`` (or ``\fbox{...}``) in ``text``, braces balanced.

    Returns None when there is none or when its braces never close.
    """
    best = None
    for macro in ("\\boxed", "\\fbox"):
        pos = text.rfind(macro)
        if pos >= 0 and (best is None or pos > best[0]):
            best = (pos, macro)
    if best is None:
        return None
    pos, macro = best
    i = pos + len(macro)
    while i < len(text) and text[i] == " ":
        i += 1
    if i >= len(text) or text[i] != "{":
        # "\boxed 5" (no braces): the token up to the next whitespace or "$".
        rest = text[i:].split("$")[0].split()
        return rest[0] if rest else None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None
