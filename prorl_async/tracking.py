"""Metrics: Aim (one run per training run) and a compact console line per step (bars: :mod:`prorl_async.console`).

Metric names are namespaced as in DESIGN.md section 4 (``reward/*``, ``actor/*``, ``kl/*``,
``is/*``, ``len/*``, ``sampling/*``, ``async/*``, ``perf/*``, ``ref/*``, ``val/*``); a name
``family/metric@ctx=value`` is not used — per-domain and per-split values go in Aim's
``context`` instead (``{"domain": "math"}``, ``{"split": "eval"}``).
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import Optional


class Tracker:
    def __init__(self, repo: str, experiment: str, run_name: str, hparams: dict, enabled: bool = True,
                 run_hash: Optional[str] = None):
        """``run_hash``: continue that Aim run (a resumed training run); a new run if it is gone."""
        self.run = None
        self.hash: Optional[str] = None
        self.seconds = 0.0  # spent writing to Aim since the start: the cost of tracking, measured where it is paid
        if enabled:
            from aim import Run

            Path(repo).mkdir(parents=True, exist_ok=True)
            if run_hash:
                try:
                    self.run = Run(run_hash=run_hash, repo=str(repo), log_system_params=False,
                                   capture_terminal_logs=False, system_tracking_interval=None)
                except Exception as e:  # deleted, another repo, locked: metrics go to a new run
                    print(f"warning: cannot continue Aim run {run_hash} ({type(e).__name__}: {e}); starting a new one",
                          file=sys.stderr)
            if self.run is None:
                self.run = Run(repo=str(repo), experiment=experiment, log_system_params=False,
                               capture_terminal_logs=False, system_tracking_interval=None)
            self.run.name = run_name
            self.run["hparams"] = hparams
            self.hash = self.run.hash

    def track(self, metrics: dict, step: int, context: Optional[dict] = None) -> None:
        if self.run is None:
            return
        t0 = time.perf_counter()
        for name, value in metrics.items():
            if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if not math.isfinite(float(value)):
                continue
            self.run.track(float(value), name=name, step=step, context=context or {})
        self.seconds += time.perf_counter() - t0

    def text(self, name: str, texts: list[str], step: int, context: Optional[dict] = None) -> None:
        if self.run is None:
            return
        from aim import Text

        t0 = time.perf_counter()
        for i, t in enumerate(texts):
            self.run.track(Text(t), name=name, step=step, context={**(context or {}), "index": i})
        self.seconds += time.perf_counter() - t0

    def set(self, key: str, value) -> None:
        if self.run is not None:
            self.run[key] = value

    def close(self) -> None:
        if self.run is not None:
            self.run.close()
            self.run = None


def eta_s(step: int, total: int, elapsed: float, start_step: int = 0) -> Optional[float]:
    """Seconds left at the mean pace of the steps done in this process (``start_step``: where it
    began, a resumed run's checkpoint step); None before the first step."""
    done = step - start_step
    if done <= 0 or elapsed < 0:
        return None
    return elapsed / done * max(total - step, 0)


def duration(s: Optional[float]) -> str:
    """``42s``, ``3m05s``, ``1h02m`` (``-`` for None)."""
    if s is None or not math.isfinite(s):
        return "-"
    s = int(round(s))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def progress_line(step: int, total: int, m: dict, t_start: float) -> str:
    """One step's console line, ending with the elapsed time and the estimated time left at the
    run's mean pace so far (a resumed run's ``t_start`` already counts its earlier time)."""
    def g(k, fmt="{:.3f}"):
        v = m.get(k)
        return fmt.format(v) if isinstance(v, (int, float)) and math.isfinite(v) else "-"

    now = time.time()
    left = eta_s(step, total, now - t_start)
    reward, batch = g('reward/mean'), g('reward/raw_mean')
    if reward == "-" and batch != "-":
        # no sample of this step was graded (none generated, or every one invalid) and it trained
        # on groups buffered earlier: say what it trained on
        why = "none graded" if m.get("reward/invalid", 0) else "none generated"
        reward = f"- ({why}; trained batch {batch})"
    return (f"step {step:>4}/{total}  reward {reward}  acc {g('reward/accuracy')}  "
            f"kl {g('kl/loss_term', '{:.2e}')}  stale {g('async/trained_staleness_max', '{:.0f}')}  "
            f"gen {g('perf/gen_tok_s', '{:.0f}')} tok/s  train {g('perf/train_tok_s', '{:.0f}')} tok/s  "
            f"[{duration(now - t_start)} elapsed, ~{duration(left)} left]")

