"""Which evaluated policy to keep, and when to stop: ``train.keep_best`` and ``train.stop_at``.

Decisions only (a policy decides, the loop acts): the driver hands every held-out evaluation's
metrics here and writes ``best/`` or stops as told. The metrics are the held-out evaluation's
(:mod:`actors.evaluation`): ``val/pass@1`` and ``val/pass@K`` (K = ``train.eval_samples``), each
also per domain as ``val/pass@1/<domain>``. ``val/greedy/pass@1`` is measured only before and
after training, so it cannot pick a step. Pure: no Ray.
"""

from __future__ import annotations

import operator
import re
from dataclasses import asdict, dataclass
from typing import Optional

MODES = ("max", "min")
_METRIC = re.compile(r"^val/pass@(\d+)(/[A-Za-z0-9_.:@-]+)?$")
_STOP = re.compile(r"^\s*(\S+?)\s*(>=|<=|>|<)\s*([-+0-9.eE]+)\s*$")
_OPS = {">=": operator.ge, "<=": operator.le, ">": operator.gt, "<": operator.lt}


def check_metric(name: str, eval_samples: int) -> None:
    """``name`` must be a metric every periodic evaluation logs; ValueError says which ones do.
    A per-domain name (``val/pass@1/<domain>``) is checked against the evaluation's domains at
    the first evaluation (:func:`require_logged`)."""
    logged = f"val/pass@1 or val/pass@{eval_samples} (train.eval_samples), or either with /<domain>"
    if name.startswith("val/greedy/"):
        raise ValueError(f"{name!r} is measured only before and after training, not at the periodic "
                         f"evaluations; use {logged}")
    m = _METRIC.match(name)
    if m is None or int(m.group(1)) not in (1, eval_samples):
        raise ValueError(f"{name!r} is not a metric the periodic evaluation logs; use {logged}")


def require_logged(name: str, val: dict, key: str) -> None:
    """At an evaluation: ``name`` (the value of config key ``key``) is among its metrics."""
    if name not in val:
        logged = ", ".join(k for k in sorted(val) if k.startswith("val/pass@"))
        raise ValueError(f"{key}: the held-out evaluation logs no {name!r} (its domains come from data.eval); "
                         f"it logs {logged}")


@dataclass(frozen=True)
class StopRule:
    """``train.stop_at``: stop once ``metric op threshold`` holds at an evaluation."""
    metric: str
    op: str
    threshold: float

    def reached(self, val: dict) -> bool:
        return _OPS[self.op](val[self.metric], self.threshold)

    def reason(self, val: dict, step: int) -> str:
        return (f"{self.metric} {val[self.metric]:.3f} {self.op} {self.threshold:g} at step {step} "
                f"(train.stop_at={self})")

    def __str__(self) -> str:
        return f"{self.metric}{self.op}{self.threshold:g}"


def parse_stop_at(text: str, eval_samples: int) -> Optional[StopRule]:
    """``"val/pass@1>=0.9"`` -> :class:`StopRule`; ``""`` -> None; ValueError naming the form."""
    if not text:
        return None
    m = _STOP.match(text)
    if m is None:
        raise ValueError(f"{text!r} is not METRIC OP NUMBER with OP one of >=, <=, >, < "
                         f"(e.g. train.stop_at='val/pass@1>=0.9')")
    try:
        threshold = float(m.group(3))
    except ValueError:
        raise ValueError(f"{text!r}: {m.group(3)!r} is not a number (e.g. train.stop_at='val/pass@1>=0.9')") from None
    check_metric(m.group(1), eval_samples)
    return StopRule(m.group(1), m.group(2), threshold)


@dataclass(frozen=True)
class Best:
    """The best evaluated policy so far: what ``best/best.json`` and a checkpoint's ``driver.json`` hold."""
    metric: str
    mode: str
    step: int
    value: float

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Optional[dict]) -> Optional["Best"]:
        return cls(d["metric"], d["mode"], int(d["step"]), float(d["value"])) if d else None


def better(mode: str, value: float, than: float) -> bool:
    """Strictly better in ``mode`` (a tie keeps the earlier step)."""
    return value > than if mode == "max" else value < than


def improves(best: Optional[Best], metric: str, mode: str, value: float) -> bool:
    """Whether ``value`` of ``metric`` replaces ``best`` (none yet, another metric or mode, or better)."""
    if best is None or (best.metric, best.mode) != (metric, mode):
        return True
    return better(mode, value, best.value)


def reconcile(saved: Optional[Best], on_disk: Optional[Best], metric: str, mode: str) -> Optional[Best]:
    """At a resume: the best of the checkpoint's record and ``best/best.json`` (written after the
    checkpoint, e.g. by the final evaluation), both for this ``metric`` and ``mode``; the model in
    ``best/`` is the one ``on_disk`` describes, so a tie goes to it."""
    same = [b for b in (on_disk, saved) if b is not None and (b.metric, b.mode) == (metric, mode)]
    if not same:
        return None
    if len(same) == 2 and better(mode, same[1].value, same[0].value):
        return same[1]
    return same[0]
