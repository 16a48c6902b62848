"""The failure policy (actors/failures.py) as a pure function: what happened in, actions out.

No Ray: the failures are written as the facts the loop extracts from an exception
(:meth:`actors.cluster.Actors.failure`); each message worked out by hand from the numbers given.
"""

import subprocess
import sys
from pathlib import Path

import pytest

from actors.failures import (CALLED, EVALUATED, GRADER_METRICS, Count, EvaluateAgain, Failure, FailurePolicy, Reissue,
                             Resync, RunFacts, Stop)
from actors.loop_state import BUFFERED, GENERATED, RECEIVED, SENT, TRAINED, LoopState, Request

POLICY = FailurePolicy(max_generator_failures=2, run_dir=Path("/runs/r1"))
FACTS = RunFacts(version=6, checkpointed=4, gen_failures=1, grader_failures=0)
REQUEST = Request(generator=1, rows=[{"id": 7}, {"id": 8}, {"id": 9}], seed=42)
CAUSE = "ActorDiedError: The actor died unexpectedly"


def died(role: str, error_type="RayTaskError") -> Failure:
    return Failure(died=True, role=role, cause=CAUSE, error_type=error_type)


def raised(cause="ValueError: bad row") -> Failure:  # an exception inside a live actor
    return Failure(died=False, role="", cause=cause, error_type="RayTaskError")


def test_the_policy_module_imports_no_ray():
    code = "import sys, actors.failures; assert 'ray' not in sys.modules and 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[1])


# ------------------------------------------------------------------------ buffered: re-issue
def test_a_dead_generators_request_is_reissued_resynced_and_counted():
    actions = POLICY.on_failure(BUFFERED, REQUEST, died("generator-1", "ActorDiedError"), FACTS)
    assert actions == (Reissue(REQUEST, "generator-1 died (ActorDiedError); 3 prompts re-issued"),
                       Resync(), Count(gen_failures=2, grader_failures=0, grader_down=False, gen_down=frozenset({"generator-1"})))


def test_an_unknown_dead_actor_is_the_requests_generator():
    actions = POLICY.on_failure(BUFFERED, REQUEST, died(""), FACTS)
    assert actions[0].warning == "generator-1 died (RayTaskError); 3 prompts re-issued"
    assert actions[1:] == (Resync(), Count(2, 0, False, frozenset({"generator-1"})))


def test_a_dead_graders_request_is_reissued_without_a_resync_and_counted_once():
    actions = POLICY.on_failure(BUFFERED, REQUEST, died("grader"), FACTS)
    assert actions == (Reissue(REQUEST, "grader died (RayTaskError); 3 prompts re-issued"),
                       Count(gen_failures=1, grader_failures=1, grader_down=True))
    # the other requests the same death failed: re-issued, not counted again
    down = RunFacts(version=6, grader_failures=1, grader_down=True)
    assert POLICY.on_failure(BUFFERED, REQUEST, died("grader"), down) == (
        Reissue(REQUEST, "grader died (RayTaskError); 3 prompts re-issued"),)


def test_one_generator_death_is_counted_once_whatever_calls_it_fails():
    """A SIGKILL fails the request in flight (counted), then the calls made while Ray restarts the actor
    ("The actor is restarting"): the same death, re-issued and re-synced but not counted again, until
    a request of that generator lands (the loop clears it then). Another generator's death counts."""
    down = RunFacts(version=6, gen_failures=2, gen_down=frozenset({"generator-1"}))  # at the limit of 2: one more count would stop
    restarting = Failure(died=True, role="generator-1", cause="ActorUnavailableError: The actor is restarting.",
                         error_type="RayTaskError")
    assert POLICY.on_failure(BUFFERED, REQUEST, restarting, down) == (
        Reissue(REQUEST, "generator-1 died (RayTaskError); 3 prompts re-issued"), Resync())
    assert POLICY.on_failure(EVALUATED, None, restarting, down) == (Resync(), EvaluateAgain())
    other = POLICY.on_failure(BUFFERED, REQUEST, died("generator-0"), down)
    assert other[2] == Count(3, 0, False, frozenset({"generator-0", "generator-1"})) and isinstance(other[3], Stop)


