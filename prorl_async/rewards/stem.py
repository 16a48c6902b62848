r"""STEM verifier: multiple-choice letters/option texts and numeric answers with a tolerance.

Rows (the GPQA / SCP-116K style used in ProRL's STEM mix):

* multiple choice: ``answer`` is a letter ``"A"``..``"J"``; ``choices`` (optional) lists the
  option texts in letter order. ``answer`` may also be the option text when ``choices`` is
  given. The response's final answer (see below) may be the letter (``B``, ``(B)``, ``B.``,
  ``Option B``, ``B) 3.2 m/s``) or the exact option text (case and whitespace insensitive).
* numeric: ``answer`` parses as a number (``"9.81"``, ``"6.02e23"``, ``"1.5 m/s"``): the first
  number in the response's final answer must be within ``stem_rel_tol`` (relative; default
  1e-4) of it. ``\times 10^{k}`` / ``x10^k`` / ``e-k`` notations and thousands separators are
  understood; units text after the number is ignored.
* anything else: case-insensitive string equality of the final answer and ``answer``.

Final answer: the last ``\boxed{...}``, else the text after the last "answer is"/"answer:",
else (multiple choice only) the whole response when it is a single letter.

Hedging: a multiple-choice final answer made of two or more different letters and nothing but
separators (``A,B,C,D``, ``B or C``, ``(B)(C)``, ``Both B and C``) scores 0 with reason
``hedged_answer``, even when the gold letter is among them (unless it is, word for word, one
option's text). Not covered: several boxes (the last one counts) and numeric answers listing
several numbers (the first one counts), which gain nothing over writing that one answer.
"""

from __future__ import annotations

import math
import re

from prorl_async.rewards.base import Grade, find_last_boxed, invalid

LETTERS = "ABCDEFGHIJ"
_ANSWER_IS = re.compile(r"answer\s*(?:is|:)\s*:?\s*", re.IGNORECASE)
_NUMBER = re.compile(
    r"[-+−]?(?:\d{1,3}(?:,\d{3})+|\d+)?(?:\.\d+)?(?:\s*(?:[eE]\s*[-+−]?\d+|"
    r"(?:\\times|\\cdot|×|x|\*)\s*10\s*\^\s*\{?\s*[-+−]?\d+\s*\}?))?"
)
_LETTER = re.compile(r"^\(?\s*(?:option|choice)?\s*\(?([A-Ja-j])\s*[\).:]?(?:\s|$)", re.IGNORECASE)


def final_answer(response: str) -> str | None:
    boxed = find_last_boxed(response)
    if boxed is not None:
        text = boxed
    else:
        matches = list(_ANSWER_IS.finditer(response))
        if not matches:
            return None
        text = response[matches[-1].end():].split("\n")[0]
    text = re.sub(r"\\text\{([^{}]*)\}", r"\1", text)
    return text.strip().strip("*$").strip().rstrip(".").strip() or None


def parse_number(text: str) -> float | None:
    """The first number in ``text`` (with scientific notation), or None."""
    for m in _NUMBER.finditer(text):
        s = m.group().strip()
        if not any(ch.isdigit() for ch in s):
            continue
        s = s.replace("−", "-").replace(",", "").replace(" ", "")
        mant_exp = re.split(r"\\times|\\cdot|×|x|\*", s)
        try:
            if len(mant_exp) == 2:
                exp = mant_exp[1].replace("10^", "", 1).strip("{}")
                return float(mant_exp[0]) * 10.0 ** int(exp)
            return float(s)
        except ValueError:
            return None
    return None


def _norm(text: str) -> str:
    return " ".join(str(text).lower().split()).rstrip(".")


_HEDGE_TOKEN = re.compile(r"[A-Za-z]+|[^\sA-Za-z]")
_HEDGE_WORDS = {"and", "or", "both", "option", "options", "choice", "choices"}


def hedged_letters(answer: str) -> set[str]:
    """The letters of an answer made only of single letters, separators and joining words
    (``"A, C"``, ``"B or D"``, ``"(B)(C)"``), upper-cased; empty for any other answer."""
    letters = set()
    for tok in _HEDGE_TOKEN.findall(answer):
        if tok.lower() in _HEDGE_WORDS or tok in ",;/&+|().:":
            continue
        if len(tok) != 1 or not tok.isalpha():
            return set()
        letters.add(tok.upper())
    return letters


def _letter_of(answer: str, choices: list | None) -> str | None:
    if len(hedged_letters(answer)) > 1:  # an option whose text is letters ("A and B") is that option
        return _option_with_text(answer, choices)
    m = _LETTER.match(answer.strip())
    if m and (choices is None or LETTERS.index(m.group(1).upper()) < len(choices)):
        return m.group(1).upper()
    return _option_with_text(answer, choices)


def _option_with_text(answer: str, choices: list | None) -> str | None:
    for letter, text in zip(LETTERS, choices or ()):
        if _norm(answer) == _norm(text):
            return letter
    return None


def verify(row: dict, response: str, **options) -> Grade:
    gold = row.get("answer")
    if gold is None or str(gold).strip() == "":
        return invalid("stem", "malformed_row:missing answer")
    gold = str(gold).strip()
    choices = row.get("choices")
    if choices is not None and (not isinstance(choices, list) or not choices):
        return invalid("stem", "malformed_row:choices must be a non-empty list")
    tol = float(options.get("stem_rel_tol", 1e-4))

    gold_letter = None
    if choices is not None:
        gold_letter = _letter_of(gold, choices)
        if gold_letter is None:
            return invalid("stem", "malformed_row:answer is neither a letter nor an option")
    elif re.fullmatch(r"\(?[A-J]\)?", gold):
        gold_letter = gold.strip("()")

    answer = final_answer(response)
    if answer is None and gold_letter is not None:
        bare = response.strip().strip("*().")
        if re.fullmatch(r"[A-Ja-j]", bare):
            answer = bare
    if answer is None:
        return Grade(0.0, True, "no_answer", "stem")

    if gold_letter is not None:
        if len(hedged_letters(answer)) > 1 and _option_with_text(answer, choices) is None:
            return Grade(0.0, True, "hedged_answer", "stem")
        letter = _letter_of(answer, choices)
        if letter is None:
            return Grade(0.0, True, "unparseable_answer", "stem")
        return Grade(float(letter == gold_letter), True, "correct" if letter == gold_letter else "wrong", "stem")

    gold_num = parse_number(gold)
    if gold_num is not None and re.match(r"^\s*[-+−]?[\d.]", gold):
        got = parse_number(answer)
        if got is None or not math.isfinite(got):
            return Grade(0.0, True, "unparseable_answer", "stem")
        ok = math.isclose(got, gold_num, rel_tol=tol, abs_tol=1e-12)
        return Grade(float(ok), True, "correct" if ok else "wrong", "stem")
    ok = _norm(answer) == _norm(gold)
    return Grade(float(ok), True, "correct" if ok else "wrong", "stem")
