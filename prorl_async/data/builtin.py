r"""Built-in multi-domain tasks, procedurally generated offline (no download), deterministic by seed.

One generator per domain of ProRL's training mix (math, code, STEM, logic, instruction
following; Liu et al. 2025, Sec. 3), small enough for CPU runs and tests, each with a gold
answer the domain's verifier in :mod:`prorl_async.rewards` checks exactly:

* ``math``: fraction arithmetic, linear equations, word problems, percentages, modular
  powers, quadratic roots as a set, square-root simplification; answers in LaTeX.
* ``code``: small stdin/stdout programs (filtered sums, word reversal, vowel counts, maximum
  subarray, FizzBuzz variants) and function-call tasks, tests computed by a reference solution.
* ``stem``: multiple choice (kinematics, density, molar mass) and numeric (Ohm's law, kinetic
  energy, unit conversion) questions.
* ``logic``: countdown / 24 game, graph colouring, knights and knaves
  (:mod:`prorl_async.rewards.logic`).
* ``instruction``: a writing task with 2-3 IFEval-style constraints from compatible groups.

Splits: every problem is assigned to ``train`` or ``eval`` by a stable hash of its prompt
(20 % eval), so the two splits never share a prompt whatever the seeds; generation rejects
problems of the other split. Rows may repeat within a split when ``n`` is large.

``generate(name, n, seed, split)`` with ``name`` one of :data:`GENERATORS` or
``"multidomain"`` (domains interleaved in a fixed order), or a :data:`STANDALONE` task
(``chat-arith``: :mod:`prorl_async.data.chat_arith`, for a chat model).
"""

from __future__ import annotations

import hashlib
import random
from fractions import Fraction
from typing import Callable

from prorl_async.rewards import logic

EVAL_FRACTION = 0.2
BOX = "Put the final answer in \\boxed{}."


def split_of(prompt: str) -> str:
    """``"eval"`` for EVAL_FRACTION of all prompts, by a stable hash of the text; else ``"train"``."""
    h = int(hashlib.sha1(prompt.encode()).hexdigest()[:8], 16)
    return "eval" if (h % 1000) < EVAL_FRACTION * 1000 else "train"


def _latex_fraction(q: Fraction) -> str:
    if q.denominator == 1:
        return str(q.numerator)
    sign = "-" if q < 0 else ""
    return f"{sign}\\frac{{{abs(q.numerator)}}}{{{q.denominator}}}"


# ---------------------------------------------------------------------------------------------
# math


def _math_fraction(rng):
    a, b, c, d = (rng.randint(1, 12) for _ in range(4))
    op = rng.choice(["+", "-", "\\times"])
    x, y = Fraction(a, b + 1), Fraction(c, d + 1)
    val = x + y if op == "+" else x - y if op == "-" else x * y
    return (f"Compute $\\frac{{{a}}}{{{b + 1}}} {op} \\frac{{{c}}}{{{d + 1}}}$ and give the result "
            f"as a fraction in lowest terms. {BOX}"), _latex_fraction(val)


def _math_linear(rng):
    a = rng.choice([k for k in range(-9, 10) if k not in (0, 1)])
    x = Fraction(rng.randint(-20, 20), rng.choice([1, 1, 1, 2, 3]))
    b = rng.randint(-30, 30)
    c = a * x + b
    bs = f"+ {b}" if b >= 0 else f"- {-b}"
    return (f"Solve for $x$: ${a}x {bs} = {_latex_fraction(c)}$. {BOX}"), _latex_fraction(x)


def _math_word(rng):
    item, other = rng.sample(["notebooks", "pens", "apples", "tickets", "stamps", "mugs"], 2)
    pa, pb, qa, qb = rng.randint(2, 15), rng.randint(1, 9), rng.randint(2, 12), rng.randint(1, 20)
    name = rng.choice(["Sam", "Ana", "Li", "Omar", "Priya", "Jon"])
    return (f"A shop sells {item} for ${pa} each and {other} for ${pb} each. {name} buys {qa} "
            f"{item} and {qb} {other}. How many dollars does {name} spend in total? {BOX}"), \
        str(pa * qa + pb * qb)


