"""Dataset layouts of other RL frameworks, turned into this project's rows on load.

The loader (:func:`prorl_async.data.datasets.load_rows`) reads a file's raw records and hands
them here before validation, so a user's existing files train and evaluate with no conversion
step:

* **verl** (the layout its ``examples/data_preprocess`` scripts write, e.g. GSM8K / MATH):
  ``data_source`` (str), ``prompt`` (chat messages), ``ability`` (str), ``reward_model:
  {style, ground_truth}``, ``extra_info`` (free). Detected per record by a ``reward_model``
  object and no ``domain``. ``reward_model.ground_truth`` is the label; the domain is
  ``data.domain`` if set, else ``ability`` when it names a domain (``coding`` -> ``code``),
  else guessed from ``data_source`` (GSM8K, MATH, AIME, AMC, NuminaMath, DAPO, DeepScaleR ...
  -> ``math``; APPS, TACO, CodeContests, LiveCodeBench, LeetCode, HumanEval, MBPP -> ``code``;
  IFEval -> ``instruction``; GPQA, SciQ -> ``stem``; SynLogic, Countdown -> ``logic``). The id
  is ``<data_source>-<record number>``; ``data_source``, ``ability``, ``reward_model.style``
  and ``extra_info`` go to ``meta``.
* **key mapping** (OpenRLHF's ``--input_key`` / ``--label_key``): with ``data.input_key`` and
  ``data.label_key`` set, every record's prompt is ``record[input_key]`` and its label
  ``record[label_key]`` (a dotted key such as ``reward_model.ground_truth`` reaches into a
  nested object); the domain is ``data.domain``, else the record's own ``domain``. The id is
  the record's ``id`` when it has one, else ``<file stem>-<record number>``. A key that is in
  no record of the file is one error naming the key, the file, the columns it has and the
  setting to change.

The label becomes the field the domain's verifier reads (``answer``; ``tests`` for code;
``constraints`` for instruction). A code label may be a JSON string; the APPS / PRIME form
``{"inputs": [...], "outputs": [...]}`` (stdin/stdout pairs) becomes a list of
``{"input", "output"}`` cases. ``data.domain``, when set, is the domain of every record of a
file, in any layout (built-in sources are never changed).
"""

from __future__ import annotations

import json
import os

# domain -> lower-case fragments of a verl ``data_source`` that name a dataset of that domain;
# tried in this order (code before math: "code_math" mixes are rare, "MathCode" names are not)
_SOURCE_HINTS = (
    ("code", ("code", "apps", "taco", "livecodebench", "leetcode", "humaneval", "mbpp", "kodcode",
              "primeintellect", "codeforces")),
    ("math", ("math", "gsm8k", "aime", "amc", "numina", "dapo", "deepscaler", "olympiad",
              "minerva", "orz", "still")),
    ("instruction", ("ifeval", "ifbench", "instruction")),
    ("stem", ("stem", "gpqa", "sciq", "scienceqa", "mmlu", "webinstruct")),
    ("logic", ("logic", "countdown", "puzzle", "knights", "sudoku", "zebra")),
)
_ABILITY_ALIASES = {"coding": "code", "codegen": "code", "programming": "code",
                    "mathematics": "math", "maths": "math", "science": "stem",
                    "instruction_following": "instruction", "if": "instruction"}
LABEL_FIELD = {"code": "tests", "instruction": "constraints"}  # every other domain: "answer"


class LayoutError(ValueError):
    """A record that cannot be turned into a row (reported with its position, like any bad row)."""


def is_verl(record) -> bool:
    return isinstance(record, dict) and isinstance(record.get("reward_model"), dict) and "domain" not in record


def verl_domain(ability, data_source, known) -> str | None:
    """The domain of a verl record, or None when neither field names one."""
    a = str(ability or "").strip().lower()
    if a in known:
        return a
    if a in _ABILITY_ALIASES:
        return _ABILITY_ALIASES[a]
    ds = str(data_source or "").lower()
    for domain, hints in _SOURCE_HINTS:
        if any(h in ds for h in hints):
            return domain
    return None


def get_key(record: dict, key: str):
    """``record[key]``, or the dotted path ``a.b`` into nested objects; KeyError when absent."""
    if key in record:
        return record[key]
    node = record
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            raise KeyError(key)
        node = node[part]
    return node


def has_key(record, key: str) -> bool:
    try:
        get_key(record, key)
        return True
    except (KeyError, TypeError):
        return False


