r"""Math verifier: final-answer extraction plus equivalence checking with HuggingFace Math-Verify.

Extraction (our code, deliberately strict so that the policy learns one format):

1. the content of the **last** ``\boxed{...}`` (or ``\fbox{...}``) in the response;
2. fallback, only when there is no box: the text after the last "the answer is" /
   "final answer:" (case-insensitive) up to the end of that line, with surrounding ``$``,
   ``\( \)``, ``**`` and a trailing period removed;
3. otherwise the response has no answer: reward 0, valid, reason ``no_answer``.

Equivalence: ``math_verify.parse`` on the gold answer and on the extracted answer (as LaTeX
``$...$``, then as a plain expression), then ``math_verify.verify(gold, pred)``. Parsed gold
answers and (gold, answer) verdicts are cached per process (LRU), since the n samples of a
group share their gold answer and often their final answer. Math-Verify
handles fractions vs decimals, ``\frac``/``\dfrac``, ``\sqrt``, percentages, ``\text{}`` units,
intervals, sets, and symbolic equivalence through SymPy (Kydlíček et al., Math-Verify,
github.com/huggingface/Math-Verify).

Time limits. Math-Verify can hang on adversarial input (Math-Verify issue #65; here, e.g.,
``\boxed{10^{10^{10}}}`` makes SymPy evaluate a power tower for minutes). Its own
timeouts use ``signal.alarm``, which raises ValueError off the main thread (a Ray actor's
threads) and silently turns a timeout into ``False`` (a wrong answer). We therefore call it
with ``parsing_timeout=None`` and ``timeout_seconds=None`` and rely on the hard, kill-based
per-sample limit of :class:`prorl_async.rewards.pool.GraderPool`; a killed sample is
``valid=False, reason="timeout"``. Calling :func:`verify` in-process has no time limit.
"""

from __future__ import annotations

import functools
import logging
import re

from prorl_async.rewards.base import Grade, find_last_boxed, invalid

_ANSWER_IS = re.compile(r"(?:the\s+)?(?:final\s+)?answer\s*(?:is|:)\s*:?\s*", re.IGNORECASE)
_MAX_ANSWER_CHARS = 1000  # longer "answers" are not answers; also bounds SymPy's work


def _quiet_math_verify() -> None:
    # With our timeouts disabled Math-Verify warns once per process; the pool is the limit.
    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).setLevel(logging.ERROR)


def extract_answer(response: str) -> str | None:
    """The final answer of ``response`` per the rules in the module docstring, or None."""
    boxed = find_last_boxed(response)
    if boxed is not None:
        return boxed.strip() or None
    matches = list(_ANSWER_IS.finditer(response))
    if not matches:
        return None
    tail = response[matches[-1].end() :].split("\n")[0].strip()
    for _ in range(3):  # peel decorations in any order
        tail = tail.strip().rstrip(".").strip()
        tail = tail.strip("*").strip()
        if tail.startswith("\\(") and tail.endswith("\\)"):
            tail = tail[2:-2]
        if tail.startswith("\\[") and tail.endswith("\\]"):
            tail = tail[2:-2]
        if len(tail) >= 2 and tail[0] == "$" and tail[-1] == "$":
            tail = tail.strip("$")
    return tail.strip() or None


def _parse(text: str, as_gold: bool):
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    if as_gold and ("$" in text or "\\boxed" in text):
        parsed = parse(text, parsing_timeout=None)
        if parsed:
            return parsed
    parsed = parse(f"${text}$", extraction_config=[LatexExtractionConfig()], parsing_timeout=None)
    if not parsed:
        parsed = parse(text, extraction_config=[ExprExtractionConfig()], parsing_timeout=None)
    return parsed


@functools.lru_cache(maxsize=4096)
def _parsed_gold(text: str):
    return _parse(text, as_gold=True)


@functools.lru_cache(maxsize=65536)
def _equivalent(gold_text: str, answer: str) -> bool | None:
    """True/False, or None when the answer does not parse. Cached: the n samples of a group
    share one gold answer and often the same final answer."""
    from math_verify import verify as mv_verify

    pred = _parse(answer, as_gold=False)
    if not pred:
        return None
    return bool(mv_verify(_parsed_gold(gold_text), pred, timeout_seconds=None))


def verify(row: dict, response: str, **options) -> Grade:
    _quiet_math_verify()
    gold_text = row.get("answer")
    if gold_text is None or (isinstance(gold_text, str) and not gold_text.strip()):
        return invalid("math", "malformed_row:missing answer")
    gold_text = str(gold_text).strip()
    if not _parsed_gold(gold_text):
        return invalid("math", "malformed_row:gold answer does not parse")
    answer = extract_answer(response)
    if answer is None or len(answer) > _MAX_ANSWER_CHARS:
        return Grade(0.0, True, "no_answer", "math")
    same = _equivalent(gold_text, answer)
    if same is None:
        return Grade(0.0, True, "unparseable_answer", "math")
    if same:
        return Grade(1.0, True, "correct", "math")
    return Grade(0.0, True, "wrong", "math")