def test_a_request_issued_before_the_counted_death_does_not_clear_it():
    """The loop's state between the policy's calls (LoopState.mark_down / landed): request 4 was
    generated before the kill and lands (graded, buffered) after request 5 failed and its death was
    counted; the generator is still restarting, so the weight sync that then finds it restarting is
    the same death, not a second one past a limit of 1. Request 5's re-issue (number 6) landing shows
    it back: a death after that counts, and stops the run."""
    max1, s = FailurePolicy(max_generator_failures=1), LoopState(version=3, issued=6)
    restarting = Failure(died=True, role="generator-1", cause="ActorUnavailableError: The actor is restarting.",
                         error_type="ActorUnavailableError")

    def fail(kind, payload, error):
        facts = RunFacts(s.version, s.checkpointed, s.gen_failures, s.grader_failures, s.grader_down, s.stopping, s.gen_down)
        actions = max1.on_failure(kind, payload, error, facts)
        for a in actions:
            if isinstance(a, Count):
                s.gen_failures, s.grader_failures = a.gen_failures, a.grader_failures
                s.mark_down(a.gen_down, a.grader_down)
        return actions

    assert not any(isinstance(a, Stop) for a in fail(BUFFERED, Request(1, [{"id": 5}], 7, issued=5), died("generator-1")))
    assert (s.gen_failures, s.gen_down, s.down_since) == (1, frozenset({"generator-1"}), {"generator-1": 6})
    s.landed(Request(1, [{"id": 4}], 6, issued=4))
    assert s.gen_down == frozenset({"generator-1"})
    assert fail(SENT, None, restarting) == (
        Resync("weight sync failed (ActorUnavailableError: The actor is restarting.); re-forming the group"),)
    s.landed(Request(0, [{"id": 3}], 5, issued=6))  # another generator's request: generator-1 still down
    assert s.gen_down == frozenset({"generator-1"}) and s.gen_failures == 1
    s.landed(Request(1, [{"id": 5}], 7, issued=6))  # the re-issue, on the restarted actor
    assert s.gen_down == frozenset()
    again = fail(SENT, None, restarting)
    assert again[1] == Count(2, 0, False, frozenset({"generator-1"})) and isinstance(again[2], Stop)
    assert "generators died 2 times (rollout.max_generator_failures=1)" in again[2].message


def test_the_grader_death_counted_is_cleared_only_by_a_request_issued_after_it():
    s = LoopState(issued=9)
    s.mark_down(frozenset(), True)
    s.landed(Request(0, [], 1, issued=8))
    assert s.grader_down and s.down_since == {"grader": 9}
    s.landed(Request(0, [], 1, issued=9))
    assert not s.grader_down


def test_the_death_past_the_limit_reissues_then_stops():
    # limit 2, two deaths so far: the third is past it
    facts = RunFacts(version=6, gen_failures=2)
    actions = POLICY.on_failure(BUFFERED, REQUEST, died("generator-1"), facts)
    assert actions[:3] == (Reissue(REQUEST, "generator-1 died (RayTaskError); 3 prompts re-issued"), Resync(),
                           Count(3, 0, False, frozenset({"generator-1"})))
    assert actions[3] == Stop(f"generators died 3 times (rollout.max_generator_failures=2); last: {CAUSE}")
    # at the limit (the second death) the run goes on
    assert not any(isinstance(a, Stop) for a in POLICY.on_failure(BUFFERED, REQUEST, died("generator-1"), FACTS))


def test_the_grader_past_the_limit_stops():
    actions = POLICY.on_failure(BUFFERED, REQUEST, died("grader"), RunFacts(version=6, grader_failures=2))
    assert actions[-1] == Stop(f"the grader died 3 times (rollout.max_generator_failures=2); last: {CAUSE}")


def test_while_the_stop_checkpoint_is_written_deaths_are_counted_not_stopped_on():
    facts = RunFacts(version=6, gen_failures=5, stopping=True)
    actions = POLICY.on_failure(BUFFERED, REQUEST, died("generator-0"), facts)
    assert actions[-1] == Count(6, 0, False, frozenset({"generator-0"})) and not any(isinstance(a, Stop) for a in actions)


def test_a_request_failed_by_an_exception_stops_with_the_handlers_name():
    assert POLICY.on_failure(BUFFERED, REQUEST, raised(), FACTS) == (Stop("on_buffered failed: ValueError: bad row"),)
    assert POLICY.on_failure(GENERATED, REQUEST, raised(), FACTS) == (Stop("on_generated failed: ValueError: bad row"),)


# ------------------------------------------------------------------------ buffer / learner: stop
@pytest.mark.parametrize("kind", [GENERATED, BUFFERED, TRAINED, SENT, RECEIVED])
def test_a_dead_buffer_stops_whatever_noticed_it(kind):
    assert POLICY.on_failure(kind, None, died("buffer"), FACTS) == (Stop(
        f"the replay buffer actor died ({CAUSE}); its unconsumed groups are lost; no checkpoint is written now, "
        "continue from the last one (step 4) with --resume", buffer_dead=True),)


@pytest.mark.parametrize("kind", [GENERATED, BUFFERED, TRAINED, SENT, RECEIVED, CALLED])
def test_a_dead_learner_stops_at_the_next_step(kind):
    no_checkpoint = RunFacts(version=6)
    assert POLICY.on_failure(kind, None, died("learner"), no_checkpoint) == (Stop(
        f"the learner died at step 7 ({CAUSE}); no checkpoint was written yet: start the run again",
        learner_dead=True),)


# ------------------------------------------------------------------------ trained
def test_a_train_step_that_raised_stops_and_the_stop_checkpoint_is_written():
    assert POLICY.on_failure(TRAINED, None, raised("RuntimeError: CUDA error"), FACTS) == (
        Stop("the learner failed at step 7: RuntimeError: CUDA error"),)