def _math_percent(rng):
    p, n = rng.choice([5, 10, 12, 15, 20, 25, 30, 40, 45, 60, 75, 80]), rng.randint(2, 80) * 10
    val = Fraction(p * n, 100)
    ans = str(val.numerator) if val.denominator == 1 else str(float(val))
    return f"What is ${p}\\%$ of ${n}$? {BOX}", ans


def _math_modpow(rng):
    a, k, m = rng.randint(2, 20), rng.randint(5, 60), rng.randint(3, 23)
    return f"What is the remainder when ${a}^{{{k}}}$ is divided by ${m}$? {BOX}", str(pow(a, k, m))


def _math_quadratic(rng):
    r1, r2 = rng.sample(range(-9, 10), 2)
    s, p = r1 + r2, r1 * r2
    bs = "" if s == 0 else (f"- {s}x " if s > 0 else f"+ {-s}x ")
    ps = f"+ {p}" if p >= 0 else f"- {-p}"
    return (f"Find all real solutions of $x^2 {bs}{ps} = 0$. Give them as a set, e.g. "
            f"$\\{{a, b\\}}$. {BOX}"), f"\\{{{min(r1, r2)}, {max(r1, r2)}\\}}"


def _math_sqrt(rng):
    a, b = rng.randint(2, 9), rng.choice([2, 3, 5, 6, 7, 10, 11])
    return f"Simplify $\\sqrt{{{a * a * b}}}$. {BOX}", f"{a}\\sqrt{{{b}}}"


def gen_math(rng):
    prompt, answer = rng.choice([_math_fraction, _math_linear, _math_word, _math_percent,
                                 _math_modpow, _math_quadratic, _math_sqrt])(rng)
    return {"prompt": prompt, "answer": answer}


# ---------------------------------------------------------------------------------------------
# code

CODE_SUFFIX = ("Read from standard input and write to standard output. "
               "Answer with a complete Python program in a ```python code block.")


def _ints(rng, n, lo=-50, hi=50):
    return [rng.randint(lo, hi) for _ in range(n)]


def _code_filtered_sum(rng):
    k = rng.randint(2, 7)
    prompt = (f"The first line holds n; the second line holds n integers. Print the sum of the "
              f"integers that are divisible by {k}. {CODE_SUFFIX}")

    def case(r):
        xs = _ints(r, r.randint(1, 12))
        return f"{len(xs)}\n{' '.join(map(str, xs))}\n", f"{sum(x for x in xs if x % k == 0)}\n"
    return prompt, case, {"task": "filtered_sum", "k": k}


def _code_reverse_words(rng):
    sep = rng.choice([" ", "-"])
    shown = "a space" if sep == " " else "a hyphen"
    prompt = (f"The input is one line of words separated by single spaces. Print the words in "
              f"reverse order, joined by {shown}. {CODE_SUFFIX}")
    vocab = ["red", "blue", "cat", "sky", "tree", "stone", "river", "light", "a", "zebra"]

    def case(r):
        ws = [r.choice(vocab) for _ in range(r.randint(1, 8))]
        return " ".join(ws) + "\n", sep.join(reversed(ws)) + "\n"
    return prompt, case, {"task": "reverse_words", "sep": sep}


def _code_vowels(rng):
    letters = rng.choice(["aeiou", "aeiouy"])
    prompt = (f"The first line holds t; each of the next t lines holds a lowercase word. For each "
              f"word print how many of its letters are in \"{letters}\". {CODE_SUFFIX}")

    def case(r):
        ws = ["".join(r.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(r.randint(1, 10)))
              for _ in range(r.randint(1, 5))]
        out = "\n".join(str(sum(ch in letters for ch in w)) for w in ws)
        return f"{len(ws)}\n" + "\n".join(ws) + "\n", out + "\n"
    return prompt, case, {"task": "vowels", "letters": letters}


def _code_max_subarray(rng):
    prompt = ("The first line holds n; the second holds n integers. Print the largest sum of a "
              f"non-empty contiguous subarray. {CODE_SUFFIX}")

    def case(r):
        xs = _ints(r, r.randint(1, 12), -20, 20)
        best = cur = xs[0]
        for x in xs[1:]:
            cur = max(x, cur + x)
            best = max(best, cur)
        return f"{len(xs)}\n{' '.join(map(str, xs))}\n", f"{best}\n"
    return prompt, case, {"task": "max_subarray"}


