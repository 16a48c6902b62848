"""Instruction-following verifier: IFEval-style verifiable constraints.

After IFEval (Zhou et al., "Instruction-Following Evaluation for Large Language Models", 2023)
as used in ProRL's instruction-following mix. ``row["constraints"]`` is a list of
``{"type": str, "kwargs": dict}``; each constraint is checked by a small exact function on the
response (the part after the last ``</think>`` if the model wrote one; none if a ``<think>`` was
never closed, as in a response cut at the length limit). An empty answer scores 0 with reason
``no_answer`` whatever its constraints: "no commas" or "at most 50 words" must not be
satisfied by saying nothing. (A short answer that ignores the task but keeps such constraints
still scores: the checkers see the form of the text, not whether it does what the prompt asks.)
Reward: the fraction
of constraints satisfied (``instruction_mode="fraction"``, IFEval's "loose-instruction" style
partial credit) or 1.0 iff all are (``"all"``, IFEval's prompt-level accuracy). An unknown
constraint type, or kwargs a checker cannot use, makes the grade ``valid=False`` with a reason
naming the type.

Constraint types and kwargs (``relation`` is one of ``at least``, ``at most``, ``less than``,
``more than``, ``exactly``):

======================  ===============================================================
word_count              relation, num
sentence_count          relation, num
paragraph_count         num, separator (default: blank line; IFEval uses ``***``)
keywords_include        keywords (all must appear; whole words, case-insensitive)
keywords_exclude        keywords (none may appear)
keyword_frequency       keyword, relation, num
letter_frequency        letter, relation, num
json_format             (none) the response, optionally in a ```json fence, is JSON
bullet_count            num (exactly; markdown ``*``/``-`` bullets at line start)
highlight_count         num (at least; ``*highlighted*`` sections)
placeholder_count       num (at least; ``[placeholder]`` sections)
title                   (none) a title in double angular brackets, ``<<title>>``
start_with              phrase (case-insensitive, after leading whitespace)
end_with                phrase (case-insensitive, before trailing whitespace)
postscript              marker (e.g. ``P.S.``) starting a line
quotation               (none) the whole response is wrapped in double quotes
all_lowercase           (none)
all_uppercase           (none)
capital_word_frequency  relation, num (words written in all capitals)
no_commas               (none)
sections                num, splitter (default ``Section``): at least num sections
======================  ===============================================================
"""

from __future__ import annotations

import json
import re
from typing import Callable

from prorl_async.rewards.base import Grade, invalid

RELATIONS: dict[str, Callable[[int, int], bool]] = {
    "at least": lambda x, n: x >= n,
    "at most": lambda x, n: x <= n,
    "less than": lambda x, n: x < n,
    "more than": lambda x, n: x > n,
    "exactly": lambda x, n: x == n,
}
_WORD = re.compile(r"\b\w+(?:['’-]\w+)*\b")


def _relation(kw: dict) -> Callable[[int], bool]:
    rel, num = kw["relation"], kw["num"]
    if rel not in RELATIONS or not isinstance(num, int):
        raise ValueError(f"relation must be one of {sorted(RELATIONS)} with an int num")
    return lambda x: RELATIONS[rel](x, num)


def words(text: str) -> list[str]:
    return _WORD.findall(text)


def sentences(text: str) -> list[str]:
    parts = re.split(r"(?<=[.!?])[\"')\]]*\s+", text.strip())
    return [p for p in parts if _WORD.search(p)]


def paragraphs(text: str, separator: str | None) -> list[str]:
    parts = text.split(separator) if separator else re.split(r"\n\s*\n", text)
    return [p for p in parts if p.strip()]


def _has_word(text: str, word: str) -> bool:
    return re.search(rf"(?<!\w){re.escape(word)}(?!\w)", text, re.IGNORECASE) is not None


def _json_ok(text: str) -> bool:
    t = text.strip()
    fence = re.fullmatch(r"```(?:json)?\s*\n?(.*?)\n?```", t, re.DOTALL | re.IGNORECASE)
    if fence:
        t = fence.group(1)
    try:
        json.loads(t)
    except ValueError:
        return False
    return True


def _count_bullets(text: str) -> int:
    return len(re.findall(r"^\s*[*-]\s+\S", text, re.MULTILINE))


