"""The driver: generate -> grade -> buffer -> train -> broadcast, as long-lived actors.

Long-lived actors do the work (:mod:`actors.cluster` starts and wires them); this loop only decides
*when*. Rollout and training overlap under a staleness bound kept by admission control
(:mod:`prorl_async.staleness`): a generator with weights of version ``v`` starts a request only while
the groups consumed, live and requested fit into ``(v + max_staleness + 1) * prompts_per_step``;
the buffer re-checks the bound when it hands a batch out. ``max_staleness=0`` is the synchronous,
strictly on-policy baseline through the same code. All loop state is one :class:`LoopState`, also what
a checkpoint saves (:mod:`actors.checkpointing`); run-directory files: :mod:`prorl_async.outputs`.
What a failed call leads to is decided by :mod:`actors.failures`; this loop applies the decision.
Every held-out evaluation goes to :mod:`prorl_async.selection` too (``train.keep_best``: write
``best/``; ``train.stop_at``: stop after this evaluation); with either set, the learner waits for
each periodic evaluation, so ``best/`` holds the evaluated weights and a stop lands on the evaluated step.
"""

from __future__ import annotations

import importlib
import logging
import sys
import time
from typing import Any, Optional

import ray

from prorl_async.algo.reference import reset_line
from prorl_async.buffer import PutResult
from prorl_async.config import Config, config_to_dict, save_config
from prorl_async.console import ActorWarnings, quiet_driver
from prorl_async.curriculum import Curriculum, NoSignal, prompt_source
from prorl_async.data.datasets import load_source, load_train_rows
from prorl_async.data.source import PromptSource
from prorl_async.engines.prompts import drop_unfit
from prorl_async.metrics import domain_metrics, rollout_metrics, rss_mb, utilisation_metrics
from prorl_async.models import context_length, load_tokenizer, resolve_model_path
from prorl_async.outputs import BEST, FINAL, format_table, prepare_run_dir, write_final
from prorl_async.refill import RefillWatch
from prorl_async.selection import Best, improves, parse_stop_at, require_logged
from prorl_async.staleness import plan_requests
from prorl_async.tracking import Tracker, progress_line

from actors import checkpointing, storage
from actors.cluster import Actors, RunError, cause, init_ray
from actors.evaluation import StaleWeights, evaluate, held_out, preflight
from actors.failures import (CALLED, EVALUATED, GRADER_METRICS, Count, EvaluateAgain, FailurePolicy, Reissue, Resync,
                             RunFacts, Stop)
from actors.loop_state import (BUFFERED, GENERATED, RECEIVED, SENT, TRAINED, LoopState, Pending, Request,
                               zero_sums)
from actors.replay_buffer import TakeRefs
from actors.stopping import Stopped, stop_on_sigterm

log = logging.getLogger("prorl_async")
EVALUATION_FAILED = (StaleWeights, ray.exceptions.RayActorError, ray.exceptions.RayTaskError)

