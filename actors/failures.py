"""What the loop does when an actor call fails: the failure policy, in one place.

A dead generator or grader is restarted by Ray (up to ``rollout.max_generator_failures`` deaths)
and its requests are re-issued once, generators re-synced first; a failed weight sync re-forms
the group; a dead buffer or learner stops the run with one error naming the checkpoint to
``--resume`` from.

The policy decides, the loop acts: :meth:`FailurePolicy.on_failure` takes what happened (the kind
of call, its payload, the :class:`Failure`, the loop's counters as :class:`RunFacts`) and returns
the actions, in order, that :class:`actors.driver.TrainingLoop` applies. It holds no loop, reads no
actor and changes nothing; no Ray here (the loop turns an exception into a :class:`Failure`:
:meth:`actors.cluster.Actors.failure`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

from actors.loop_state import BUFFERED, RECEIVED, SENT, TRAINED, Request

# calls the loop waits on itself (not pending work): the held-out evaluation, the grader's
# per-step counts, and any other direct call (buffer.take, a checkpoint's calls ...)
EVALUATED, GRADER_METRICS, CALLED = "evaluated", "grader_metrics", "called"


@dataclass(frozen=True)
class Failure:
    """A failed call, as the policy needs to know it."""
    died: bool              # an actor's death failed it (the call, or one whose result it took)
    role: str               # the dead actor: generator-i, grader, buffer, learner; "" if none or unknown
    cause: str              # "Type: last line of the message" of the exception behind it
    error_type: str = ""    # the class name of the error the call raised (ActorDiedError, RayTaskError ...)
    nonfinite: bool = False  # the learner refused a non-finite step (learners.core.NonFiniteStepError)


@dataclass(frozen=True)
class RunFacts:
    """The loop's counters the decision depends on, as values."""
    version: int             # learner steps done
    checkpointed: int = -1   # the version of the newest checkpoint (-1: none yet)
    gen_failures: int = 0
    grader_failures: int = 0
    grader_down: bool = False  # a grader death is counted already (cleared by the next graded request)
    stopping: bool = False     # the stop checkpoint is being written: deaths are counted, the run not stopped again
    gen_down: frozenset = frozenset()  # generators whose death is counted already (each cleared by its next
    #                                    graded request): one death fails the request in flight and the calls
    #                                    made while Ray restarts the actor ("The actor is restarting")


# ------------------------------------------------------------------------ actions
@dataclass(frozen=True)
class Reissue:
    """The request goes back in the queue (still counted live), to be issued once more with the current weights."""
    request: Request
    warning: str


@dataclass(frozen=True)
class Count:
    """The failure counters' new values."""
    gen_failures: int
    grader_failures: int
    grader_down: bool
    gen_down: frozenset = frozenset()


@dataclass(frozen=True)
class Resync:
    """One full weight sync (a new group, every generator alive) before anything else."""
    warning: str = ""
    received: bool = False  # a generator's receive is the call that failed: one sync fewer pending


@dataclass(frozen=True)
class EvaluateAgain:
    """The held-out evaluation is done again (at the version current after a re-sync)."""


@dataclass(frozen=True)
class Stop:
    """The run stops with this message; a dead learner's or buffer's state is gone (no stop checkpoint)."""
    message: str
    learner_dead: bool = False
    buffer_dead: bool = False


Action = Union[Reissue, Count, Resync, EvaluateAgain, Stop]