def _code_fizzbuzz(rng):
    a, b = rng.sample([2, 3, 4, 5, 7], 2)
    wa, wb = rng.sample(["Fizz", "Buzz", "Bang", "Pop"], 2)
    prompt = (f"Given n on one line, print the numbers 1 to n, one per line, but print {wa} for "
              f"multiples of {a}, {wb} for multiples of {b}, and {wa}{wb} for multiples of both. "
              f"{CODE_SUFFIX}")

    def case(r):
        n = r.randint(1, 30)
        out = []
        for i in range(1, n + 1):
            s = (wa if i % a == 0 else "") + (wb if i % b == 0 else "")
            out.append(s or str(i))
        return f"{n}\n", "\n".join(out) + "\n"
    return prompt, case, {"task": "fizzbuzz", "a": a, "b": b, "wa": wa, "wb": wb}


def _code_rotate_fn(rng):
    direction = rng.choice(["left", "right"])
    prompt = (f"Write a Python function `rotate(nums, k)` that returns the list `nums` rotated "
              f"{direction} by `k` positions (k may exceed the length; an empty list stays empty). "
              "Answer with the function in a ```python code block.")

    def case(r):
        xs = _ints(r, r.randint(0, 8), 0, 9)
        k = r.randint(0, 12)
        if not xs:
            return {"fn_name": "rotate", "args": [xs, k], "expected": []}
        s = k % len(xs)
        exp = xs[s:] + xs[:s] if direction == "left" else xs[len(xs) - s:] + xs[:len(xs) - s]
        return {"fn_name": "rotate", "args": [xs, k], "expected": exp}
    return prompt, case, {"task": "rotate", "direction": direction}


def gen_code(rng):
    make = rng.choice([_code_filtered_sum, _code_reverse_words, _code_vowels, _code_max_subarray,
                       _code_fizzbuzz, _code_rotate_fn])
    prompt, case, meta = make(rng)
    tests = []
    for _ in range(5):
        c = case(rng)
        tests.append(c if isinstance(c, dict) else {"input": c[0], "output": c[1]})
    return {"prompt": prompt, "tests": tests, "meta": meta}


# ---------------------------------------------------------------------------------------------
# stem

ATOMIC_MASS = {"H": 1.008, "C": 12.011, "N": 14.007, "O": 15.999, "Na": 22.990, "Cl": 35.45,
               "S": 32.06, "Ca": 40.078}
COMPOUNDS = {"H2O": {"H": 2, "O": 1}, "CO2": {"C": 1, "O": 2}, "NaCl": {"Na": 1, "Cl": 1},
             "CH4": {"C": 1, "H": 4}, "NH3": {"N": 1, "H": 3}, "H2SO4": {"H": 2, "S": 1, "O": 4},
             "CaCO3": {"Ca": 1, "C": 1, "O": 3}, "C2H6O": {"C": 2, "H": 6, "O": 1}}


def _fmt(x: float) -> str:
    return f"{x:.4g}"


def _mc(rng, question, correct, distractors, unit):
    opts = [correct] + [d for d in distractors if abs(d - correct) > 1e-9 * max(1, abs(correct))]
    opts = list(dict.fromkeys(_fmt(o) for o in opts))[:4]
    while len(opts) < 4:
        opts.append(_fmt(correct * rng.choice([0.5, 1.5, 3, 0.25]) + len(opts)))
        opts = list(dict.fromkeys(opts))
    texts = [f"{o} {unit}".strip() for o in opts]
    order = list(range(len(texts)))
    rng.shuffle(order)
    choices = [texts[i] for i in order]
    letter = "ABCD"[order.index(0)]
    listing = " ".join(f"({'ABCD'[i]}) {c}" for i, c in enumerate(choices))
    prompt = f"{question} {listing} Answer with the letter of the correct option in \\boxed{{}}."
    return {"prompt": prompt, "answer": letter, "choices": choices}


def _stem_speed(rng):
    d, t = rng.randint(20, 400), rng.choice([0.5, 1, 1.5, 2, 2.5, 3, 4, 5])
    return _mc(rng, f"A car travels {d} km in {t} h. What is its average speed?",
               d / t, [d * t, t / d * 100, d / (2 * t)], "km/h")