def test_a_non_finite_step_names_the_checkpoint_with_good_weights():
    nonfinite = Failure(died=False, role="", cause="NonFiniteStepError: loss is nan", nonfinite=True)
    assert POLICY.on_failure(TRAINED, None, nonfinite, FACTS) == (Stop(
        "the learner failed at step 7: NonFiniteStepError: loss is nan; the checkpoint written at this stop "
        "(step 6) holds the last good weights: fix the cause (train.lr ...), then continue with --resume /runs/r1"),)
    assert FailurePolicy(2).on_failure(TRAINED, None, nonfinite, FACTS) == (
        Stop("the learner failed at step 7: NonFiniteStepError: loss is nan"),)  # no run dir: no checkpoint to name


def test_a_train_step_failed_by_another_death_stops_without_a_checkpoint():
    assert POLICY.on_failure(TRAINED, None, died(""), FACTS) == (Stop(
        f"the learner failed at step 7: {CAUSE}; no checkpoint is written now, continue from the last one "
        "(step 4) with --resume", learner_dead=True),)


# ------------------------------------------------------------------------ sent / received: re-sync
def test_a_failed_broadcast_reforms_the_group():
    assert POLICY.on_failure(SENT, None, raised("TimeoutError: no peer"), FACTS) == (
        Resync("weight sync failed (TimeoutError: no peer); re-forming the group"),)


def test_a_failed_receive_reforms_the_group_with_one_sync_fewer_pending():
    assert POLICY.on_failure(RECEIVED, 0, raised("TimeoutError: no peer"), FACTS) == (
        Resync("weight sync failed (TimeoutError: no peer); re-forming the group", received=True),)


def test_a_generator_death_found_by_a_weight_sync_is_counted_once():
    """A generator that died while idle fails no request: the sync is the first call to notice it,
    and the death counts toward rollout.max_generator_failures like any other, once."""
    resync = Resync(f"weight sync failed ({CAUSE}); re-forming the group", received=True)
    assert POLICY.on_failure(RECEIVED, 0, died("generator-0"), FACTS) == (
        resync, Count(2, 0, False, frozenset({"generator-0"})))
    # the request that the same death failed afterwards: re-issued, not counted again
    down = RunFacts(version=6, gen_failures=2, gen_down=frozenset({"generator-0"}))
    assert POLICY.on_failure(BUFFERED, Request(0, [{"id": 1}], 1), died("generator-0"), down)[2:] == ()
    assert POLICY.on_failure(RECEIVED, 0, died("generator-0"), down) == (resync,)
    past = POLICY.on_failure(SENT, None, died("generator-1"), down)  # another death, past the limit of 2
    assert past[1] == Count(3, 0, False, frozenset({"generator-0", "generator-1"})) and isinstance(past[2], Stop)


# ------------------------------------------------------------------------ evaluation, grader counts, direct calls
def test_a_generator_dead_mid_evaluation_is_counted_resynced_and_evaluated_again():
    assert POLICY.on_failure(EVALUATED, None, died("generator-0"), FACTS) == (
        Count(2, 0, False, frozenset({"generator-0"})), Resync(), EvaluateAgain())
    assert POLICY.on_failure(EVALUATED, None, died("grader"), FACTS) == (Count(1, 1, True), EvaluateAgain())
    past = POLICY.on_failure(EVALUATED, None, died("generator-0"), RunFacts(version=6, gen_failures=2))
    assert past == (Count(3, 0, False, frozenset({"generator-0"})),
                    Stop(f"generators died 3 times (rollout.max_generator_failures=2); last: {CAUSE}"),
                    Resync(), EvaluateAgain())  # the loop stops at the Stop


def test_an_evaluation_failed_by_anything_else_stops():
    assert POLICY.on_failure(EVALUATED, None, raised(), FACTS) == (Stop("an actor failed: ValueError: bad row"),)


def test_stale_weights_at_an_evaluation_resync_first():
    assert POLICY.on_stale_weights("generator-1 holds weights of version 3, not 6") == (
        Resync("generator-1 holds weights of version 3, not 6; re-syncing before the evaluation"), EvaluateAgain())


def test_the_grader_dead_at_its_metrics_call_is_counted_once():
    assert POLICY.on_failure(GRADER_METRICS, None, died(""), FACTS) == (Count(1, 1, True),)
    assert POLICY.on_failure(GRADER_METRICS, None, died(""), RunFacts(version=6, grader_down=True)) == ()


def test_a_generator_found_dead_for_good_by_a_direct_call_stops_past_the_limit():
    # one death counted, limit 2: Ray's restarts are spent, so this generator died 3 times
    assert POLICY.on_failure(CALLED, None, died("generator-0"), FACTS) == (
        Count(3, 0, False), Stop(f"generators died 3 times (rollout.max_generator_failures=2); last: {CAUSE}"))
    # more deaths already counted than that: one more
    assert POLICY.on_failure(CALLED, None, died("generator-0"), RunFacts(version=6, gen_failures=4))[0] == Count(5, 0, False)


def test_any_other_direct_call_failure_stops_naming_the_actor():
    assert POLICY.on_failure(CALLED, None, died("grader"), FACTS) == (Stop(f"grader failed: {CAUSE}"),)
    assert POLICY.on_failure(CALLED, None, raised("OutOfMemoryError: node"), FACTS) == (
        Stop("an actor failed: OutOfMemoryError: node"),)
