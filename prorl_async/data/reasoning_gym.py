r"""Reasoning Gym tasks as a data source: ``reasoning-gym:TASK[+TASK...]?n=&seed=&split=&...``.

Reasoning Gym (Stojanovski et al. 2025, arXiv 2505.24760; ``pip install reasoning-gym``,
Apache-2.0) generates verifiable problems procedurally, each task with its own scorer
(``score_answer``). ProRL v1 took its logic puzzles from it (Liu et al. 2025, arXiv 2505.24864,
Sec. 3). Here any of its tasks is a source like the built-ins; the grader calls the task's own
``score_answer`` (:mod:`prorl_async.rewards.reasoning_gym`) in the grader pool, under the same
time limit as every verifier.

Query parameters (every one optional):

* ``n``: rows **per task** (default 100); ``seed`` (default 0);
* ``split``: ``train`` or ``eval``. Every problem belongs to one split by a stable hash of its
  question (as :func:`prorl_async.data.builtin.split_of`): 20 % eval, 5 % demo (the few-shot
  examples), the rest train, so no seed can put an eval question, or a demo, into training;
* ``shots``: K solved examples of the same task and options, as chat turns before the question
  (default 0). They are the first K demo-split problems of a fixed seed, the same for every
  prompt of the task (a shared prefix: the engine's prefix cache and the learner's packed
  prefixes compute it once) and for the train and eval sources of the same settings;
* ``answer``: where the answer is read from, ``tags`` (default: the last ``<answer>...</answer>``,
  Reasoning Gym's convention, through its own ``extract_answer``) or ``stated`` (the text after
  the last "answer is" / "answer:" / "=" on its line, as ``chat-arith`` reads a result);
* ``worked``: ``true`` answers each shot with short worked steps before its final line (e.g.
  ``98 + 93 = 191. 191 - 77 = 114. The answer is 114.``), for the tasks
  :mod:`prorl_async.data.worked` has a writer for; default ``false`` (the final line alone);
* ``max_share``: at most this share of a task's rows may have one answer (e.g. ``0.25``; default
  1, no limit). Items are taken in index order as always, and one whose answer already fills its
  share is passed over. Some tasks' answers are mostly one value at easy settings (a letter's
  count in three to five words is 1 in more than half of them), and a policy that learns the value passes
  them without the task (``prior@1`` of ``prorl-async eval`` shows it); a cap makes pass@k measure
  the task. A cap the task's answers cannot meet (fewer distinct answers than ``1 / max_share``)
  is an error asking for a higher one;
* ``level``: a label of this difficulty setting; the rows' domain is ``rg:TASK@LEVEL`` (without
  it ``rg:TASK``), so evaluation, rollout metrics and the curriculum's pools keep levels apart;
* anything else is an option of the task's config (e.g. ``min_terms=2&max_terms=2`` for
  ``chain_sum``), given to every listed task whose config has it; ``TASK.option=`` gives it to
  one task. An option no listed task has, or a task name Reasoning Gym does not know, is one
  ``ValueError`` listing what is valid.

Rows: ``id`` ``rg:TASK[@LEVEL]:SEED:INDEX``, ``domain`` as above, ``prompt`` chat messages
(system prompt for the answer format, the shots, the question), ``answer`` the gold answer and
``meta`` ``{task, entry, answer_format}``: ``entry`` is the generated item (question, answer,
metadata) as JSON, what ``score_answer`` reads. A task whose scorer does not give its own gold
answer 1.0 after that JSON round trip is refused at load time (it would grade everything wrong).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
from urllib.parse import parse_qsl, urlsplit

import yaml

from prorl_async.data.worked import WRITERS, worked_steps

PREFIX = "reasoning-gym:"
DOMAIN_PREFIX = "rg:"
ANSWER_FORMATS = ("tags", "stated")
EVAL_FRACTION, DEMO_FRACTION = 0.20, 0.05
DEMO_SEED = 9_973  # the few-shot examples' seed: fixed, so train and eval prompts share them
_RESERVED = ("n", "seed", "split", "shots", "answer", "level", "worked", "max_share")
_MAX_TRIES = 50  # generated items per wanted row before a split is declared too small
_MIN_SCAN = 1000  # and at least this many: the demo split is 5 %, so 2 shots in 100 items fail 4 % of option sets

SYSTEM_PROMPTS = {
    "tags": "Answer the question. Give the final answer between <answer> and </answer> tags, "
            "with nothing else inside the tags.",
    "stated": "Answer the question. End with \"The answer is X.\", where X is the final answer.",
}


def install_hint() -> str:
    return "install it with `bash setup.sh reasoning-gym` (pip install reasoning-gym==0.1.25)"


def _rg():
    try:
        import reasoning_gym
    except ImportError:
        raise ValueError(f"reasoning-gym sources need the reasoning-gym package; {install_hint()}") from None
    return reasoning_gym


def task_names() -> list[str]:
    """Every task Reasoning Gym registers."""
    from reasoning_gym.factory import DATASETS  # noqa: F401 (the package import registers them)

    _rg()
    return sorted(DATASETS)


def task_options(task: str) -> list[str]:
    """The fields of ``task``'s config dataclass (what a source may set), less ``seed`` / ``size``."""
    from reasoning_gym.factory import DATASETS

    return sorted(f.name for f in dataclasses.fields(DATASETS[task][1]) if f.name not in ("seed", "size"))