def _stem_density(rng):
    m, v = rng.randint(10, 500), rng.randint(5, 200)
    return _mc(rng, f"An object has a mass of {m} g and a volume of {v} cm^3. What is its density?",
               m / v, [v / m, m * v / 100, m / v * 2], "g/cm^3")


def _stem_molar(rng):
    name = rng.choice(sorted(COMPOUNDS))
    mass = sum(ATOMIC_MASS[e] * k for e, k in COMPOUNDS[name].items())
    return _mc(rng, f"What is the molar mass of {name} (H 1.008, C 12.011, N 14.007, O 15.999, "
                    f"Na 22.990, Cl 35.45, S 32.06, Ca 40.078)?",
               mass, [mass - ATOMIC_MASS["O"], mass + ATOMIC_MASS["H"] * 2, mass * 2], "g/mol")


def _stem_ohm(rng):
    v, r = rng.randint(1, 240), rng.choice([2, 4, 5, 8, 10, 20, 47, 100, 220])
    return {"prompt": f"A {v} V source drives a {r} ohm resistor. What current flows, in amperes? "
                      f"{BOX}", "answer": _fmt(v / r)}


def _stem_kinetic(rng):
    m, v = rng.randint(1, 2000), rng.randint(1, 40)
    return {"prompt": f"What is the kinetic energy, in joules, of a {m} kg mass moving at {v} m/s? "
                      f"{BOX}", "answer": str(m * v * v / 2)}


def _stem_convert(rng):
    kmh = rng.randint(5, 300)
    return {"prompt": f"Convert {kmh} km/h to m/s. {BOX}", "answer": _fmt(kmh / 3.6)}


def gen_stem(rng):
    return rng.choice([_stem_speed, _stem_density, _stem_molar, _stem_ohm, _stem_kinetic,
                       _stem_convert])(rng)


# ---------------------------------------------------------------------------------------------
# logic


def gen_logic(rng):
    family = rng.choice(sorted(logic.FAMILIES))
    prompt, answer, meta = logic.FAMILIES[family][0](rng)
    return {"prompt": prompt, "answer": answer, "meta": meta}


# ---------------------------------------------------------------------------------------------
# instruction following

TOPICS = ["a city park in autumn", "the history of the bicycle", "how bees make honey",
          "a rainy day at the beach", "why people keep houseplants", "the first day at a new job",
          "a train journey through mountains", "learning to cook rice", "the night sky",
          "an old lighthouse", "a community garden", "the life of a river", "a lost umbrella",
          "morning routines", "a small bakery", "migrating birds"]
KEYWORDS = ["light", "green", "water", "quiet", "morning", "history", "friend", "stone", "wind",
            "simple", "warm", "journey"]


def _describe(c: dict) -> str:
    t, kw = c["type"], c.get("kwargs", {})
    return {
        "word_count": lambda: f"Use {kw.get('relation')} {kw.get('num')} words.",
        "sentence_count": lambda: f"Write {kw.get('relation')} {kw.get('num')} sentences.",
        "paragraph_count": lambda: f"Write exactly {kw.get('num')} paragraphs separated by blank lines.",
        "keywords_include": lambda: f"Include the words {', '.join(kw.get('keywords', []))}.",
        "keywords_exclude": lambda: f"Do not use the words {', '.join(kw.get('keywords', []))}.",
        "keyword_frequency": lambda: f"Use the word \"{kw.get('keyword')}\" {kw.get('relation')} {kw.get('num')} times.",
        "json_format": lambda: "Wrap the entire output in JSON format.",
        "bullet_count": lambda: f"Answer with exactly {kw.get('num')} markdown bullet points (\"* \").",
        "start_with": lambda: f"Start your response with \"{kw.get('phrase')}\".",
        "end_with": lambda: f"End your response with the exact phrase \"{kw.get('phrase')}\".",
        "postscript": lambda: f"Add a postscript starting with {kw.get('marker')} at the end.",
        "title": lambda: "Give it a title wrapped in double angular brackets, like <<title>>.",
        "all_lowercase": lambda: "Write everything in lowercase letters; no capital letters at all.",
        "all_uppercase": lambda: "Write everything in capital letters.",
        "no_commas": lambda: "Do not use any commas.",
        "quotation": lambda: "Wrap your entire response in double quotation marks.",
    }[t]()


