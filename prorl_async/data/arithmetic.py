"""The built-in default task: multi-digit addition and subtraction with an exact checker.

Prompts look like ``"47+85="`` and the gold answer is the integer string (``"132"``). Every
problem is assigned to the train or eval split by the built-in tasks' stable hash of its text
(:func:`prorl_async.data.builtin.split_of`), so the two splits never share a problem whatever
the seeds. Graded by the ``arithmetic`` verifier in
:mod:`prorl_async.rewards` (reward 1 iff the response starts with the right integer).
"""

from __future__ import annotations

import random

from prorl_async.data.builtin import split_of

MAX_OPERAND = 99


def make_problem(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(0, MAX_OPERAND), rng.randint(0, MAX_OPERAND)
    if rng.random() < 0.5:
        return f"{a}+{b}=", str(a + b)
    a, b = max(a, b), min(a, b)  # keep answers non-negative
    return f"{a}-{b}=", str(a - b)


def generate(n: int, seed: int, split: str = "train") -> list[dict]:
    """``n`` rows of the given split, deterministic in ``seed`` (rows may repeat when n is large)."""
    if split not in ("train", "eval"):
        raise ValueError(f"arithmetic split must be 'train' or 'eval', got {split!r}")
    rng = random.Random(f"arithmetic-{seed}-{split}")
    rows = []
    while len(rows) < n:
        prompt, answer = make_problem(rng)
        if split_of(prompt) != split:
            continue
        rows.append({"id": f"arith-{split}-{seed}-{len(rows)}", "domain": "arithmetic",
                     "prompt": prompt, "answer": answer})
    return rows
