"""The built-in chat-arith task and its stated-result grader."""

from __future__ import annotations

import pytest

from prorl_async.data.builtin import split_of
from prorl_async.data.datasets import load_rows
from prorl_async.rewards import grade


def test_rows_are_chat_messages_with_disjoint_splits():
    train = load_rows("builtin:chat-arith?n=300&seed=1&split=train")
    held_out = load_rows("builtin:chat-arith?n=100&seed=2&split=eval")
    assert len(train) == 300 and len(held_out) == 100
    q = lambda rows: {r["prompt"][0]["content"] for r in rows}  # noqa: E731
    assert not q(train) & q(held_out)
    assert len(q(held_out)) == 100 and len(q(train)) == 300  # distinct problems while n <= the split's size
    assert len(q(load_rows("builtin:chat-arith?n=1000&seed=1&split=train"))) == 438  # then cycled
    assert all(split_of(r["prompt"][0]["content"]) == "eval" for r in held_out)
    r = held_out[0]
    assert r["domain"] == "chat-arith" and r["prompt"][0]["role"] == "user"
    a, op, b = r["prompt"][0]["content"].removeprefix("What is ").split("?")[0].split()
    assert int(r["answer"]) == (int(a) + int(b) if op == "+" else int(a) - int(b)) >= 0
    assert load_rows("builtin:chat-arith?n=100&seed=2&split=eval") == held_out  # deterministic


@pytest.mark.parametrize("response, reward", [
    ("12", 1.0), ("12.", 1.0), ("**12**", 1.0),
    ("7 + 5 = 12", 1.0), ("7 + 5 = 12.", 1.0), ("The answer is 12.", 1.0),
    ("The sum of 7 and 5 is 12", 1.0), ("7 + 5 equals $12$", 1.0),
    ("7 + 5 = 13", 0.0), ("7 + 5 = 12, no: 7 + 5 = 13", 0.0),   # the last stated result counts
    ("To solve this problem, we add 7 and 5.", 0.0),            # states no result
    ("12 apples and 7 + 5", 0.0), ("It is 12.5", 0.0), ("", 0.0),
])
def test_grader_credits_only_a_stated_result(response, reward):
    row = {"id": "x", "domain": "chat-arith", "answer": "12"}
    g = grade(row, response)
    assert g.valid and g.reward == reward


def test_malformed_answer_is_invalid_not_wrong():
    assert not grade({"id": "x", "domain": "chat-arith", "answer": "twelve"}, "12").valid
