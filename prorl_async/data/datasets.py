"""Dataset loading with schema validation, built-in task sources, and weighted domain mixing.

Rows (DESIGN.md, "Dataset rows"): ``id`` (str, unique in the source), ``domain`` (a key of
:data:`prorl_async.rewards.VERIFIERS`), ``prompt`` (a string, or chat messages
``[{"role": str, "content": str}, ...]``), what the domain's verifier needs (``answer`` for
math / logic / stem / arithmetic, ``tests`` for code, ``constraints`` for instruction), and a
free ``meta`` object. Columns ``tests``, ``constraints``, ``meta`` and ``choices`` may also be
JSON strings (convenient in Parquet), which are decoded.

``load_rows(source)`` reads a ``.jsonl``/``.json`` (one object per line) or ``.parquet`` file,
or a built-in source ``builtin:<name>?n=<int>&seed=<int>&split=<train|eval>`` (``name`` is
``arithmetic`` — :mod:`prorl_async.data.arithmetic` — or one of
:mod:`prorl_async.data.builtin`'s: ``multidomain``, ``math``, ``code``, ``stem``, ``logic``,
``instruction``; or ``humaneval``, the 164 HumanEval problems of
:mod:`prorl_async.data.humaneval`), or a Reasoning Gym source ``reasoning-gym:TASK[+TASK...]?...``
(:mod:`prorl_async.data.reasoning_gym`). Several sources joined by ``;`` are their rows in turn
(e.g. the easy and the harder levels of a held-out set). A row that does not match the schema is reported with its line (JSONL) or
row (Parquet) number, 1-based, and the reason: skipped with one warning that lists them and
their count, or, with ``strict=True``, a ValueError naming the file, the line and the reason.
Built-in sources are always validated strictly (a bad generated row is a bug).

Files in the layouts of other frameworks load the same way (:mod:`prorl_async.data.layouts`):
verl parquet rows (``data_source``, chat ``prompt``, ``ability``, ``reward_model:
{style, ground_truth}``, ``extra_info``) are detected and converted; ``input_key`` /
``label_key`` (``data.input_key`` / ``data.label_key``) map OpenRLHF-style columns; ``domain``
(``data.domain``) sets the domain of every row of a file. :func:`load_source` passes a run's
``DataConfig`` settings.

``mix(sources, weights, n, seed)`` draws a deterministic weighted mixture of domains.
"""

from __future__ import annotations

import json
import logging
import os
import random
import warnings
from urllib.parse import parse_qs, urlsplit

from prorl_async.data import layouts

logger = logging.getLogger(__name__)

NEEDS = {"math": "answer", "logic": "answer", "stem": "answer", "arithmetic": "answer", "chat-arith": "answer",
         "code": "tests", "instruction": "constraints", "rg": "answer"}  # by verifier (rewards.verifier_domain)
_JSON_COLUMNS = ("tests", "constraints", "meta", "choices")
_MAX_LISTED = 20


def load_source(source: str, data) -> list[dict]:
    """Rows of ``source`` with a run's data settings (a :class:`~prorl_async.config.DataConfig`)."""
    return load_rows(source, strict=data.strict, input_key=data.input_key, label_key=data.label_key,
                     domain=data.domain)


def load_rows(source: str, strict: bool = False, *, input_key: str = "", label_key: str = "",
              domain: str = "") -> list[dict]:
    """Rows of ``source`` (a file path or a ``builtin:`` source), validated; see the module doc.

    ``input_key``, ``label_key`` and ``domain`` apply to files only (:mod:`.layouts`).
    """
    if ";" in source:
        rows = [row for part in source.split(";") if part.strip()
                for row in load_rows(part.strip(), strict, input_key=input_key, label_key=label_key, domain=domain)]
        good, bad = validate_rows(rows, unit="row")  # ids unique across the parts too
        if bad:
            raise ValueError(f"{source}: row {bad[0][0]}: {bad[0][1]}")
        return good
    if source.startswith("reasoning-gym:"):
        from prorl_async.data import reasoning_gym

        rows = reasoning_gym.generate(source)
        good, bad = validate_rows(rows, unit="row")
        if bad:
            raise ValueError(f"{source}: row {bad[0][0]}: {bad[0][1]}")
        return good
    if source.startswith("builtin:"):
        rows = _builtin(source)
        good, bad = validate_rows(rows, unit="row")
        if bad:
            where, reason = bad[0]
            raise ValueError(f"{source}: row {where}: {reason}")
        return good
    if not os.path.exists(source):
        raise FileNotFoundError(f"dataset not found: {source}")
    lower = source.lower()
    if lower.endswith(".parquet") or lower.endswith(".pq"):
        numbered, unit = _read_parquet(source), "row"
    elif lower.endswith(".jsonl") or lower.endswith(".json"):
        numbered, unit = _read_jsonl(source), "line"
    else:
        raise ValueError(f"{source}: unknown dataset format; use .jsonl, .parquet or builtin:<name>")
    numbered = layouts.normalize(numbered, source, input_key=input_key, label_key=label_key, domain=domain)
    good, bad = validate_rows(numbered, unit=unit)
    if bad:
        if strict:
            where, reason = bad[0]
            raise ValueError(f"{source}: {unit} {where}: {reason}")
        listed = "; ".join(f"{unit} {w}: {r}" for w, r in bad[:_MAX_LISTED])
        more = f"; ... and {len(bad) - _MAX_LISTED} more" if len(bad) > _MAX_LISTED else ""
        msg = f"{source}: skipped {len(bad)} bad row(s) of {len(good) + len(bad)}: {listed}{more}"
        warnings.warn(msg, stacklevel=2)
        logger.warning(msg)
    return good