CHECKERS: dict[str, Callable[[str, dict], bool]] = {
    "word_count": lambda r, kw: _relation(kw)(len(words(r))),
    "sentence_count": lambda r, kw: _relation(kw)(len(sentences(r))),
    "paragraph_count": lambda r, kw: len(paragraphs(r, kw.get("separator"))) == int(kw["num"]),
    "keywords_include": lambda r, kw: all(_has_word(r, k) for k in _str_list(kw["keywords"])),
    "keywords_exclude": lambda r, kw: not any(_has_word(r, k) for k in _str_list(kw["keywords"])),
    "keyword_frequency": lambda r, kw: _relation(kw)(
        len(re.findall(rf"(?<!\w){re.escape(_str(kw['keyword']))}(?!\w)", r, re.IGNORECASE))),
    "letter_frequency": lambda r, kw: _relation(kw)(r.lower().count(_letter(kw["letter"]))),
    "json_format": lambda r, kw: _json_ok(r),
    "bullet_count": lambda r, kw: _count_bullets(r) == int(kw["num"]),
    "highlight_count": lambda r, kw: len(re.findall(r"(?<!\*)\*[^\n*]+\*(?!\*)", r)) >= int(kw["num"]),
    "placeholder_count": lambda r, kw: len(re.findall(r"\[[^\[\]\n]+\]", r)) >= int(kw["num"]),
    "title": lambda r, kw: re.search(r"<<[^\n<>]+>>", r) is not None,
    "start_with": lambda r, kw: r.lstrip().lower().startswith(_str(kw["phrase"]).lower()),
    "end_with": lambda r, kw: r.rstrip().lower().endswith(_str(kw["phrase"]).lower()),
    "postscript": lambda r, kw: re.search(rf"^\s*{re.escape(_str(kw['marker']))}", r,
                                          re.MULTILINE | re.IGNORECASE) is not None,
    "quotation": lambda r, kw: len(r.strip()) >= 2 and r.strip()[0] == '"' and r.strip()[-1] == '"',
    "all_lowercase": lambda r, kw: r == r.lower() and any(c.isalpha() for c in r),
    "all_uppercase": lambda r, kw: r == r.upper() and any(c.isalpha() for c in r),
    "capital_word_frequency": lambda r, kw: _relation(kw)(
        sum(1 for w in words(r) if w.isupper() and len(w) > 1)),
    "no_commas": lambda r, kw: "," not in r and "，" not in r,
    "sections": lambda r, kw: len(re.findall(
        rf"^\s*{re.escape(_str(kw.get('splitter', 'Section')))}\s+\d+", r,
        re.MULTILINE | re.IGNORECASE)) >= int(kw["num"]),
}


def _str(x) -> str:
    if not isinstance(x, str) or not x:
        raise ValueError("expected a non-empty string")
    return x


def _str_list(x) -> list[str]:
    if not isinstance(x, list) or not x or not all(isinstance(k, str) and k for k in x):
        raise ValueError("expected a non-empty list of strings")
    return x


def _letter(x) -> str:
    if not isinstance(x, str) or len(x) != 1 or not x.isalpha():
        raise ValueError("letter must be a single letter")
    return x.lower()


def answer_part(response: str) -> str:
    """The response after the last ``</think>`` (the whole response if there is none); empty when
    a ``<think>`` is never closed (the response ended while thinking)."""
    i = response.rfind("</think>")
    answer = response[i + len("</think>"):] if i >= 0 else response
    return "" if "<think>" in answer else answer


def verify(row: dict, response: str, **options) -> Grade:
    constraints = row.get("constraints")
    if not isinstance(constraints, list) or not constraints:
        return invalid("instruction", "malformed_row:constraints must be a non-empty list")
    text = answer_part(response)
    satisfied = 0
    first_failed = None
    for c in constraints:
        if not isinstance(c, dict) or not isinstance(c.get("type"), str):
            return invalid("instruction", "malformed_row:a constraint needs a string type")
        ctype = c["type"]
        if ctype not in CHECKERS:
            return invalid("instruction", f"unknown_constraint:{ctype}")
        kwargs = c.get("kwargs") or {}
        try:
            ok = CHECKERS[ctype](text, kwargs)
        except (KeyError, ValueError, TypeError):
            return invalid("instruction", f"malformed_row:bad kwargs for {ctype}")
        if ok:
            satisfied += 1
        elif first_failed is None:
            first_failed = ctype
    if not text.strip():  # after the checks, so a malformed row stays invalid whatever the response
        return Grade(0.0, True, "no_answer", "instruction")
    n = len(constraints)
    if options.get("instruction_mode", "fraction") == "all":
        reward = 1.0 if satisfied == n else 0.0
    else:
        reward = satisfied / n
    return Grade(reward, True, "all_satisfied" if satisfied == n else f"failed:{first_failed}",
                 "instruction")