@dataclass(frozen=True)
class FailurePolicy:
    max_generator_failures: int     # rollout.max_generator_failures
    run_dir: Optional[Path] = None  # named in the hint to --resume a run stopped on a non-finite step

    def on_failure(self, kind: str, payload, error: Failure, facts: RunFacts) -> tuple[Action, ...]:
        """A call of ``kind`` (``actors.loop_state`` kinds, or EVALUATED / GRADER_METRICS / CALLED)
        failed. A dead generator or grader is restarted by Ray and its requests are re-issued
        (generators re-synced first); a dead buffer or learner stops the run."""
        if kind == GRADER_METRICS:  # the step goes on without the grader's counts
            return self.count("grader", error, facts)
        if kind == CALLED:
            return self.lost(error, facts)
        if kind == EVALUATED:  # a generator (or the grader) died mid-evaluation: restart, re-sync, evaluate again
            if not error.role.startswith("generator") and error.role != "grader":
                return self.lost(error, facts)
            resync = (Resync(),) if error.role.startswith("generator") else ()
            return (*self.count(error.role, error, facts), *resync, EvaluateAgain())
        if error.died and error.role in ("buffer", "learner"):
            return self.lost(error, facts)  # whichever call noticed it first
        if kind == BUFFERED and error.died:
            request: Request = payload
            role = error.role or f"generator-{request.generator}"
            warning = f"{role} died ({error.error_type}); {len(request.rows)} prompts re-issued"
            resync = (Resync(),) if role.startswith("generator") else ()
            return (Reissue(request, warning), *resync, *self.count(role, error, facts))
        if kind in (SENT, RECEIVED):  # a generator's death found by the sync counts as any other (once)
            sync = Resync(f"weight sync failed ({error.cause}); re-forming the group", received=kind == RECEIVED)
            if error.died and error.role.startswith("generator"):
                return (sync, *self.count(error.role, error, facts))
            return (sync,)
        if kind == TRAINED:  # an actor death here is not the learner's (that one is lost above)
            hint = self.resume_hint(facts) if error.died else self.good_weights_hint(error, facts)
            return (Stop(f"the learner failed at step {facts.version + 1}: {error.cause}" + hint,
                         learner_dead=error.died),)
        if error.died:
            return self.lost(error, facts)
        return (Stop(f"on_{kind} failed: {error.cause}"),)

    def on_stale_weights(self, why: str) -> tuple[Action, ...]:
        """The evaluation found a generator restarted since its last sync: re-sync, evaluate again."""
        return (Resync(f"{why}; re-syncing before the evaluation"), EvaluateAgain())

    def count(self, role: str, error: Failure, facts: RunFacts) -> tuple[Action, ...]:
        """One more generator / grader death; past ``rollout.max_generator_failures`` the run stops
        (not while the stop checkpoint is being written: its barrier only records them)."""
        limit = self.max_generator_failures
        if role == "grader":
            if facts.grader_down:  # the other requests that one death failed
                return ()
            n, what = facts.grader_failures + 1, "the grader"
            counted = Count(facts.gen_failures, n, True, facts.gen_down)
        else:
            if role in facts.gen_down:  # the other calls that one death failed
                return ()
            n, what = facts.gen_failures + 1, "generators"
            counted = Count(n, facts.grader_failures, facts.grader_down, facts.gen_down | {role})
        if n > limit and not facts.stopping:
            return (counted, Stop(f"{what} died {n} times (rollout.max_generator_failures={limit}); last: {error.cause}"))
        return (counted,)

    def lost(self, error: Failure, facts: RunFacts) -> tuple[Action, ...]:
        """A direct call failed (an actor died, the node ran out of memory ...): the run stops; a dead
        buffer's or learner's state is gone."""
        role = error.role
        if role == "buffer":
            return (Stop(f"the replay buffer actor died ({error.cause}); its unconsumed groups are lost"
                         + self.resume_hint(facts), buffer_dead=True),)
        if role == "learner":
            return (Stop(f"the learner died at step {facts.version + 1} ({error.cause})" + self.resume_hint(facts),
                         learner_dead=True),)
        if role.startswith("generator"):  # a direct call found it dead for good: Ray's restarts are spent,
            # so this generator alone died max_generator_failures + 1 times (a death while it was idle
            # failed no request and was not counted when Ray restarted it)
            limit = self.max_generator_failures
            n = max(facts.gen_failures + 1, limit + 1)
            return (Count(n, facts.grader_failures, facts.grader_down),
                    Stop(f"generators died {n} times (rollout.max_generator_failures={limit}); last: {error.cause}"))
        return (Stop(f"{role or 'an actor'} failed: {error.cause}"),)

    @staticmethod
    def resume_hint(facts: RunFacts) -> str:
        if facts.checkpointed >= 0:
            return f"; no checkpoint is written now, continue from the last one (step {facts.checkpointed}) with --resume"
        return "; no checkpoint was written yet: start the run again"

    def good_weights_hint(self, error: Failure, facts: RunFacts) -> str:
        """A learner that stopped on the non-finite rule applied none of the updates it refused
        (:mod:`prorl_async.learners.update_guard`): the checkpoint the stop writes holds good weights."""
        if not error.nonfinite or self.run_dir is None:
            return ""
        return (f"; the checkpoint written at this stop (step {facts.version}) holds the last good weights: "
                f"fix the cause (train.lr ...), then continue with --resume {self.run_dir}")
