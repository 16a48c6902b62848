"""All the training loop's state, in one dataclass: what :mod:`actors.driver` reads and updates,
and (the fields listed in ``LoopState.SAVED``) what a checkpoint saves (:mod:`actors.checkpointing`)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import ClassVar, Optional


def zero_sums() -> defaultdict:
    return defaultdict(float)


# the kinds of pending work: a generation, its graded groups put in the buffer, a train step, the
# learner's weight broadcast, one generator's receive of it
GENERATED, BUFFERED, TRAINED, SENT, RECEIVED = "generated", "buffered", "trained", "sent", "received"


@dataclass(frozen=True)
class Request:
    """One generation request: on generator ``generator``, these prompts, this seed (re-issued as is)."""
    generator: int
    rows: list
    seed: int
    issued: int = 0  # the loop's count of requests issued before this one (a re-issue gets a new number)


@dataclass(frozen=True)
class Pending:
    """A call in flight: what it is and what its completion needs -- the :class:`Request` (generated,
    buffered), the generator's index (received), or nothing (trained, sent)."""
    kind: str
    payload: Optional[object] = None


@dataclass
class LoopState:
    """Everything the loop knows. The fields above the line are the driver's part of a checkpoint
    (``driver.json``, plus ``history.jsonl``); the rest is in flight (empty at a checkpoint's
    barrier) or comes back through the resume's weight sync."""
    version: int = 0             # learner policy version = learner steps done
    consumed: int = 0            # groups handed to the learner
    live: int = 0                # groups in flight or waiting in the buffer
    buffered: int = 0            # informative groups waiting in the buffer
    requests: int = 0            # generation requests issued (each one's seed)
    window: dict = field(default_factory=zero_sums)             # rollout sums since the last step
    busy_s: dict = field(default_factory=zero_sums)             # cumulative seconds: grade, sync, eval
    train_busy_s: float = 0.0
    gen_busy_s: list = field(default_factory=list)          # cumulative seconds, per generator
    resyncs: int = 0
    gen_failures: int = 0
    grader_failures: int = 0
    invalid_by_reason: dict = field(default_factory=zero_sums)  # ungradable samples, cumulative
    retry: list = field(default_factory=list)               # [rows, seed] of requests whose generator died
    trained_groups: list = field(default_factory=list)      # request_id/prompt_id of every group, per step
    before: dict = field(default_factory=dict)              # held-out metrics before training
    last_eval: int = -1
    best: dict = field(default_factory=dict)                # train.keep_best: metric, mode, step, value of best/
    history: list = field(default_factory=list)             # metrics per step (history.jsonl)
    # ------------------------------------------------------------------------ not saved
    t_start: float = 0.0         # run start (a resumed run: now minus the checkpoint's elapsed_s)
    t_last_step: float = 0.0
    tracking_s: float = 0.0      # the tracker's seconds in Aim at the last step line (perf/tracking_s per step)
    last_progress: float = 0.0
    gen_version: list = field(default_factory=list)
    gen_busy: list = field(default_factory=list)
    gen_started: list = field(default_factory=list)
    gen_rss_mb: list = field(default_factory=list)  # each generator's resident memory at its last weight update
    training: Optional[object] = None  # the running train step's ObjectRef
    train_started: float = 0.0
    sync_pending: int = 0
    last_sync: dict = field(default_factory=dict)
    resync_needed: bool = False
    learner_dead: bool = False
    buffer_dead: bool = False
    grader_down: bool = False    # a grader death was counted; cleared by a request issued after it (landed)
    gen_down: frozenset = frozenset()  # generators whose death was counted; each cleared as the grader's
    issued: int = 0              # requests issued in this process, re-issues included (each Request's number)
    down_since: dict = field(default_factory=dict)  # role -> ``issued`` when its death was counted
    stop_reason: str = ""        # train.stop_at reached: why the run stops after this evaluation
    signalled: str = ""          # SIGTERM's name once received: nothing new starts, a checkpoint, then exit
    eval_owed: bool = False      # an evaluation failed (a generator died): done again after the re-sync
    stopping: bool = False       # writing the stop checkpoint: failures are recorded, not raised again
    reissued: list = field(default_factory=list)   # prompt ids of requests re-issued after a failure
    gen_spans: list = field(default_factory=list)  # (start, end) of requests finished since the last step
    checkpointed: int = -1       # the version of the newest checkpoint
    checkpoint_t: float = 0.0    # when the newest checkpoint was written, or the loop started (train.checkpoint_every_s)
    pending: dict = field(default_factory=dict)    # ObjectRef -> Pending

    SAVED: ClassVar[tuple] = ("version", "consumed", "live", "buffered", "requests", "window", "busy_s", "train_busy_s",
                              "gen_busy_s", "resyncs", "gen_failures", "grader_failures", "invalid_by_reason", "retry", "trained_groups",
                              "before", "last_eval", "best")

    def mark_down(self, gen_down: frozenset, grader_down: bool) -> None:
        """A counted death's marks (the failure policy's ``Count``), each new one with the number of
        requests issued when it was counted."""
        newly = gen_down - self.gen_down | ({"grader"} if grader_down and not self.grader_down else set())
        self.down_since.update(dict.fromkeys(newly, self.issued))
        self.gen_down, self.grader_down = gen_down, grader_down

    def landed(self, r: Request) -> None:
        """A graded, buffered request shows its generator (and the grader) back from a counted death only
        if it was issued after that count, so that the next death counts anew: a request issued before
        can land after the death (generated before the kill, graded while Ray restarts the actor), and
        a call that the restart then fails ("The actor is restarting") is the same death."""
        generator = f"generator-{r.generator}"
        if r.issued >= self.down_since.get(generator, 0):
            self.gen_down = self.gen_down - {generator}
        if r.issued >= self.down_since.get("grader", 0):
            self.grader_down = False