class TrainingLoop:
    def __init__(self, cfg: Config, actors: Actors, source: PromptSource | Curriculum, tracker: Tracker, eval_rows: list[dict],
                 run_dir=None, model_path: str = "", before: Optional[dict] = None):
        self.cfg, self.actors, self.source, self.tracker, self.eval_rows = cfg, actors, source, tracker, eval_rows
        self.run_dir, self.model_path = run_dir, model_path  # no run dir, no checkpoints
        g = len(actors.generators)
        self.s = LoopState(gen_version=[0] * g, gen_busy=[False] * g, gen_busy_s=[0.0] * g, gen_started=[0.0] * g,
                           gen_rss_mb=[0.0] * g, before=dict(before or {}))
        self.s.t_start = self.s.t_last_step = self.s.last_progress = self.s.checkpoint_t = time.time()
        self.refill = RefillWatch(cfg.train.prompts_per_step, cfg.algo.max_refill_rounds, self.s.t_start)
        self.failures = FailurePolicy(cfg.rollout.max_generator_failures, run_dir)
        self.actor_warnings = ActorWarnings()  # the project's warnings raised inside actors
        self.stop_rule = parse_stop_at(cfg.train.stop_at, cfg.train.eval_samples)

    # ------------------------------------------------------------ the loop
    def run(self) -> list[dict]:
        try:
            return self._run()
        except ray.exceptions.RayError as err:  # a direct call failed (an actor died, the node ran out of memory ...)
            self.on_failure(CALLED, None, err)  # stops the run
            raise

    def _run(self) -> list[dict]:
        s, total = self.s, self.cfg.train.total_steps
        while (s.version < total or s.training is not None) and not s.stop_reason and not s.signalled:
            if due := self.checkpoint_due():
                self.checkpoint(due)
                continue
            if s.resync_needed:  # a generator or a weight sync failed: one full sync before anything else
                if s.training is None and s.sync_pending == 0:
                    self.resync_weights()
            elif self.eval_due():  # rollouts pause; evaluate once the generators hold the new weights
                if not any(s.gen_busy) and s.sync_pending == 0:
                    self.evaluate_held_out()
            elif s.version < total:
                self.start_rollouts()  # generate -> grade -> buffer, under admission control
            if s.version + (s.training is not None) < total:
                self.start_train_step()  # buffer -> train; when it is done, broadcast the weights
            self.handle_completions(timeout=1.0)
            if time.time() - s.last_progress > self.cfg.train.batch_timeout_s:
                raise RunError(f"no progress for {self.cfg.train.batch_timeout_s:.0f}s (train.batch_timeout_s); "
                               f"{len(s.pending)} calls pending, buffer holds {s.buffered} groups")
        if s.signalled:
            print(f"{s.signalled}: nothing new starts; {len(s.pending)} calls in flight land, then a checkpoint (send "
                  f"{s.signalled} again to stop at once)", flush=True)
        while s.pending:  # in-flight rollouts and the last weight sync land before the final evaluation
            self.handle_completions(timeout=self.cfg.train.sync_timeout_s)
        if s.resync_needed:  # a generator restarted after the last step: it gets the final weights
            self.resync_weights()
        return s.history

    # ------------------------------------------------------------ generate -> grade -> buffer
    def start_rollouts(self) -> None:
        """Re-issue requests of dead generators, then new ones as admission control allows."""
        cfg, s = self.cfg, self.s
        for i in range(len(self.actors.generators)):
            if s.retry and not s.gen_busy[i]:
                rows, seed = s.retry.pop(0)
                self._request(i, rows, seed)
        for i, k in plan_requests(s.gen_version, s.gen_busy, cfg.train.max_staleness, cfg.train.prompts_per_step,
                                  cfg.rollout.prompts_per_request, s.consumed, s.live,
                                  max_groups=cfg.train.total_steps * cfg.train.prompts_per_step):
            seed = cfg.rollout.seed * 1_000_003 + s.requests
            s.requests += 1
            self._request(i, self.source.next(k), seed)
            s.live += k

    def _request(self, i: int, rows: list[dict], seed: int) -> None:
        """One generation request on generator ``i``, graded and put in the buffer by reference."""
        s, a = self.s, self.actors
        r = Request(i, rows, seed, s.issued)
        s.issued += 1
        gen_ref = a.generators[i].generate.remote(rows, self.cfg.rollout.n, seed)
        graded = a.grader.grade.remote(rows, gen_ref)
        put_ref = a.buffer.put.remote(graded, [graded])  # the batch (resolved by Ray), and its reference
        s.gen_busy[i], s.gen_started[i] = True, time.time()
        s.pending[gen_ref] = Pending(GENERATED, r)
        s.pending[put_ref] = Pending(BUFFERED, r)  # re-issued as is if an actor's death fails it

    def on_generated(self, r: Request, _ref) -> None:
        s, now, i = self.s, time.time(), r.generator
        s.gen_busy[i] = False
        s.gen_busy_s[i] += now - s.gen_started[i]
        s.gen_spans.append((s.gen_started[i], now))

    def on_buffered(self, r: Request, ref) -> None:
        info: PutResult = ray.get(ref)
        s, w, k = self.s, self.s.window, len(r.rows)
        s.landed(r)  # a death after the one counted is counted anew
        s.live -= k - info.kept  # requested prompts that are not a kept group now (dropped, or merged:
        s.buffered += info.kept   # a request across an epoch boundary can hold a prompt twice, one group)
        for key, v in info.stats.items():
            w[key] += v
        for reason, count in info.invalid_reasons.items():  # cumulative, and since the last step
            s.invalid_by_reason[reason.split(":")[0]] += count
            w[f"invalid_reason/{reason}"] += count
        s.busy_s["grade"] += info.stats.get("grade_time_s", 0.0)
        if isinstance(self.source, Curriculum):  # pools held back or re-admitted by their signal
            for line in self.source.observe(info.pools, s.version):
                print(line, flush=True)
        if why := self.refill.observe(info, s.version, time.time()):  # groups dropped by dynamic sampling
            raise RunError(why)  # refilled algo.max_refill_rounds times without a full batch
        # judged over a batch's worth of samples, so one unlucky request does not stop a run
        n, bad = w["samples"], w["samples"] - w["valid"]
        if n >= self.cfg.samples_per_step and bad / n > self.cfg.reward.max_invalid_frac:
            reasons = {k.split("/", 1)[1]: int(v) for k, v in w.items() if k.startswith("invalid_reason/")}
            raise RunError(f"{int(bad)} of {int(n)} samples since the last step could not be graded "
                           f"(reward.max_invalid_frac={self.cfg.reward.max_invalid_frac}); reasons: {reasons}")

    # ------------------------------------------------------------ train -> broadcast
    def start_train_step(self) -> None:
        s, G = self.s, self.cfg.train.prompts_per_step
        if s.training is not None or s.buffered < G or s.stop_reason or s.signalled:
            return
        if (self.cfg.train.keep_best or self.stop_rule) and self.eval_due():
            return  # the learner keeps the evaluated weights (best/) and the stop lands on this step
        info: TakeRefs = ray.get(self.actors.buffer.take.remote(s.version, G))  # counts, and the batch by reference
        s.buffered -= info.taken + info.stale_dropped
        s.live -= info.taken + info.stale_dropped
        if info.batch is None:
            return
        s.consumed += info.taken
        s.trained_groups.append(info.groups)
        # by reference (actors.replay_buffer.BatchRefs): the rows stay in the objects the graded
        # requests were put in; the learner maps them (neither this process nor a LearnerGroup does)
        s.training = self.actors.learner.train_step.remote(info.batch, s.version)
        s.train_started = time.time()
        s.pending[s.training] = Pending(TRAINED)

    def on_trained(self, _, ref) -> None:
        metrics, s, now = ray.get(ref), self.s, time.time()
        s.training = None
        s.train_busy_s += now - s.train_started
        s.version += 1
        # generation that ran while this step trained (0 for a synchronous run)
        spans = s.gen_spans + [(s.gen_started[i], now) for i, busy in enumerate(s.gen_busy) if busy]
        metrics["async/gen_overlap_s"] = sum(max(0.0, min(b, now) - max(a, s.train_started)) for a, b in spans)
        s.gen_spans = []
        self.broadcast_weights()
        self.log_step(metrics)

    def grader_health(self) -> dict:
        """The grader's ``grader/*`` counts of this step (timeouts, errors, restarts, queue wait). Per-step
        counts only: the grader process's own totals restart with it (a resume, a restart). A grader that
        died or is restarting has lost them: its death is counted (once, however many calls see it) and
        the step goes on; this call runs inside the train step's completion, so letting the error
        through would stop the run as a failure of the learner."""
        try:
            health = ray.get(self.actors.grader.metrics_since_last.remote())
        except ray.exceptions.RayActorError as err:  # ActorDiedError, ActorUnavailableError (restarting)
            log.warning("the grader died (%s); Ray restarts it, this step has no grader/* counts", cause(err))
            self.on_failure(GRADER_METRICS, None, err)
            return {}
        return {k: v for k, v in health.items() if k.startswith("grader/") and not k.endswith("_total")}

    def broadcast_weights(self) -> None:
        """Weights out to every generator (each applies them at its next request boundary)."""
        s = self.s
        sent = self.actors.learner.broadcast_weights.remote()
        s.pending[sent] = Pending(SENT)
        for i, gen in enumerate(self.actors.generators):
            s.sync_pending += 1
            s.pending[gen.receive_weights.remote(*self.actors.receive_args(sent))] = Pending(RECEIVED, i)

    def on_weights_sent(self, _, ref) -> None:
        self.s.last_sync = {k: v for k, v in ray.get(ref).items() if k != "weights"}  # ipc: the handles
        self.s.busy_s["sync"] += self.s.last_sync.get("perf/sync_s", 0.0)

    def on_weights_received(self, i: int, ref) -> None:
        got = ray.get(ref)  # a failure is counted once, by the failure policy
        version = got["version"]
        self.s.gen_rss_mb[i] = got.get("rss_mb", 0.0)
        self.s.sync_pending -= 1
        self.s.gen_version[i] = version
        if self.s.sync_pending == 0:  # every update sent so far is in: the learner frees its ipc snapshots
            self.actors.release_weights()

    def log_step(self, m: dict) -> None:
        s, now = self.s, time.time()
        m.update(rollout_metrics(s.window, now - s.t_last_step))
        s.t_last_step = s.last_progress = now
        for dom, dm in domain_metrics(s.window).items():
            self.tracker.track(dm, s.version, {"domain": dom})
        m.update(utilisation_metrics(now - s.t_start, s.train_busy_s, s.gen_busy_s, s.busy_s))
        m.update({"sys/rss_mb/driver": rss_mb(), **{f"sys/rss_mb/generator{i}": v for i, v in enumerate(s.gen_rss_mb) if v}})
        m.update(s.last_sync)
        m.update(ray.get(self.actors.buffer.metrics.remote()))
        m.update(self.grader_health())
        m.update({f"reward/invalid_{reason}": v for reason, v in s.invalid_by_reason.items()})
        if isinstance(self.source, Curriculum):
            m.update(self.source.metrics())
        s.window = zero_sums()
        self.refill.step_done(now)
        self.tracker.track(m, s.version)
        m["perf/tracking_s"], s.tracking_s = self.tracker.seconds - s.tracking_s, self.tracker.seconds
        s.history.append({"step": s.version, "time": now - s.t_start, **m})
        print(progress_line(s.version, self.cfg.train.total_steps, m, s.t_start), flush=True)
        if line := reset_line(s.version, m, self.cfg.algo.ref_reset_optimizer):
            print(line, flush=True)
        for line in self.actor_warnings.poll(self.actors.all()):
            print(line, file=sys.stderr, flush=True)

    # ------------------------------------------------------------ evaluate, checkpoint
    def eval_due(self) -> bool:
        v, every = self.s.version, self.cfg.train.eval_interval
        return self.s.eval_owed or (bool(every) and 0 < v < self.cfg.train.total_steps and v % every == 0
                                    and self.s.last_eval != v)

    def evaluate_held_out(self) -> None:
        s, t0 = self.s, time.time()
        try:
            val = evaluate(self.cfg, self.actors, self.eval_rows, s.version, self.tracker)
        except EVALUATION_FAILED as err:
            return self.evaluation_failed(err)
        val.update({f"val/{k}": v for k, v in self.grader_health().items()})  # its grading, not the next step's
        reset = ray.get(self.actors.learner.observe_validation.remote(s.version, val["val/pass@1"]))  # stalled?
        self.tracker.track({**reset, **{k: v for k, v in val.items() if k.startswith("val/grader/")}}, s.version)
        s.busy_s["eval"] += time.time() - t0
        s.history[-1].update({**val, **reset, "val/time": time.time() - s.t_start})
        s.last_eval, s.eval_owed = s.version, False
        print(f"held-out at step {s.version}: " + "  ".join(
            f"{k.removeprefix('val/')} {v:.3f}" for k, v in val.items()
            if k.startswith("val/pass@") and k.count("/") == 1), flush=True)  # overall; per domain in Aim
        if line := reset_line(s.version, reset, self.cfg.algo.ref_reset_optimizer):
            print(line, flush=True)
        self.observe_evaluation(val, s.version, periodic=True)
        if isinstance(self.source, Curriculum):
            print(self.source.table(f"curriculum at step {s.version}"), flush=True)

    def evaluation_failed(self, err: Exception) -> None:
        """A generator restarted since its last sync (stale samples), or it or the grader died: counted
        by the failure policy; a full sync follows and the evaluation is done again."""
        if isinstance(err, StaleWeights):
            return self.apply(self.failures.on_stale_weights(str(err)))
        self.on_failure(EVALUATED, None, err)

    def observe_evaluation(self, val: dict, step: int, periodic: bool) -> None:
        """An evaluation of the learner's current weights (step ``step``): a new best is written as
        ``best/``; a periodic one that reaches ``train.stop_at`` ends the loop after it."""
        t, s = self.cfg.train, self.s
        try:
            for key, name in (("train.keep_best", t.keep_best), ("train.stop_at", self.stop_rule and self.stop_rule.metric)):
                if name:
                    require_logged(name, val, key)
        except ValueError as err:
            raise RunError(str(err)) from None
        if t.keep_best and improves(Best.from_dict(s.best), t.keep_best, t.keep_best_mode, val[t.keep_best]):
            best = Best(t.keep_best, t.keep_best_mode, step, val[t.keep_best])
            path = checkpointing.save_policy(self, BEST, best)
            s.best = best.to_dict()
            print(f"best: {best.metric} {best.value:.3f} at step {step} -> {path}", flush=True)
        if periodic and self.stop_rule and self.stop_rule.reached(val):
            s.stop_reason = self.stop_rule.reason(val, step)
            print(f"stopping: {s.stop_reason}; the checkpoint, the final evaluation and final/ follow", flush=True)

    def checkpoint_due(self) -> str:
        """"interval" every ``train.checkpoint_interval`` steps, "timed" once ``train.checkpoint_every_s``
        seconds passed since the newest checkpoint, else ""; never twice for a step, never for the
        last (the end's)."""
        s, t = self.s, self.cfg.train
        if self.run_dir is None or not 0 < s.version < t.total_steps or s.checkpointed == s.version:
            return ""
        if t.checkpoint_interval > 0 and s.version % t.checkpoint_interval == 0:
            return "interval"
        return "timed" if t.checkpoint_every_s > 0 and time.time() - s.checkpoint_t >= t.checkpoint_every_s else ""

    def checkpoint(self, reason: str) -> None:
        """A checkpoint of the current step (``reason``: interval, end, error ...), after the barrier;
        none without a run dir; also for a clean stop. An evaluation due at the step runs first: the checkpoint holds it."""
        if self.run_dir is not None:
            self.barrier()
            if reason in ("interval", "timed") and self.eval_due() and not self.s.resync_needed:
                self.evaluate_held_out()
            checkpointing.save(self, reason)

    def barrier(self) -> None:
        """Nothing new starts; everything in flight lands. Afterwards nothing is lost or generated twice."""
        deadline = time.time() + self.cfg.train.batch_timeout_s
        while self.s.pending:
            self.handle_completions(timeout=checkpointing.barrier_wait(len(self.s.pending), deadline, self.cfg.train))

    # ------------------------------------------------------------ completions and failures
    def handle_completions(self, timeout: float) -> None:
        """Everything ready now; finished generations first, so a request's generation span
        ends before the train step its groups complete can start."""
        pending = list(self.s.pending)
        ready, rest = ray.wait(pending, num_returns=1, timeout=timeout)
        if ready and rest:
            ready += ray.wait(rest, num_returns=len(rest), timeout=0)[0]
        ready.sort(key=lambda r: self.s.pending[r].kind != GENERATED)
        for ref in ready:
            if ref not in self.s.pending:
                continue
            work = self.s.pending.pop(ref)
            handler = {GENERATED: self.on_generated, BUFFERED: self.on_buffered, TRAINED: self.on_trained,
                       SENT: self.on_weights_sent, RECEIVED: self.on_weights_received}[work.kind]
            try:
                handler(work.payload, ref)
            except (ray.exceptions.RayTaskError, ray.exceptions.RayActorError) as err:
                self.on_failure(work.kind, work.payload, err)
            self.s.last_progress = time.time()

    def on_failure(self, kind: str, payload, err: Exception) -> None:
        """A call failed: the failure policy decides from what happened and the counters, the loop acts."""
        s = self.s
        facts = RunFacts(s.version, s.checkpointed, s.gen_failures, s.grader_failures, s.grader_down, s.stopping, s.gen_down)
        self.apply(self.failures.on_failure(kind, payload, self.actors.failure(err), facts))

    def apply(self, actions) -> None:
        """The failure policy's actions, in order (a Stop raises the RunError that ends the run)."""
        s = self.s
        for a in actions:
            if isinstance(a, Reissue):
                s.gen_busy[a.request.generator] = False
                s.retry.append((a.request.rows, a.request.seed))  # still counted live: re-issued once, with the current weights
                s.reissued.extend(str(r["id"]) for r in a.request.rows)
                log.warning("%s", a.warning)
            elif isinstance(a, Count):
                s.gen_failures, s.grader_failures = a.gen_failures, a.grader_failures
                s.mark_down(a.gen_down, a.grader_down)
            elif isinstance(a, Resync):
                if a.warning:
                    log.warning("%s", a.warning)
                s.sync_pending -= a.received
                s.resync_needed = True
            elif isinstance(a, EvaluateAgain):
                s.eval_owed = True  # at the version current after the re-sync
            elif isinstance(a, Stop):
                s.learner_dead, s.buffer_dead = s.learner_dead or a.learner_dead, s.buffer_dead or a.buffer_dead
                raise RunError(a.message) from None
            else:
                raise TypeError(f"not a failure action: {a!r}")

    def resync_weights(self) -> None:
        """Full sync after a failure: every generator alive, a new group, the current weights to all."""
        self.actors.wait_generators_ready()
        self.actors.form_weight_sync(self.cfg)
        self.s.gen_version = self.actors.sync_all(self.cfg, "full weight sync")
        self.s.resync_needed = False
        self.s.resyncs += 1


