"""Dynamic sampling's refills, watched so that a run never spins in silence (issue 11).

Dynamic sampling (DAPO, Yu et al. 2025, arXiv 2503.14476, section 3.2) drops every group whose
rewards are all equal and samples more prompts until a batch of informative groups is full. On
a task the starting policy never (or always) solves, every group is dropped and the refill never
ends. verl bounds it with ``algorithm.filter_groups.max_num_gen_batches`` (generation batches per
train batch; <= 0 means no bound); here the bound is ``algo.max_refill_rounds``.

A **refill round** is ``train.prompts_per_step`` groups dropped (as all-correct, all-wrong or
with too few valid samples) since the last completed train step: the prompts generated to
replace a whole batch's worth of dropped groups. A run that drops nothing has 0 refill rounds,
however far its rollouts run ahead under ``max_staleness``. The default ``max_refill_rounds=30``
stops a run after thirty batches' worth of dropped groups without a step, i.e. when fewer than
about 1 in 31 groups carries signal (0 = never stop); a weak but learning policy (the tiny test
model keeps about 1 group in 10) is not stopped. verl's DAPO recipe sets 10 generation batches.

While groups are being dropped and no step completes, :meth:`RefillWatch.report` gives a console
line at most every ``report_every_s`` seconds (the first one as soon as a round is complete).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Optional

if TYPE_CHECKING:
    from prorl_async.buffer import PutResult

REPORT_EVERY_S = 20.0


@dataclass
class RefillWatch:
    prompts_per_step: int
    max_rounds: int                  # 0 = unlimited
    now: float = 0.0                 # the last completed step (or the run start)
    report_every_s: float = REPORT_EVERY_S
    kept: int = 0
    dropped: Counter = field(default_factory=Counter)  # invalid / all_correct / all_wrong
    last_report: float = float("-inf")
    reported_rounds: int = 0
    stopped: bool = False            # the error was given (once: a stop checkpoint drains the rest)
    say: Callable[[str], None] = field(default=lambda line: print(line, flush=True), repr=False)

    @property
    def rounds(self) -> int:
        return sum(self.dropped.values()) // max(self.prompts_per_step, 1)

    def observe(self, info: PutResult, step: int, now: float) -> Optional[str]:
        """One graded request as the buffer answered it (``kept``, ``dropped_by``); says how the
        refills go (:meth:`report`) and returns the error that must stop the run, if any."""
        self.kept += int(info.kept)
        self.dropped.update({k: int(v) for k, v in info.dropped_by.items()})
        if line := self.report(step, now):
            self.say(line)
        return self.exhausted(step, now)

    def step_done(self, now: float) -> None:
        self.kept, self.dropped, self.now = 0, Counter(), now
        self.last_report, self.reported_rounds = float("-inf"), 0

    def summary(self, step: int, now: float) -> str:
        d = self.dropped
        return (f"{self.kept} groups kept, {sum(d.values())} dropped ({d['all_wrong']} all wrong, "
                f"{d['all_correct']} all correct, {d['invalid']} too few valid) in {self.rounds} refill rounds "
                f"since step {step} ({now - self.now:.0f}s)")

    def report(self, step: int, now: float) -> Optional[str]:
        """A console line while refills go on without a step, at most every ``report_every_s``."""
        if self.rounds <= self.reported_rounds or now - self.last_report < self.report_every_s:
            return None
        self.last_report, self.reported_rounds = now, self.rounds
        limit = f"/{self.max_rounds}" if self.max_rounds else ""
        return f"dynamic sampling: refill round {self.rounds}{limit}, no full batch yet: {self.summary(step, now)}"

    def exhausted(self, step: int, now: float) -> Optional[str]:
        """The error that stops the run once ``max_rounds`` refill rounds passed without a step."""
        if self.stopped or not self.max_rounds or self.rounds < self.max_rounds:
            return None
        self.stopped = True
        d = self.dropped
        if d["all_wrong"] >= max(d["all_correct"], d["invalid"]):
            why = "the policy is never correct on this task"
            fix = "an easier task (or a model that solves some of it)"
        elif d["all_correct"] >= d["invalid"]:
            why = "the policy is always correct on this task"
            fix = "a harder task"
        else:
            why = "most samples could not be graded (see reward/invalid_* and grader/*)"
            fix = "a fixed verifier or dataset"
        return (f"dynamic sampling found no full batch in {self.rounds} refill rounds (algo.max_refill_rounds="
                f"{self.max_rounds}): {self.summary(step, now)}. Likely cause: {why}. Fix: {fix}, a higher "
                f"rollout.temperature, or algo.dynamic_sampling=false (train on the groups as they are)")