def gen_instruction(rng):
    topic = rng.choice(TOPICS)
    case = rng.choice([None, None, "all_lowercase", "all_uppercase"])
    fmt = rng.choice([None, "paragraph_count", "bullet_count", "json_format", "quotation"])
    constraints = []
    if case:
        constraints.append({"type": case, "kwargs": {}})
    if fmt == "paragraph_count":
        constraints.append({"type": fmt, "kwargs": {"num": rng.randint(2, 4)}})
    elif fmt == "bullet_count":
        constraints.append({"type": fmt, "kwargs": {"num": rng.randint(2, 5)}})
    elif fmt:
        constraints.append({"type": fmt, "kwargs": {}})
    lexical = rng.sample(["word_count", "sentence_count", "keywords_include", "keywords_exclude",
                          "keyword_frequency", "no_commas"], rng.randint(1, 2))
    if fmt is None:
        lexical += rng.sample(["start_with", "end_with", "postscript", "title"], 1)
    words = rng.sample(KEYWORDS, 3)
    for t in lexical:
        if t in ("word_count", "sentence_count"):
            rel = rng.choice(["at least", "at most"])
            num = rng.choice([40, 60, 80, 120]) if t == "word_count" else rng.randint(2, 8)
            kwargs = {"relation": rel, "num": num}
        elif t == "keywords_include":
            kwargs = {"keywords": words[:2]}
        elif t == "keywords_exclude":
            kwargs = {"keywords": [words[2]]}
        elif t == "keyword_frequency":
            kwargs = {"keyword": words[0], "relation": "at least", "num": rng.randint(2, 3)}
        elif t == "start_with":
            phrase = rng.choice(["Here is", "Imagine", "Today", "Once"])
            kwargs = {"phrase": phrase.lower() if case == "all_lowercase" else
                      phrase.upper() if case == "all_uppercase" else phrase}
        elif t == "end_with":
            phrase = rng.choice(["Is there anything else I can help with?", "That is all.",
                                 "Thank you for reading."])
            kwargs = {"phrase": phrase.lower() if case == "all_lowercase" else
                      phrase.upper() if case == "all_uppercase" else phrase}
        elif t == "postscript":
            kwargs = {"marker": "p.s." if case == "all_lowercase" else "P.S."}
        else:
            kwargs = {}
        constraints.append({"type": t, "kwargs": kwargs})
    prompt = f"Write about {topic}. " + " ".join(_describe(c) for c in constraints)
    return {"prompt": prompt, "constraints": constraints}


# ---------------------------------------------------------------------------------------------

GENERATORS: dict[str, Callable[[random.Random], dict]] = {
    "math": gen_math, "code": gen_code, "stem": gen_stem, "logic": gen_logic,
    "instruction": gen_instruction,
}


#: built-in tasks with a module of their own (``generate(n, seed, split)``), e.g. for a chat model
STANDALONE: dict[str, str] = {"chat-arith": "prorl_async.data.chat_arith"}


def generate(name: str, n: int, seed: int = 0, split: str = "train") -> list[dict]:
    """``n`` rows of built-in task ``name`` (a domain, or ``multidomain``) for ``split``."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if name in STANDALONE:  # tasks with their own generator and verifier, not in the multidomain mix
        import importlib

        return importlib.import_module(STANDALONE[name]).generate(n, seed, split)
    if name == "multidomain":
        domains = list(GENERATORS)
    elif name in GENERATORS:
        domains = [name]
    else:
        raise ValueError(f"unknown built-in task {name!r}; known: {['multidomain', *GENERATORS, *STANDALONE]}")
    rngs = {d: random.Random(f"builtin-{d}-{seed}-{split}") for d in domains}
    rows = []
    for i in range(n):
        domain = domains[i % len(domains)]
        for _attempt in range(10_000):
            row = GENERATORS[domain](rngs[domain])
            if split_of(row["prompt"]) == split:
                break
        else:  # pragma: no cover -- the generators have far more than 5 prompts per split
            raise RuntimeError(f"built-in {domain} generator cannot produce {split} problems")
        rows.append({"id": f"{domain}-{split}-{seed}-{i}", "domain": domain, **row})
    return rows
