"""What the loop does when an actor call fails: the failure policy, in one place.

A dead generator or grader is restarted by Ray (up to ``rollout.max_generator_failures`` deaths)
and its requests are re-issued once, generators re-synced first; a failed weight sync re-forms
the group; a dead buffer or learner stops the run with one error naming the checkpoint to
``--resume`` from. The loop (:class:`actors.driver.TrainingLoop`) owns the state; this object
reads and updates it.
"""

from __future__ import annotations

import logging

from prorl_async.learners.core import NonFiniteStepError

from actors.cluster import RunError, actor_died, cause, dead_actor_id

log = logging.getLogger("prorl_async")


class FailurePolicy:
    def __init__(self, loop):
        self.loop = loop

    def on_failure(self, handler, ref, err: Exception) -> None:
        """A call failed. A dead generator or grader is restarted by Ray and its requests are
        re-issued (generators re-synced first); a dead buffer or learner stops the run."""
        s, request = self.loop.s, self.loop.s.in_flight.pop(ref, None)
        if actor_died(err) and self.loop.actors.role(dead_actor_id(err)) in ("buffer", "learner"):
            raise self.lost(err)  # whichever call noticed it first
        if handler == self.loop.on_buffered and request is not None and actor_died(err):
            i, rows, seed = request
            role = self.loop.actors.role(dead_actor_id(err)) or f"generator-{i}"
            s.gen_busy[i] = False
            s.retry.append((rows, seed))  # still counted live: re-issued once, with the current weights
            s.reissued.extend(str(r["id"]) for r in rows)
            log.warning("%s died (%s); %d prompts re-issued", role, type(err).__name__, len(rows))
            s.resync_needed = s.resync_needed or role.startswith("generator")
            self.count(role, err)
        elif handler in (self.loop.on_weights_sent, self.loop.on_weights_received):
            if handler == self.loop.on_weights_received:
                s.sync_pending -= 1
            log.warning("weight sync failed (%s); re-forming the group", cause(err))
            s.resync_needed = True
        elif handler == self.loop.on_trained:
            s.learner_dead = actor_died(err)  # an actor death, not an exception inside a live learner
            raise RunError(f"the learner failed at step {s.version + 1}: {cause(err)}"
                           + (self.resume_hint() if s.learner_dead else self.good_weights_hint(err)))
        elif actor_died(err):
            raise self.lost(err)
        else:
            raise RunError(f"{getattr(handler, '__name__', handler)} failed: {cause(err)}")

    def count(self, role: str, err: Exception) -> None:
        """One more generator / grader death; past ``rollout.max_generator_failures`` the run stops
        (not while the stop checkpoint is being written: its barrier only records them)."""
        s, limit = self.loop.s, self.loop.cfg.rollout.max_generator_failures
        if role == "grader":
            if s.grader_down:  # the other requests that one death failed
                return
            s.grader_down = True
            s.grader_failures += 1
            n, what = s.grader_failures, "the grader"
        else:
            s.gen_failures += 1
            n, what = s.gen_failures, "generators"
        if n > limit and not s.stopping:
            raise RunError(f"{what} died {n} times (rollout.max_generator_failures={limit}); last: {cause(err)}")

    def resume_hint(self) -> str:
        s = self.loop.s
        if s.checkpointed >= 0:
            return f"; no checkpoint is written now, continue from the last one (step {s.checkpointed}) with --resume"
        return "; no checkpoint was written yet: start the run again"

    def good_weights_hint(self, err: Exception) -> str:
        """A learner that stopped on the non-finite rule applied none of the updates it refused
        (:mod:`prorl_async.learners.update_guard`): the checkpoint the stop writes holds good weights."""
        nonfinite = isinstance(err, NonFiniteStepError) or isinstance(getattr(err, "cause", None), NonFiniteStepError)
        if not nonfinite or self.loop.run_dir is None:
            return ""
        return (f"; the checkpoint written at this stop (step {self.loop.s.version}) holds the last good weights: "
                f"fix the cause (train.lr ...), then continue with --resume {self.loop.run_dir}")

    def lost(self, err: Exception) -> RunError:
        """The error that stops a run whose buffer or learner actor died (their state is gone)."""
        role = self.loop.actors.role(dead_actor_id(err))
        if role == "buffer":
            self.loop.s.buffer_dead = True
            return RunError(f"the replay buffer actor died ({cause(err)}); its unconsumed groups are lost"
                            + self.resume_hint())
        if role == "learner":
            self.loop.s.learner_dead = True
            return RunError(f"the learner died at step {self.loop.s.version + 1} ({cause(err)})" + self.resume_hint())
        if role.startswith("generator"):  # a direct call found it dead for good: Ray's restarts are spent,
            # so this generator alone died max_generator_failures + 1 times (a death while it was idle
            # failed no request and was not counted when Ray restarted it)
            limit = self.loop.cfg.rollout.max_generator_failures
            self.loop.s.gen_failures = max(self.loop.s.gen_failures + 1, limit + 1)
            return RunError(f"generators died {self.loop.s.gen_failures} times (rollout.max_generator_failures="
                            f"{limit}); last: {cause(err)}")
        return RunError(f"{role or 'an actor'} failed: {cause(err)}")