def fitted_rows(cfg: Config, model_path: str, rows: list[dict], source: str, lengths: list) -> tuple[list, int]:
    """``rows`` whose prompt + ``rollout.max_new_tokens`` fit the model's context; how many were
    dropped (warned). The kept prompts' lengths are appended to ``lengths``."""
    return drop_unfit(rows, load_tokenizer(model_path), context_length(model_path), cfg.rollout.max_new_tokens,
                      source, strict=cfg.data.strict, lengths=lengths)


def run_preflight(cfg: Config, actors: Actors, source: Curriculum) -> None:
    """Every pool sampled before step 1 and the table printed; a mix without signal stops here, with the table."""
    t0 = time.time()
    results = preflight(cfg, actors, source.preflight_rows(cfg.curriculum.preflight_prompts))
    try:
        table = source.preflight(results)
    except NoSignal as err:
        raise RunError(str(err)) from None
    print(f"{table}\n(preflight: {time.time() - t0:.0f}s)", flush=True)


def run(cfg: Config, resume=None) -> dict:
    """One training run; ``resume`` (a :class:`prorl_async.checkpoint.Checkpoint` of ``cfg.run_dir``)
    continues that run exactly where the checkpoint left it."""
    t0 = time.time()
    run_dir = prepare_run_dir(cfg)
    save_config(cfg, run_dir / "config.yaml")
    print(f"run directory: {run_dir}", flush=True)
    restore = quiet_driver(run_dir / "logs")  # other packages' warnings and log records to the log file
    try:
        return _run(cfg, resume, run_dir, t0)
    finally:
        restore()


