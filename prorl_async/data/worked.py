"""Worked solutions for the few-shot examples of some Reasoning Gym tasks (``worked=true``).

A demo answered only "The answer is 114." teaches a small model to answer in one step, with no
room to compute: its policy can then only sharpen the answers it already guesses (the second
ProRL-in-miniature run: 7-token responses from step 1, entropy 0.53 -> 0.14). A demo that works
the problem out in short steps before the same final line shows the model a way to use more
tokens. Each writer below turns a generated item (its metadata; for aiw its question) into those
steps; the value the steps end on is checked against the item's gold answer, so a writer that
disagrees with Reasoning Gym fails at load time instead of teaching a wrong method.

Only demos are worked: the questions and the graders are Reasoning Gym's own, and a response is
read and graded as without this option.
"""

from __future__ import annotations

import re
from typing import Callable


def _chain_sum(item: dict) -> tuple[str, int]:
    """``98 + 93 - 77`` -> ``98 + 93 = 191. 191 - 77 = 114.``"""
    meta = item["metadata"]
    parts = meta["expression"].split()
    total, steps = int(parts[0]), []
    for op, raw in zip(parts[1::2], parts[2::2]):
        term = int(raw)
        new = total + term if op == "+" else total - term
        steps.append(f"{total} {op} {term} = {new}.")
        total = new
    return " ".join(steps), total


def _products(item: dict) -> tuple[str, int]:
    """``98 * 93`` -> ``98 * 93 = 98 * 90 + 98 * 3 = 8820 + 294 = 9114.`` (one digit: ``7 * 8 = 56.``)"""
    meta = item["metadata"]
    a, op, b = meta["expression"].split()
    x, y = int(a), int(b)
    if op != "*" or len(meta["expression"].split()) != 3:
        raise ValueError(f"not a product of two terms: {meta['expression']!r}")
    if abs(y) < 10:
        return f"{x} * {y} = {x * y}.", x * y
    sign = -1 if y < 0 else 1
    pieces = [sign * int(d) * 10 ** p for p, d in enumerate(reversed(str(abs(y)))) if d != "0"][::-1]
    if len(pieces) == 1:
        return f"{x} * {y} = {x * y}.", x * y
    split = " + ".join(f"{x} * {p}" for p in pieces)
    partial = " + ".join(str(x * p) for p in pieces)
    return f"{x} * {y} = {split} = {partial} = {x * y}.", x * y


def _gcd(item: dict) -> tuple[str, int]:
    """Euclid's remainders: ``100 mod 60 = 40. 60 mod 40 = 20. 40 mod 20 = 0. The GCD is 20.``"""
    meta = item["metadata"]
    numbers = [abs(int(v)) for v in meta["numbers"]]
    steps, g = [], numbers[0]
    for n in numbers[1:]:
        a, b = max(g, n), min(g, n)
        while b:
            steps.append(f"{a} mod {b} = {a % b}.")
            a, b = b, a % b
        g = a
    steps.append(f"The GCD is {g}.")
    return " ".join(steps), g


def _leg_counting(item: dict) -> tuple[str, int]:
    """``4 butterfly: 4 * 6 = 24. 2 crab: 2 * 10 = 20. 24 + 20 = 44.``"""
    from reasoning_gym.arithmetic.leg_counting import ANIMALS

    meta = item["metadata"]

    counts = [(name, int(k), ANIMALS[name]) for name, k in meta["animals"].items()]
    steps = [f"{k} {name}: {k} * {legs} = {k * legs}." for name, k, legs in counts]
    total = sum(k * legs for _, k, legs in counts)
    if len(counts) > 1:
        steps.append(" + ".join(str(k * legs) for _, k, legs in counts) + f" = {total}.")
    return " ".join(steps), total


def _letter_counting(item: dict) -> tuple[str, int]:
    """``"r" in me 0, see 0, I 0, have 0, three 1. 0 + 0 + 0 + 0 + 1 = 1.``"""
    meta = item["metadata"]
    letter = meta["target_letter"].lower()
    counts = [(w, w.lower().count(letter)) for w in meta["span"]]
    total = sum(c for _, c in counts)
    listed = ", ".join(f"{w} {c}" for w, c in counts)
    return f'"{letter}" in {listed}. ' + " + ".join(str(c) for _, c in counts) + f" = {total}.", total


def _spell_backward(item: dict) -> tuple[str, str]:
    """``r-o-i-d backward is d-i-o-r.``"""
    meta = item["metadata"]
    word = meta["word"]
    return f"{'-'.join(word)} backward is {'-'.join(reversed(word))}.", word[::-1]


def _aiw(item: dict) -> tuple[str, int]:
    """Alice in Wonderland, counted as Reasoning Gym counts (Alice herself is one of her brother's
    sisters, of her male friend's female friends, of Matilda's female colleagues):
    ``Her brother's sisters are Alice's 3 sisters and Alice: 3 + 1 = 4.`` The metadata has only
    the task type, so the count is read from the question."""
    question, kind = item["question"], item["metadata"].get("task_type")
    name = question.split()[0]
    noun = {"siblings": "sisters", "friends": "female friends", "colleagues": "female colleagues"}.get(kind)
    found = re.search(rf"(\d+) {noun}\b", question) if noun else None
    if found is None:
        raise ValueError(f"an aiw question of an unknown form (task type {kind!r}): {question!r}")
    k = int(found.group(1))
    whose = {"siblings": "Her brother's sisters", "friends": "His female friends",
             "colleagues": "Matilda's female colleagues"}[kind]
    return f"{whose} are {name}'s {k} {noun} and {name}: {k} + 1 = {k + 1}.", k + 1


WRITERS: dict[str, Callable[[dict], tuple]] = {
    "chain_sum": _chain_sum, "products": _products, "gcd": _gcd, "leg_counting": _leg_counting,
    "letter_counting": _letter_counting, "spell_backward": _spell_backward, "aiw": _aiw,
}


def worked_steps(task: str, item: dict) -> str:
    """The steps (without the final line) of a demo of ``task``; ValueError if ``task`` has no
    writer or the steps do not end on the item's gold answer."""
    if task not in WRITERS:
        raise ValueError(f"worked=true: no worked solutions for {task!r}; they exist for "
                         f"{', '.join(sorted(WRITERS))} (drop worked=true from this task's source)")
    steps, value = WRITERS[task]({"metadata": {}, **item})
    if str(value) != str(item["answer"]).strip():
        raise ValueError(f"worked=true: the worked solution of {task!r} ends on {value!r}, the gold answer is "
                         f"{item['answer']!r} (question {item['question']!r})")
    return steps


