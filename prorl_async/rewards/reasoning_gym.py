r"""Verifier of Reasoning Gym rows (:mod:`prorl_async.data.reasoning_gym`): the task's own scorer.

The answer is read as the row's ``meta.answer_format`` says:

* ``tags``: the last ``<answer>...</answer>`` (Reasoning Gym's ``extract_answer``, stripped);
* ``stated``: the text after the last "answer is" / "answer:" / "=" up to the end of its line,
  without surrounding ``*``, ``$``, quotes and a final period; a response of one short line and
  no such marker is its own answer.

Then ``score_answer(answer, entry)`` of the row's task decides. Scores may be continuous (some
tasks give partial credit): the reward is the score, ``reason`` ``correct`` (1.0), ``partial``
or ``wrong``. A response with no answer where one is looked for is ``no_answer``: valid, reward
0 (a format failure is the policy's to learn, :mod:`prorl_async.rewards.base`), and counted
apart from ``wrong``. A row without its task or entry is ``invalid`` (``malformed_row``); a
scorer that raises is caught by the grader pool and is ``invalid`` too, never a silent 0.
"""

from __future__ import annotations

import re

from prorl_async.rewards.base import Grade, invalid

_STATED = re.compile(r"(?:\banswer\s*(?:is|:)|=)", re.IGNORECASE)
_PEEL = " \t*$\"'`"
_BARE_MAX_CHARS = 40


def extract_answer(response: str, answer_format: str) -> str | None:
    """The answer ``response`` gives in ``answer_format`` (see the module doc), or None."""
    if answer_format == "tags":
        from reasoning_gym.utils import extract_answer as rg_extract

        found = rg_extract(response, tag_name="answer", strip=True)
        return found or None
    matches = list(_STATED.finditer(response))
    if matches:
        tail = response[matches[-1].end():].split("\n")[0]
    else:
        tail = response.strip()
        if "\n" in tail or len(tail) > _BARE_MAX_CHARS:
            return None
    tail = tail.strip(_PEEL).rstrip(".").strip(_PEEL)
    return tail or None


def verify(row: dict, response: str) -> Grade:
    domain = row.get("domain", "rg")
    meta = row.get("meta") or {}
    task, entry, fmt = meta.get("task"), meta.get("entry"), meta.get("answer_format", "tags")
    if not task or not isinstance(entry, dict):
        return invalid(domain, "malformed_row:meta needs task and entry")
    answer = extract_answer(response, fmt)
    if answer is None:
        return Grade(0.0, True, "no_answer", domain)
    from prorl_async.data.reasoning_gym import scorer

    score = float(scorer(task)(answer, entry))
    reason = "correct" if score >= 1.0 else "partial" if score > 0 else "wrong"
    return Grade(min(max(score, 0.0), 1.0), True, reason, domain)