def _run(cfg: Config, resume, run_dir, t0: float) -> dict:
    model_path = resolve_model_path(cfg.model, seed=cfg.train.seed)
    for module in cfg.reward.extra_modules:  # custom verifiers register their domains on import
        importlib.import_module(module)
    lengths: list[int] = []  # of every prompt: vLLM's context on GPU is the longest + max_new_tokens
    eval_rows, eval_dropped = fitted_rows(cfg, model_path, load_source(cfg.data.eval, cfg.data), "data.eval", lengths)
    train_rows, train_dropped = fitted_rows(cfg, model_path, load_train_rows(cfg.data), "data.train", lengths)
    source = prompt_source(cfg, train_rows)
    started = init_ray(cfg, log_dir=run_dir / "logs")  # actors' output: logs/<role>.log
    tracker = actors = loop = None
    try:
        tracker = Tracker(cfg.tracking.aim_repo, cfg.tracking.experiment, cfg.tracking.run_name or run_dir.name,
                          config_to_dict(cfg), enabled=cfg.tracking.enabled, run_hash=checkpointing.aim_hash(resume))
        actors = Actors.start(cfg, model_path, name=f"prorl-{run_dir.name}", longest_prompt=max(lengths, default=0))
        storage.open_run_dir(cfg, actors.learner, run_dir, model_path)  # seen from the learner's nodes; the ledger
        if isinstance(source, Curriculum) and resume is None:
            run_preflight(cfg, actors, source)
            tracker.track(source.metrics(), 0)
        before = {} if resume is not None else held_out(cfg, actors, eval_rows, 0, tracker)
        if before:  # the first held-out score the reference-reset policy sees
            ray.get(actors.learner.observe_validation.remote(0, before["val/pass@1"]))
        loop = TrainingLoop(cfg, actors, source, tracker, eval_rows, run_dir, model_path, before)
        if resume is not None:
            checkpointing.restore(loop, resume)
        else:
            loop.observe_evaluation(before, 0, periodic=False)
        try:
            with stop_on_sigterm(loop.s):
                history = loop.run()
        except RunError:
            # a run that must stop keeps its last good state (the learner's weights are never
            # updated by a non-finite step), unless the learner itself is gone
            loop.s.stopping = True
            if not (loop.s.learner_dead or loop.s.buffer_dead):
                try:
                    loop.checkpoint("error")
                except Exception as e:  # the stop reason matters more than this checkpoint
                    log.warning("no checkpoint at the stop: %s", cause(e))
            raise
        if loop.s.signalled:  # the step in flight has landed: checkpoint and exit, no final evaluation
            loop.checkpoint("signal")
            raise Stopped(loop.s.signalled, loop.s.version, run_dir)
        loop.checkpoint("stop_at" if loop.s.stop_reason else "end")
        steps = loop.s.version
        try:
            after = held_out(cfg, actors, eval_rows, steps, tracker)
        except EVALUATION_FAILED as err:  # as a periodic one: one full sync, evaluated once more
            loop.evaluation_failed(err)
            loop.resync_weights()
            after = held_out(cfg, actors, eval_rows, steps, tracker)
        loop.observe_evaluation(after, steps, periodic=False)
        checkpointing.save_policy(loop, FINAL)
        summary: dict[str, Any] = {"run_dir": str(run_dir), "aim_run_hash": tracker.hash, "steps": steps,
                   "wall_time_s": time.time() - t0, "before": loop.s.before, "after": after,
                   "max_trained_staleness": max((h.get("async/trained_staleness_max", 0) for h in history), default=0),
                   "generator_failures": loop.s.gen_failures, "grader_failures": loop.s.grader_failures,
                   "weight_resyncs": loop.s.resyncs, "reissued_prompts": loop.s.reissued,
                   "weight_sync_backend": actors.sync_backend,
                   "prompts_consumed": source.consumed, "stopped": loop.s.stop_reason or None,
                   "best": loop.s.best if cfg.train.keep_best else None,
                   "prompts_dropped": {"data.train": train_dropped, "data.eval": eval_dropped},
                   "final_metrics": history[-1] if history else {}}
        if isinstance(source, Curriculum):
            summary["curriculum"] = source.state_dict()["pools"]
            print(source.table("curriculum at the end"), flush=True)
        tracker.set("summary", {k: v for k, v in summary.items() if k != "final_metrics"})
        write_final(run_dir, summary, history, loop.s.trained_groups)
        print(format_table(loop.s.before, after), flush=True)
        if summary["best"]:
            b = summary["best"]
            print(f"best: {b['metric']} {b['value']:.3f} at step {b['step']} ({run_dir / BEST})", flush=True)
        if loop.s.stop_reason:
            print(f"stopped early: {loop.s.stop_reason}", flush=True)
        print(f"done: {steps} steps in {summary['wall_time_s']:.0f}s; run dir {run_dir}", flush=True)
        return summary
    finally:
        if loop is not None:  # warnings raised since the last step
            for line in loop.actor_warnings.poll(actors.all(), wait_s=5.0):
                print(line, file=sys.stderr, flush=True)
        if tracker is not None:
            tracker.close()
        if actors is not None:
            actors.shutdown()
        if started:
            ray.shutdown()