def validate_rows(rows, unit: str = "row") -> tuple[list[dict], list[tuple[int, str]]]:
    """(good rows, [(1-based position, reason), ...]).

    ``rows`` is a list of dicts, or of ``(position, dict | Exception)`` pairs from a reader.
    """
    from prorl_async.rewards import VERIFIERS, verifier_domain

    good, bad, seen = [], [], set()
    for k, item in enumerate(rows):
        where, row = item if isinstance(item, tuple) else (k + 1, item)
        if isinstance(row, Exception):
            bad.append((where, str(row)))
            continue
        reason = _row_problem(row, VERIFIERS, verifier_domain)
        if reason is None and row["id"] in seen:
            reason = f"duplicate id {row['id']!r}"
        if reason is not None:
            bad.append((where, reason))
            continue
        seen.add(row["id"])
        good.append(row)
    return good, bad


def _row_problem(row, verifiers, verifier_domain) -> str | None:
    if not isinstance(row, dict):
        return f"a row must be an object, got {type(row).__name__}"
    for col in _JSON_COLUMNS:
        if isinstance(row.get(col), str) and (col != "choices" or row[col].lstrip().startswith("[")):
            try:
                row[col] = json.loads(row[col])
            except ValueError as e:
                return f"{col} is a string but not valid JSON ({e})"
    rid = row.get("id")
    if not isinstance(rid, str) or not rid:
        return "missing id (a non-empty string)"
    domain = row.get("domain")
    family = verifier_domain(domain)
    if family is None:
        return f"unknown domain {domain!r}; known: {sorted(verifiers)}"
    prompt = row.get("prompt")
    if isinstance(prompt, list):
        if not prompt or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                 and isinstance(m.get("content"), str) for m in prompt):
            return "prompt messages must be a non-empty list of {role: str, content: str}"
    elif not isinstance(prompt, str) or not prompt:
        return "missing prompt (a non-empty string or a list of messages)"
    if "meta" in row and row["meta"] is not None and not isinstance(row["meta"], dict):
        return "meta must be an object"
    need = NEEDS.get(family)
    if need == "answer":
        ans = row.get("answer")
        if ans is None or isinstance(ans, bool) or not isinstance(ans, (str, int, float)) \
                or (isinstance(ans, str) and not ans.strip()):
            return f"domain {domain} needs a non-empty answer"
    elif need == "tests":
        from prorl_async.rewards.code import to_cases

        row["tests"] = _drop_absent_test_keys(row.get("tests"))
        _, problem = to_cases(row["tests"])
        if problem:
            return f"bad tests: {problem}"
    elif need == "constraints":
        from prorl_async.rewards.instruction import CHECKERS

        cons = row.get("constraints")
        if not isinstance(cons, list) or not cons:
            return "domain instruction needs a non-empty constraints list"
        for c in cons:
            if not isinstance(c, dict) or not isinstance(c.get("type"), str):
                return "each constraint needs a string type"
            if c["type"] not in CHECKERS:
                return f"unknown constraint type {c['type']!r}"
            if c.get("kwargs") is not None and not isinstance(c["kwargs"], dict):
                return f"constraint {c['type']}: kwargs must be an object"
    return None


def _drop_absent_test_keys(tests):
    """Parquet stores structs with every field; drop the other case form's nulls."""
    if isinstance(tests, dict):  # the HumanEval / MBPP forms
        return {k: v for k, v in tests.items() if v is not None}
    if not isinstance(tests, list):
        return tests
    out = []
    for t in tests:
        if isinstance(t, dict):
            t = dict(t)
            form = ("input", "output") if t.get("fn_name") is not None else ("fn_name", "args", "expected")
            for key in form:
                if key in t and t[key] is None:
                    del t[key]
        out.append(t)
    return out


