"""When to reset the reference policy (and optionally the optimizer) to the current policy.

Source: ProRL (Liu et al. 2025, arXiv 2505.24864, section "Reference policy reset"):
the KL term eventually dominates the loss and stalls learning, so the reference model is
periodically hard-reset to a recent snapshot of the online policy and the optimizer state
is re-initialised; the paper resets when validation performance stalls or degrades, and
the ProRL v2 blog (NVIDIA, 2025) resets on a fixed cadence (every 200-500 steps).

This class turns those rules into one decision per step:

* ``"interval"`` -- ``step - last_reset_step >= interval`` (last reset of any cause; the
  run starts with the reference equal to the initial policy at step 0);
* ``"kl_spike"`` -- the latest KL exceeds ``kl_spike_factor`` times the mean of the previous
  ``kl_window`` KL values (checked only once that many exist since the last reset), or it
  exceeds ``kl_max``, a fixed level (checked at every step);
* ``"val_stall"`` -- ``val_patience`` validation evaluations in a row without a new best
  score (since the last reset).

Deviations / choices
--------------------
* The KL-spike trigger is an addition of this project (the paper inspects KL by eye); the
  window mean must be positive for a spike to count (a flat-zero KL right after a reset
  would otherwise make any positive value a "spike").
* ``kl_max`` is the other half of that trigger, for the KL's usual shape between resets: it
  grows steadily from 0, so a test against its own recent mean fires early, where it is
  smallest, and not on a late climb (the balanced config's tenth attempt,
  docs/prorl_in_miniature.md: a factor of 3 would have fired at steps 61 and 162, never during
  the climb to 0.5-1.4 a step over steps 176-200). A fixed level catches that climb.
* When several triggers fire in one step the cause reported is the first of
  ``interval``, ``kl_spike``, ``val_stall``; one reset is done.
* After a reset the KL history and the validation best restart, so the next evaluation
  sets a fresh best.
* Any trigger set to a value <= 0 or None is disabled.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any, Deque, Dict, Mapping, Optional

__all__ = ["RESET_CAUSES", "ReferenceResetPolicy", "reset_line"]

RESET_CAUSES = ("interval", "kl_spike", "val_stall")


def reset_line(step: int, metrics: Mapping[str, Any], optimizer: bool) -> Optional[str]:
    """The console's line for a reset among a step's (or an evaluation's) metrics
    (``ref/reset_<cause>``), else None."""
    causes = [c for c in RESET_CAUSES if metrics.get(f"ref/reset_{c}")]
    if not causes:
        return None
    what = "reference and optimizer state" if optimizer else "reference"
    return f"reference reset at step {step} ({', '.join(causes)}): the {what} restart from this step's policy"


def _enabled(x: Optional[float]) -> bool:
    return x is not None and x > 0


class ReferenceResetPolicy:
    """Decides reference resets from step count, KL history and validation scores (ProRL)."""

    def __init__(
        self,
        interval: Optional[int] = None,
        kl_spike_factor: Optional[float] = None,
        kl_window: Optional[int] = None,
        val_patience: Optional[int] = None,
        reset_optimizer: bool = False,
        kl_max: Optional[float] = None,
    ) -> None:
        self.interval = int(interval) if _enabled(interval) else 0
        spike_on = _enabled(kl_spike_factor) and _enabled(kl_window)
        self.kl_spike_factor = float(kl_spike_factor) if spike_on else 0.0
        self.kl_window = int(kl_window) if spike_on else 0
        self.kl_max = float(kl_max) if _enabled(kl_max) else 0.0
        self.val_patience = int(val_patience) if _enabled(val_patience) else 0
        self.reset_optimizer = bool(reset_optimizer)

        self.last_reset_step = 0
        self.last_step = 0
        self.last_cause: Optional[str] = None
        self.resets: Dict[str, int] = {c: 0 for c in RESET_CAUSES}
        self._kl_history: Deque[float] = deque(maxlen=max(self.kl_window, 1))
        self._val_best: Optional[float] = None
        self._val_since_best = 0

    def update(
        self, step: int, kl: Optional[float] = None, val_score: Optional[float] = None
    ) -> Optional[str]:
        """Record this step's KL / validation score; return the reset cause if a reset is due.

        The caller performs the reset (copy policy -> reference, and reset the optimizer if
        ``reset_optimizer``) when a cause is returned; this object has already restarted its
        own tracking at ``step``.
        """
        self.last_step = step
        causes = []
        if self.interval and step - self.last_reset_step >= self.interval:
            causes.append("interval")
        if kl is not None:
            kl = float(kl)
            if not math.isfinite(kl):
                raise ValueError(
                    f"ReferenceResetPolicy.update: `kl` is non-finite ({kl}) at step {step}"
                )
            if self.kl_window:
                if len(self._kl_history) == self.kl_window:
                    window_mean = sum(self._kl_history) / self.kl_window
                    if window_mean > 0 and kl > self.kl_spike_factor * window_mean:
                        causes.append("kl_spike")
                self._kl_history.append(kl)
            if self.kl_max and kl > self.kl_max and "kl_spike" not in causes:
                causes.append("kl_spike")
        if val_score is not None and self.val_patience:
            val_score = float(val_score)
            if not math.isfinite(val_score):
                raise ValueError(
                    "ReferenceResetPolicy.update: `val_score` is non-finite "
                    f"({val_score}) at step {step}"
                )
            if self._val_best is None or val_score > self._val_best:
                self._val_best = val_score
                self._val_since_best = 0
            else:
                self._val_since_best += 1
                if self._val_since_best >= self.val_patience:
                    causes.append("val_stall")
        if not causes:
            return None
        cause = causes[0]
        self.resets[cause] += 1
        self.last_cause = cause
        self.last_reset_step = step
        self._kl_history.clear()
        self._val_best = None
        self._val_since_best = 0
        return cause

    def metrics(self) -> Dict[str, float]:
        """``ref/resets_<cause>`` counts, ``ref/resets_total`` and ``ref/steps_since_reset``."""
        out = {f"ref/resets_{c}": float(n) for c, n in self.resets.items()}
        out["ref/resets_total"] = float(sum(self.resets.values()))
        out["ref/steps_since_reset"] = float(self.last_step - self.last_reset_step)
        return out

    def state_dict(self) -> Dict[str, Any]:
        return {
            "interval": self.interval,
            "kl_spike_factor": self.kl_spike_factor,
            "kl_window": self.kl_window,
            "kl_max": self.kl_max,
            "val_patience": self.val_patience,
            "reset_optimizer": self.reset_optimizer,
            "last_reset_step": self.last_reset_step,
            "last_step": self.last_step,
            "last_cause": self.last_cause,
            "resets": dict(self.resets),
            "kl_history": list(self._kl_history),
            "val_best": self._val_best,
            "val_since_best": self._val_since_best,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.__init__(
            interval=state["interval"],
            kl_spike_factor=state["kl_spike_factor"],
            kl_window=state["kl_window"],
            val_patience=state["val_patience"],
            reset_optimizer=state["reset_optimizer"],
            kl_max=state.get("kl_max", 0.0),  # a checkpoint written before kl_max existed: off, as it ran
        )
        self.last_reset_step = int(state["last_reset_step"])
        self.last_step = int(state["last_step"])
        self.last_cause = state["last_cause"]
        self.resets.update({c: int(n) for c, n in state["resets"].items()})
        self._kl_history.extend(float(x) for x in state["kl_history"])
        self._val_best = state["val_best"]
        self._val_since_best = int(state["val_since_best"])