def split_of(question: str) -> str:
    """``eval`` / ``demo`` / ``train`` by a stable hash of the question text."""
    h = int(hashlib.sha1(question.encode()).hexdigest()[:8], 16) % 1000
    if h < EVAL_FRACTION * 1000:
        return "eval"
    return "demo" if h < (EVAL_FRACTION + DEMO_FRACTION) * 1000 else "train"


@dataclasses.dataclass(frozen=True)
class Spec:
    """One parsed ``reasoning-gym:`` source."""
    tasks: tuple
    n: int
    seed: int
    split: str
    shots: int
    answer: str
    level: str
    options: dict  # task -> {option: value}
    worked: bool = False
    max_share: float = 1.0


def _value(raw: str):
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw


def parse(source: str) -> Spec:
    """Parse and check a source (task names and options against Reasoning Gym's registry)."""
    if not source.startswith(PREFIX):
        raise ValueError(f"{source}: not a reasoning-gym source (reasoning-gym:TASK[+TASK...]?n=&seed=&split=)")
    if PREFIX in source[len(PREFIX):]:
        # a YAML block scalar that lost a ';' joins two sources into one, whose last option would
        # otherwise be reported as unknown to the first source's task
        raise ValueError(f"{source}: two sources run together; separate sources with ';'")
    parts = urlsplit(source[len(PREFIX):])
    tasks = tuple(t for t in parts.path.split("+") if t)
    known = task_names()
    if not tasks:
        raise ValueError(f"{source}: no task named; valid tasks: {', '.join(known)}")
    bad = [t for t in tasks if t not in known]
    if bad:
        raise ValueError(f"{source}: unknown Reasoning Gym task(s) {bad}; valid tasks: {', '.join(known)}")
    query = dict(parse_qsl(parts.query, keep_blank_values=True))
    try:
        n, seed, shots = int(query.get("n", 100)), int(query.get("seed", 0)), int(query.get("shots", 0))
    except ValueError:
        raise ValueError(f"{source}: n, seed and shots must be integers") from None
    split, answer, level = query.get("split", "train"), query.get("answer", "tags"), query.get("level", "")
    if split not in ("train", "eval"):
        raise ValueError(f"{source}: split must be train or eval, got {split!r}")
    if answer not in ANSWER_FORMATS:
        raise ValueError(f"{source}: answer must be {' or '.join(ANSWER_FORMATS)}, got {answer!r}")
    if n < 0 or shots < 0:
        raise ValueError(f"{source}: n and shots must be >= 0")
    worked = _value(query.get("worked", "false"))
    if not isinstance(worked, bool):
        raise ValueError(f"{source}: worked must be true or false, got {query['worked']!r}")
    if worked:
        if not shots:
            raise ValueError(f"{source}: worked=true works out the shots' answers; set shots (e.g. shots=2)")
        missing = [t for t in tasks if t not in WRITERS]
        if missing:
            raise ValueError(f"{source}: worked=true: no worked solutions for {missing}; they exist for "
                             f"{', '.join(sorted(WRITERS))} (drop worked=true for the others)")
    max_share = _value(query.get("max_share", "1"))
    if isinstance(max_share, bool) or not isinstance(max_share, (int, float)) or not 0 < max_share <= 1:
        raise ValueError(f"{source}: max_share must be a number in (0, 1], got {query['max_share']!r}")
    if level and not level.replace("_", "").replace("-", "").isalnum():
        raise ValueError(f"{source}: level must be a word (letters, digits, - or _), got {level!r}")
    options = {t: {} for t in tasks}
    for key, raw in query.items():
        if key in _RESERVED:
            continue
        task, _, name = key.rpartition(".")
        targets = [task] if task else [t for t in tasks if name in task_options(t)]
        if task and task not in tasks:
            raise ValueError(f"{source}: option {key!r} names task {task!r}, which the source does not list")
        if not targets or name not in task_options(targets[0]):
            valid = "; ".join(f"{t}: {', '.join(task_options(t))}" for t in tasks)
            raise ValueError(f"{source}: unknown option {key!r}; valid: {', '.join(_RESERVED)}; task options: {valid}")
        for t in targets:
            options[t][name] = _value(raw)
    return Spec(tasks, n, seed, split, shots, answer, level, options, worked, float(max_share))