def _read_jsonl(path: str) -> list[tuple[int, object]]:
    out = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                out.append((lineno, json.loads(line)))
            except ValueError as e:
                out.append((lineno, ValueError(f"invalid JSON ({e})")))
    return out


def _read_parquet(path: str) -> list[tuple[int, object]]:
    import pyarrow.parquet as pq

    rows = pq.read_table(path).to_pylist()
    for row in rows:  # Parquet has no "absent" field: a null there means the key was absent
        for key in [k for k, v in row.items() if v is None]:
            del row[key]
    return [(k + 1, row) for k, row in enumerate(rows)]


# ---------------------------------------------------------------------------------------------


def parse_builtin(source: str) -> tuple[str, int, int, str]:
    """``builtin:<name>?n=..&seed=..&split=..`` -> (name, n, seed, split); defaults 1000, 0, train."""
    parts = urlsplit(source)
    name = parts.path
    query = parse_qs(parts.query, keep_blank_values=True, strict_parsing=False)
    unknown = sorted(set(query) - {"n", "seed", "split"})
    if unknown:
        raise ValueError(f"{source}: unknown parameter(s) {unknown}; use n, seed, split")
    try:
        n = int(query.get("n", ["1000"])[-1])
        seed = int(query.get("seed", ["0"])[-1])
    except ValueError:
        raise ValueError(f"{source}: n and seed must be integers") from None
    split = query.get("split", ["train"])[-1]
    if split not in ("train", "eval"):
        raise ValueError(f"{source}: split must be train or eval, got {split!r}")
    if n < 0:
        raise ValueError(f"{source}: n must be >= 0")
    return name, n, seed, split


def _builtin(source: str) -> list[dict]:
    name, n, seed, split = parse_builtin(source)
    if name == "humaneval":
        from prorl_async.data import humaneval

        return humaneval.generate(n)
    if name == "arithmetic":
        from prorl_async.data import arithmetic  # owned by the core task; imported lazily

        return arithmetic.generate(n, seed, split)
    from prorl_async.data import builtin

    return builtin.generate(name, n, seed, split)


def mix(sources: dict[str, list[dict]], weights: dict[str, float], n: int, seed: int) -> list[dict]:
    """``n`` rows drawn from ``sources`` in proportion to ``weights``, deterministic in ``seed``.

    Counts per source are the largest-remainder rounding of ``n * w / sum(w)``; each source is
    walked in a seeded shuffled order, cycling when it has fewer rows than its count (the
    repeats get ``"~<k>"`` appended to their id, keeping ids unique); the result is shuffled.
    Sources missing from ``weights`` (or weighted 0) are not used.
    """
    unknown = sorted(set(weights) - set(sources))
    if unknown:
        raise ValueError(f"weights for unknown source(s) {unknown}; sources: {sorted(sources)}")
    if any(w < 0 or w != w for w in weights.values()):
        raise ValueError(f"weights must be >= 0, got {weights}")
    total = sum(weights.values())
    if n > 0 and total <= 0:
        raise ValueError("at least one weight must be positive")
    names = sorted(k for k, w in weights.items() if w > 0)
    exact = {k: n * weights[k] / total for k in names} if n > 0 else {k: 0.0 for k in names}
    counts = {k: int(exact[k]) for k in names}
    by_remainder = sorted(names, key=lambda k: (-(exact[k] - counts[k]), k))
    for k in by_remainder[: n - sum(counts.values())]:
        counts[k] += 1
    out = []
    for k in names:
        if counts[k] and not sources[k]:
            raise ValueError(f"source {k!r} is empty but has weight {weights[k]}")
        rng = random.Random(f"mix-{seed}-{k}")
        order = list(range(len(sources[k])))
        rng.shuffle(order)
        for j in range(counts[k]):
            row = sources[k][order[j % len(order)]]
            lap = j // len(order)
            out.append(row if lap == 0 else {**row, "id": f"{row['id']}~{lap}"})
    random.Random(f"mix-{seed}").shuffle(out)
    return out


def load_train_rows(data) -> list[dict]:
    """The training rows of a run's ``data`` config: ``data.train``, or the weighted ``data.mix``."""
    if not data.mix:
        return load_source(data.train, data)
    sources = {e["source"]: load_source(e["source"], data) for e in data.mix}
    weights = {e["source"]: float(e["weight"]) for e in data.mix}
    return mix(sources, weights, data.mix_size, seed=data.shuffle_seed)