def label_value(value, domain: str):
    """A label in the form the domain's verifier reads (see the module doc)."""
    field = LABEL_FIELD.get(domain, "answer")
    if field == "answer":
        if isinstance(value, list) and len(value) == 1:  # some sets store [answer]
            value = value[0]
        return field, value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise LayoutError(f"the {domain} label is a string but not JSON ({e})") from None
    if field == "tests" and isinstance(value, dict) and "inputs" in value and "outputs" in value:
        if value.get("fn_name"):
            raise LayoutError("APPS function-call tests (fn_name) are not converted; write "
                              "[{fn_name, args, expected}, ...] cases instead")
        ins, outs = value["inputs"], value["outputs"]
        if not isinstance(ins, list) or not isinstance(outs, list) or len(ins) != len(outs):
            raise LayoutError("APPS tests need inputs and outputs lists of the same length")
        value = [{"input": i, "output": o} for i, o in zip(ins, outs)]
    return field, value


def from_verl(record: dict, position: int, domain: str, known) -> dict:
    ds, ability = record.get("data_source"), record.get("ability")
    domain = domain or verl_domain(ability, ds, known)
    if domain is None:
        raise LayoutError(f"verl record: cannot tell the domain from ability={ability!r}, "
                          f"data_source={ds!r}; set data.domain to one of {sorted(known)}")
    rm = record["reward_model"]
    if rm.get("ground_truth") is None:
        raise LayoutError("verl record without reward_model.ground_truth")
    field, label = label_value(rm["ground_truth"], domain)
    meta = {"data_source": ds, "ability": ability, "reward_style": rm.get("style")}
    if isinstance(record.get("extra_info"), dict):
        meta["extra_info"] = record["extra_info"]
    return {"id": f"{ds or 'verl'}-{position}", "domain": domain, "prompt": record.get("prompt"),
            field: label, "meta": meta}


def from_keys(record: dict, position: int, input_key: str, label_key: str, domain: str,
              stem: str) -> dict:
    if not has_key(record, input_key):
        raise LayoutError(f"no {input_key!r} (data.input_key) in this record")
    if not has_key(record, label_key):
        raise LayoutError(f"no {label_key!r} (data.label_key) in this record")
    row = {k: v for k, v in record.items() if k not in (input_key, label_key)}
    row["domain"] = domain or record.get("domain")
    if not row["domain"]:
        raise LayoutError("no domain: set data.domain (the domain of every row), or give the records a domain column")
    row["prompt"] = get_key(record, input_key)
    field, label = label_value(get_key(record, label_key), str(row["domain"]))
    row[field] = label
    rid = record.get("id")
    row["id"] = str(rid) if isinstance(rid, (str, int)) and not isinstance(rid, bool) and str(rid) \
        else f"{stem}-{position}"
    return row


def check_keys(records: list, source: str, input_key: str, label_key: str) -> None:
    """One error when a mapped key is in no record of the file (a wrong mapping, not bad rows)."""
    dicts = [r for _, r in records if isinstance(r, dict)]
    if not dicts:
        return
    for setting, key in (("data.input_key", input_key), ("data.label_key", label_key)):
        if not any(has_key(r, key) for r in dicts):
            columns = sorted({k for r in dicts[:100] for k in r})
            raise ValueError(f"{source}: {setting}={key!r} is in no record of this file (its columns: "
                             f"{columns}); set {setting} to the column that holds the "
                             f"{'prompt' if setting == 'data.input_key' else 'answer / tests'}")


def normalize(records: list, source: str, input_key: str = "", label_key: str = "",
              domain: str = "") -> list:
    """``[(position, record | Exception)]`` of a file, each record turned into a row (or an Exception)."""
    from prorl_async.rewards import VERIFIERS

    if domain and domain not in VERIFIERS:
        raise ValueError(f"data.domain={domain!r} is not a known domain; use one of {sorted(VERIFIERS)} "
                         "(a custom domain must be registered before the data is loaded)")
    if bool(input_key) != bool(label_key):
        raise ValueError("data.input_key and data.label_key go together; set both (or neither)")
    if input_key:
        check_keys(records, source, input_key, label_key)
    stem = os.path.splitext(os.path.basename(source))[0]
    out = []
    for position, record in records:
        try:
            if not isinstance(record, dict):  # a reader error, or not an object: reported by validation
                pass
            elif input_key:
                record = from_keys(record, position, input_key, label_key, domain, stem)
            elif is_verl(record):
                record = from_verl(record, position, domain, VERIFIERS)
            elif domain:
                record = {**record, "domain": domain}
        except LayoutError as e:
            record = e
        out.append((position, record))
    return out