def _dataset(task: str, options: dict, seed: int, size: int):
    try:
        return _rg().create_dataset(task, seed=seed, size=size, **options)
    except (TypeError, AssertionError, ValueError) as e:  # the task's own config validation
        raise ValueError(f"reasoning-gym:{task}: options {options} rejected by the task: {e}") from None


def _items(task: str, options: dict, seed: int, split: str, count: int, max_share: float = 1.0):
    """``count`` items of ``split`` (question-hash split), in index order, with their indices; an
    item whose answer already holds ``ceil(max_share * count)`` of them is passed over."""
    size = max(max(count, 1) * _MAX_TRIES, _MIN_SCAN)  # items are generated on access, in index order
    ds = _dataset(task, options, seed, size)
    cap = max(1, math.ceil(max_share * count - 1e-9))
    out: list = []
    per_answer: dict[str, int] = {}
    for idx in range(size):
        if len(out) == count:
            return out
        item = ds[idx]
        if split_of(item["question"]) == split:
            gold = str(item["answer"])
            if per_answer.get(gold, 0) >= cap:
                continue
            per_answer[gold] = per_answer.get(gold, 0) + 1
            out.append((idx, item))
    if len(out) < count:
        capped = (f" with at most {cap} rows per answer (max_share={max_share}; {len(per_answer)} distinct answers "
                  f"found)" if max_share < 1 else "")
        raise ValueError(f"reasoning-gym:{task} with {options}: found {len(out)} {split}-split problems{capped} in "
                         f"{size} generated, {count} wanted; ask for fewer rows, wider options"
                         f"{' or a higher max_share' if capped else ''}")
    return out


def _entry(item: dict) -> dict:
    """The item as the row keeps it (JSON-safe: tuples become lists, other objects their str)."""
    return json.loads(json.dumps({"question": item["question"], "answer": item["answer"],
                                  "metadata": item.get("metadata", {})}, default=str))


def _demo_answer(gold: str, answer: str, steps: str = "") -> str:
    final = f"<answer>{gold}</answer>" if answer == "tags" else f"The answer is {gold}."
    return f"{steps} {final}" if steps else final


@functools.lru_cache(maxsize=None)
def scorer(task: str):
    """``score_answer(answer, entry) -> float`` of ``task`` (a default-config instance: the
    scorers read what they need from the entry)."""
    return _rg().get_score_answer_fn(task)


def generate(source: str) -> list[dict]:
    """The rows of ``source`` (see the module doc)."""
    spec = parse(source)
    rows = []
    for task in spec.tasks:
        opts = spec.options[task]
        domain = DOMAIN_PREFIX + task + (f"@{spec.level}" if spec.level else "")
        shots = []
        for _, demo in _items(task, opts, DEMO_SEED, "demo", spec.shots):
            steps = worked_steps(task, _entry(demo)) if spec.worked else ""
            shots += [{"role": "user", "content": demo["question"]},
                      {"role": "assistant", "content": _demo_answer(str(demo["answer"]), spec.answer, steps)}]
        score = scorer(task)
        for idx, item in _items(task, opts, spec.seed, spec.split, spec.n, spec.max_share):
            entry = _entry(item)
            gold = str(item["answer"])
            if score(gold, entry) < 1.0:
                raise ValueError(f"reasoning-gym:{task}: its scorer gives the gold answer {gold!r} "
                                 f"{score(gold, entry)} once the item is stored as JSON; this task is not supported")
            rows.append({"id": f"{domain}:{spec.seed}:{idx}", "domain": domain, "answer": gold,
                         "prompt": [{"role": "system", "content": SYSTEM_PROMPTS[spec.answer]}, *shots,
                                    {"role": "user", "content": item["question"]}],
                         "meta": {"task": task, "entry": entry, "answer_format": spec.answer}})
    return rows
