"""The driver: wires the actors and runs generate -> grade -> buffer -> train -> broadcast.

Long-lived actors do the work; this loop only decides *when*. Rollout and training overlap
under a staleness bound kept by admission control (:mod:`prorl_async.staleness`): a
generator with weights of version ``v`` starts a request only while the groups consumed,
live and requested fit into ``(v + max_staleness + 1) * prompts_per_step``; the buffer
re-checks the bound when it hands a batch out. ``max_staleness=0`` is the synchronous,
strictly on-policy baseline through the same code.
"""

from __future__ import annotations

import importlib
import json
import logging
import math
import os
import secrets
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import ray

from prorl_async.config import Config, config_to_dict, save_config
from prorl_async.data.datasets import load_rows, mix
from prorl_async.data.source import PromptSource
from prorl_async.models import resolve_model_path
from prorl_async.staleness import plan_requests
from prorl_async.tracking import Tracker, progress_line

from actors.generator import GeneratorActor
from actors.grader import GraderActor
from actors.learner import start_learner
from actors.replay_buffer import ReplayBufferActor

log = logging.getLogger("prorl_async")


class RunError(RuntimeError):
    """A run that cannot go on; the message says why."""


def _cause(err: Exception) -> str:
    cause = getattr(err, "cause", None) or err
    return f"{type(cause).__name__}: {str(cause).strip().splitlines()[-1] if str(cause).strip() else ''}"


def _generator_died(err: Exception) -> bool:
    """True if a failed request's chain (generate -> grade -> put) failed because an actor died."""
    seen = 0
    while err is not None and seen < 5:
        if isinstance(err, (ray.exceptions.RayActorError, ray.exceptions.ActorDiedError,
                            ray.exceptions.ActorUnavailableError)):
            return True
        err = getattr(err, "cause", None)
        seen += 1
    return False


# ---------------------------------------------------------------------------- cluster
def local_cluster_auth() -> None:
    """Token auth for a local cluster started by this process, with the token in the environment only."""
    if os.environ.get("RAY_AUTH_MODE") is not None:
        return
    os.environ["RAY_AUTH_MODE"] = "token"
    default_token = Path.home() / ".ray" / "auth_token"
    if not (os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH") or default_token.exists()):
        os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
    from ray._raylet import Config as _RayConfig  # Ray caches the auth mode at import time
    _RayConfig.initialize("")


def init_ray(cfg: Config) -> bool:
    """Join the configured / job cluster, or start a local one. Returns True if started here.

    Ray 2.60 turns token authentication on for new local clusters and would write a token to
    ``~/.ray/auth_token``. A local cluster started here keeps auth on but passes a fresh
    token through the environment only (``RAY_AUTH_TOKEN``), so nothing is written outside
    the run's directories; ``RAY_AUTH_MODE=disabled`` opts out. Joining an existing cluster
    uses whatever token the environment or ``~/.ray/auth_token`` provides.
    """
    if ray.is_initialized():
        return False
    address = cfg.ray.address or os.environ.get("RAY_ADDRESS", "")
    if address:
        ray.init(address=address, logging_level=logging.WARNING)
        return False
    local_cluster_auth()
    ray.init(num_cpus=cfg.ray.num_cpus or None, include_dashboard=False, logging_level=logging.WARNING,
             configure_logging=True, log_to_driver=True)
    return True


PLACEMENT_TIMEOUT_S = 300.0


def generator_placement(cfg: Config, index: int, timeout_s: float = PLACEMENT_TIMEOUT_S) -> tuple[dict, object]:
    """Ray options for generator ``index``, and its placement group (None below 2 GPUs).

    A generator that asks for more than one GPU (a tensor-parallel vLLM engine) gets its own
    placement group: one STRICT_PACK bundle with all its GPUs and CPUs, reserved together on
    one node before the engine starts. The engine's processes and any Ray tasks it starts
    (captured as child tasks) share that bundle, and a cluster with no node that fits fails
    here with the numbers instead of leaving the actor pending.
    """
    r = cfg.rollout
    opts = {"num_cpus": r.generator_num_cpus, "num_gpus": r.generator_num_gpus}
    if r.generator_num_gpus <= 1:
        return opts, None
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    bundle = {"GPU": r.generator_num_gpus, **({"CPU": r.generator_num_cpus} if r.generator_num_cpus else {})}
    pg = placement_group([bundle], strategy="STRICT_PACK", name=f"prorl-generator-{index}")
    if not pg.wait(timeout_seconds=timeout_s):
        remove_placement_group(pg)
        raise RunError(f"no node can hold generator {index}'s bundle {bundle} (rollout.generator_num_gpus="
                       f"{r.generator_num_gpus}, rollout.generator_num_cpus={r.generator_num_cpus}) within "
                       f"{timeout_s:.0f}s; cluster resources: {ray.cluster_resources()}")
    opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
        pg, placement_group_bundle_index=0, placement_group_capture_child_tasks=True)
    return opts, pg


@dataclass
class Actors:
    generators: list
    grader: object
    buffer: object
    learner: object
    placement_groups: list = field(default_factory=list)
    sync_epoch: int = 0

    @classmethod
    def start(cls, cfg: Config, model_path: str, name: str = "") -> "Actors":
        r, t = cfg.rollout, cfg.train
        learner = start_learner(cfg, model_path, f"{name}/learner" if name else "")  # or a data-parallel LearnerGroup
        placed = [generator_placement(cfg, i) for i in range(r.num_generators)]
        # Ray restarts a dead generator (up to max_generator_failures times); the driver then
        # re-forms the weight-sync group and gives it the current weights before it serves.
        gens = [GeneratorActor.options(**opts, max_restarts=r.max_generator_failures, max_task_retries=0,
                                       **({"name": f"{name}/generator-{i}"} if name else {}))
                .remote(cfg, model_path, i) for i, (opts, _) in enumerate(placed)]
        grader = GraderActor.options(num_cpus=0).remote(cfg)
        buffer = ReplayBufferActor.options(num_cpus=0).remote(t.max_staleness, cfg.algo.dynamic_sampling)
        actors = cls(gens, grader, buffer, learner, [pg for _, pg in placed if pg is not None])
        _get(actors.generators, [g.ready.remote() for g in gens] + [grader.ready.remote()], 600, "starting the actors")
        actors.form_weight_sync(cfg)
        return actors

    def form_weight_sync(self, cfg: Config) -> None:
        """(Re)build the weight-sync group: learner rank 0 + every generator (a TP=k engine takes k ranks)."""
        r, t = cfg.rollout, cfg.train
        backend = cfg.ray.weight_sync_backend
        if backend == "auto":
            backend = "nccl" if r.generator_num_gpus > 0 and t.learner_num_gpus > 0 else "gloo"
        self.sync_epoch += 1
        host, port = _get(self.generators, self.learner.sync_address.remote(self.sync_epoch), 600, "weight sync")
        ranks = _get(self.generators, [g.weight_sync_ranks.remote() for g in self.generators], 600, "weight sync")
        world = 1 + sum(ranks)
        _get(self.generators, [self.learner.init_weight_sync.remote(host, port, world, backend)]
             + [g.init_weight_sync.remote(host, port, 1 + sum(ranks[:i]), world, backend)
                for i, g in enumerate(self.generators)], t.sync_timeout_s, "forming the weight-sync group")

    def all(self) -> list:
        return [*self.generators, self.grader, self.buffer, self.learner]


def _get(generators, refs, timeout: float, what: str):
    """``ray.get`` whose failures become one clear :class:`RunError`."""
    try:
        return ray.get(refs, timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        raise RunError(f"{what}: no answer within {timeout:.0f}s") from None
    except ray.exceptions.RayTaskError as e:
        cause = e.cause if getattr(e, "cause", None) is not None else e
        raise RunError(f"{what} failed: {type(cause).__name__}: {cause}") from None


# ---------------------------------------------------------------------------- evaluation
def evaluate(cfg: Config, actors: Actors, rows: list[dict], step: int, tracker: Tracker,
             greedy: bool = False) -> dict:
    """Held-out pass@1 (mean over samples) and pass@k, overall and per domain."""
    n = 1 if greedy else cfg.train.eval_samples
    chunk = cfg.rollout.prompts_per_request
    refs = []
    for i in range(0, len(rows), chunk):
        part = rows[i:i + chunk]
        gen = actors.generators[(i // chunk) % len(actors.generators)]
        seed = cfg.train.seed * 1_000_003 + 7919 * i + 17  # same seeds at every evaluation
        refs.append(actors.grader.grade.remote(part, gen.generate.remote(part, n, seed, greedy)))
    batches = ray.get(refs)
    per_prompt: dict[str, list[float]] = defaultdict(list)
    domain_of: dict[str, str] = {}
    samples = []
    for b in batches:
        d = b.to_pydict()
        for pid, dom, rew, valid, text in zip(d["prompt_id"], d["domain"], d["raw_reward"],
                                               d["reward_valid"], d["response_text"]):
            per_prompt[pid].append(1.0 if valid and rew >= 1.0 - 1e-6 else 0.0)
            domain_of[pid] = dom
            if len(samples) < cfg.tracking.log_samples:
                samples.append(f"[{dom}] reward={rew:.2f} :: {text}")
    prefix = "val/greedy" if greedy else "val"
    out = {}
    groups = {"all": list(per_prompt)}
    for pid, dom in domain_of.items():
        groups.setdefault(dom, []).append(pid)
    for dom, pids in groups.items():
        p1 = sum(sum(per_prompt[p]) / len(per_prompt[p]) for p in pids) / len(pids)
        pk = sum(max(per_prompt[p]) for p in pids) / len(pids)
        key = "" if dom == "all" else f"/{dom}"
        out[f"{prefix}/pass@1{key}"] = p1
        if not greedy:
            out[f"{prefix}/pass@{n}{key}"] = pk
    tracker.track(out, step, {"split": "eval"})
    if samples and not greedy:
        tracker.text("val/samples", samples, step, {"split": "eval"})
    return out


# ---------------------------------------------------------------------------- the loop
@dataclass
class LoopState:
    version: int = 0          # learner policy version = learner steps done
    consumed: int = 0         # groups handed to the learner
    live: int = 0             # groups in flight or waiting in the buffer
    buffered: int = 0         # informative groups waiting in the buffer
    requests: int = 0
    gen_version: list = field(default_factory=list)
    gen_busy: list = field(default_factory=list)
    gen_busy_s: list = field(default_factory=list)
    gen_started: list = field(default_factory=list)
    training: Optional[object] = None
    train_busy_s: float = 0.0
    sync_pending: int = 0
    resyncs: int = 0
    busy_s: dict = field(default_factory=lambda: defaultdict(float))  # cumulative seconds: grade, sync, eval
    window: dict = field(default_factory=lambda: defaultdict(float))  # rollout stats since last step


class TrainingLoop:
    def __init__(self, cfg: Config, actors: Actors, source: PromptSource, tracker: Tracker,
                 eval_rows: list[dict]):
        self.cfg, self.actors, self.source, self.tracker, self.eval_rows = cfg, actors, source, tracker, eval_rows
        g = len(actors.generators)
        self.s = LoopState(gen_version=[0] * g, gen_busy=[False] * g, gen_busy_s=[0.0] * g, gen_started=[0.0] * g)
        self.pending: dict = {}   # ObjectRef -> (handler, args)
        self.requests: dict = {}  # put ObjectRef -> (generator, rows, seed), to re-issue if it dies
        self.retry: list = []     # (rows, seed) of requests whose generator died
        self.resync_needed = False
        self.learner_dead = False
        self.gen_failures = 0
        self.trained_groups: list[list[str]] = []
        self.invalid_by_reason: dict = defaultdict(float)
        self.history: list[dict] = []
        self.t_start = time.time()
        self.t_last_step = self.t_start
        self.last_progress = time.time()

    # ------------------------------------------------------------ dispatch
    def _dispatch_generation(self) -> None:
        cfg, s = self.cfg, self.s
        plan = plan_requests(s.gen_version, s.gen_busy, cfg.train.max_staleness, cfg.train.prompts_per_step,
                             cfg.rollout.prompts_per_request, s.consumed, s.live)
        for i, k in plan:
            rows = self.source.next(k)
            seed = cfg.rollout.seed * 1_000_003 + s.requests
            s.requests += 1
            self._submit(i, rows, seed)
            s.live += k

    def _submit(self, i: int, rows: list[dict], seed: int) -> None:
        """One generation request on generator ``i``, graded and put in the buffer by reference."""
        gen = self.actors.generators[i]
        gen_ref = gen.generate.remote(rows, self.cfg.rollout.n, seed)
        put_ref = self.actors.buffer.put.remote(self.actors.grader.grade.remote(rows, gen_ref))
        self.s.gen_busy[i], self.s.gen_started[i] = True, time.time()
        self.pending[gen_ref] = (self._on_generated, (i,))
        self.pending[put_ref] = (self._on_buffered, (len(rows),))
        self.requests[put_ref] = (i, rows, seed)

    def _dispatch_training(self) -> None:
        s, G = self.s, self.cfg.train.prompts_per_step
        if s.training is not None or s.buffered < G:
            return
        info = ray.get(self.actors.buffer.take.remote(s.version, G))
        s.buffered -= info["taken"] + info["stale_dropped"]
        s.live -= info["taken"] + info["stale_dropped"]
        if info["table"] is None:
            return
        s.consumed += info["taken"]
        self.trained_groups.append(info["groups"])  # request_id/prompt_id of every group, per step
        s.training = self.actors.learner.train_step.remote(info["table"], s.version)
        self._train_started = time.time()
        self.pending[s.training] = (self._on_trained, ())

    # ------------------------------------------------------------ completions
    def _on_generated(self, i: int, _ref) -> None:
        self.s.gen_busy[i] = False
        self.s.gen_busy_s[i] += time.time() - self.s.gen_started[i]

    def _on_buffered(self, k: int, ref) -> None:
        info = ray.get(ref)
        s, w = self.s, self.s.window
        s.live -= info["dropped"]
        s.buffered += info["kept"]
        for key, v in info["stats"].items():
            w[key] += v
        for reason, count in info["invalid_reasons"].items():  # cumulative, and since the last step
            self.invalid_by_reason[reason.split(":")[0]] += count
            w[f"invalid_reason/{reason}"] += count
        s.busy_s["grade"] += info["stats"].get("grade_time_s", 0.0)
        # judged over a batch's worth of samples, so one unlucky request does not stop a run
        n, bad = w["samples"], w["samples"] - w["valid"]
        if n >= self.cfg.samples_per_step and bad / n > self.cfg.reward.max_invalid_frac:
            reasons = {k.split("/", 1)[1]: int(v) for k, v in w.items() if k.startswith("invalid_reason/")}
            raise RunError(f"{int(bad)} of {int(n)} samples since the last step could not be graded "
                           f"(reward.max_invalid_frac={self.cfg.reward.max_invalid_frac}); reasons: {reasons}")

    def _on_trained(self, _ref) -> None:
        metrics = ray.get(_ref)
        s, cfg = self.s, self.cfg
        s.training = None
        s.train_busy_s += time.time() - self._train_started
        s.version += 1
        # weights out to every generator (they apply them at their next request boundary)
        sync_ref = self.actors.learner.broadcast_weights.remote()
        self.pending[sync_ref] = (self._on_sync_sent, ())
        for i, gen in enumerate(self.actors.generators):
            s.sync_pending += 1
            self.pending[gen.receive_weights.remote()] = (self._on_sync_received, (i,))
        self._log_step(metrics)

    def _on_sync_sent(self, ref) -> None:
        self._last_sync = ray.get(ref)
        self.s.busy_s["sync"] += self._last_sync.get("perf/sync_s", 0.0)

    def _on_sync_received(self, i: int, ref) -> None:
        self.s.sync_pending -= 1
        info = ray.get(ref)
        self.s.gen_version[i] = info["version"]

    # ------------------------------------------------------------ failures
    def _on_failure(self, handler, args, ref, err: Exception) -> None:
        """A call failed. Generators are restarted and re-synced; everything else stops the run."""
        request = self.requests.pop(ref, None)
        if handler == self._on_buffered and request is not None and _generator_died(err):
            i, rows, seed = request
            self.gen_failures += 1
            log.warning("generator %d died (%s); %d prompts re-issued", i, type(err).__name__, len(rows))
            if self.gen_failures > self.cfg.rollout.max_generator_failures:
                raise RunError(f"generators died {self.gen_failures} times (rollout.max_generator_failures="
                               f"{self.cfg.rollout.max_generator_failures}); last: {_cause(err)}")
            self.s.gen_busy[i] = False
            self.retry.append((rows, seed))  # still counted live: re-issued once, with the current weights
            self.resync_needed = True
            return
        if handler in (self._on_sync_sent, self._on_sync_received):
            if handler == self._on_sync_received:
                self.s.sync_pending -= 1
            log.warning("weight sync failed (%s); re-forming the group", _cause(err))
            self.resync_needed = True
            return
        if handler == self._on_trained:
            self.learner_dead = _generator_died(err)  # an actor death, not an exception inside a live learner
            raise RunError(f"the learner failed at step {self.s.version + 1}: {_cause(err)}")
        raise RunError(f"{getattr(handler, '__name__', handler)} failed: {_cause(err)}")

    def _resync(self) -> None:
        """Full sync after a failure: every generator alive, a new group, the current weights to all."""
        a = self.actors
        deadline = time.time() + 600
        for i, g in enumerate(a.generators):  # a restarting actor refuses calls until it is back
            while True:
                try:
                    ray.get(g.ready.remote(), timeout=max(1.0, deadline - time.time()))
                    break
                except (ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError) as e:
                    if time.time() > deadline:
                        raise RunError(f"generator {i} did not come back within 600s: {_cause(e)}") from None
                    time.sleep(0.5)
        a.form_weight_sync(self.cfg)
        infos = _get(a.generators, [a.learner.broadcast_weights.remote()]
                     + [g.receive_weights.remote() for g in a.generators], self.cfg.train.sync_timeout_s, "full weight sync")
        for i, info in enumerate(infos[1:]):
            self.s.gen_version[i] = info["version"]
        self.resync_needed = False
        self.s.resyncs += 1

    def _dispatch_retries(self) -> None:
        for i in range(len(self.actors.generators)):
            if self.retry and not self.s.gen_busy[i]:
                rows, seed = self.retry.pop(0)
                self._submit(i, rows, seed)

    # ------------------------------------------------------------ metrics
    def _log_step(self, m: dict) -> None:
        s, w, now = self.s, self.s.window, time.time()
        dt = max(now - self.t_last_step, 1e-9)
        self.t_last_step = now
        samples = max(w["samples"], 1.0)
        m.update({
            "reward/mean": w["reward_sum"] / max(w["valid"], 1.0),
            "reward/accuracy": w["correct"] / max(w["valid"], 1.0),
            "reward/invalid": w["samples"] - w["valid"],
            "len/generated_mean": w["response_tokens"] / samples,
            "perf/gen_tok_s": w["response_tokens"] / dt,
            "perf/samples_s": w["samples"] / dt,
            "perf/step_s": dt,
        })
        for key, v in list(w.items()):
            if key.startswith("domain_valid/"):
                dom = key.split("/", 1)[1]
                self.tracker.track({"reward/accuracy": w[f"domain_correct/{dom}"] / max(v, 1.0),
                                    "reward/mean": w[f"domain_reward/{dom}"] / max(v, 1.0)}, s.version, {"domain": dom})
        elapsed = max(now - self.t_start, 1e-9)
        m["async/learner_idle_frac"] = 1.0 - s.train_busy_s / elapsed
        m["async/generator_idle_frac"] = 1.0 - sum(s.gen_busy_s) / (elapsed * len(s.gen_busy_s))
        m["async/grader_idle_frac"] = 1.0 - s.busy_s["grade"] / elapsed
        m.update({"time/generate_s": sum(s.gen_busy_s), "time/grade_s": s.busy_s["grade"],  # cumulative
                  "time/train_s": s.train_busy_s, "time/sync_s": s.busy_s["sync"], "time/eval_s": s.busy_s["eval"]})
        sync = getattr(self, "_last_sync", None) or {}
        m.update(sync)
        m.update(ray.get(self.actors.buffer.metrics.remote()))
        m.update({f"reward/invalid_{reason}": v for reason, v in self.invalid_by_reason.items()})
        s.window = defaultdict(float)
        self.tracker.track(m, s.version)
        self.history.append({"step": s.version, "time": now - self.t_start, **m})
        print(progress_line(s.version, self.cfg.train.total_steps, m, self.t_start), flush=True)
        self.last_progress = now

    # ------------------------------------------------------------ run
    def _eval_due(self) -> bool:
        v, every = self.s.version, self.cfg.train.eval_interval
        return bool(every) and 0 < v < self.cfg.train.total_steps and v % every == 0 and self._last_eval != v

    def _handle_ready(self, timeout: float) -> None:
        ready, _ = ray.wait(list(self.pending), num_returns=1, timeout=timeout)
        for ref in ready:
            handler, args = self.pending.pop(ref)
            try:
                handler(*args, ref)
            except (ray.exceptions.RayTaskError, ray.exceptions.RayActorError) as err:
                self._on_failure(handler, args, ref, err)
            else:
                self.requests.pop(ref, None)
            self.last_progress = time.time()

    def run(self) -> list[dict]:
        cfg, s = self.cfg, self.s
        while s.version < cfg.train.total_steps or s.training is not None:
            if self._checkpoint_due():
                self.save_checkpoint("interval")
                continue
            if self._eval_due():  # pause new rollouts; evaluate once generators hold the new weights
                if not any(s.gen_busy) and s.sync_pending == 0:
                    t_eval = time.time()
                    val = evaluate(cfg, self.actors, self.eval_rows, s.version, self.tracker)
                    s.busy_s["eval"] += time.time() - t_eval
                    self.history[-1].update({**val, "val/time": time.time() - self.t_start})
                    self._last_eval = s.version
            elif self.resync_needed:
                if s.training is None and s.sync_pending == 0:
                    self._resync()
            elif s.version < cfg.train.total_steps:
                self._dispatch_retries()
                self._dispatch_generation()
            if s.version + (s.training is not None) < cfg.train.total_steps:
                self._dispatch_training()
            self._handle_ready(timeout=1.0)
            if time.time() - self.last_progress > cfg.train.batch_timeout_s:
                raise RunError(f"no progress for {cfg.train.batch_timeout_s:.0f}s (train.batch_timeout_s); "
                               f"{len(self.pending)} calls pending, buffer holds {s.buffered} groups")
        while self.pending:  # in-flight rollouts and the last weight sync land before the final evaluation
            self._handle_ready(timeout=cfg.train.sync_timeout_s)
        return self.history

    _last_eval = -1

    # ------------------------------------------------------------ checkpoints (prorl_async.checkpoint)
    run_dir: Optional[Path] = None   # set by run(); no run dir, no checkpoints
    model_path: str = ""             # the run's model folder (its tokenizer goes into each checkpoint)
    before: dict = {}                # held-out metrics before training (kept across resumes)
    _ckpt_version = -1

    def _checkpoint_due(self) -> bool:
        v, every = self.s.version, self.cfg.train.checkpoint_interval
        return (self.run_dir is not None and every > 0 and 0 < v < self.cfg.train.total_steps
                and v % every == 0 and self._ckpt_version != v)

    def _barrier(self) -> None:
        """Nothing new starts; in-flight requests land in the buffer, a running train step and its
        weight sync finish. Afterwards nothing is in flight, so nothing is lost or generated twice."""
        deadline = time.time() + self.cfg.train.batch_timeout_s
        while self.pending:
            if time.time() > deadline:
                raise RunError(f"checkpoint barrier: {len(self.pending)} calls still pending after "
                               f"{self.cfg.train.batch_timeout_s:.0f}s (train.batch_timeout_s); the previous checkpoint is kept")
            self._handle_ready(timeout=min(self.cfg.train.sync_timeout_s, max(deadline - time.time(), 0.1)))

    def save_checkpoint(self, reason: str) -> Optional[Path]:
        """A checkpoint of the current step at a barrier (``reason``: interval, end, error ...).

        Callable by failure handling for a clean stop while the learner is alive; a step already
        checkpointed is not written again. Returns the checkpoint directory (None without a run dir).
        """
        import pyarrow.parquet as pq
        import torch

        from prorl_async import checkpoint
        from prorl_async.rng import rng_state

        if self.run_dir is None:
            return None
        self._barrier()
        s = self.s
        if self._ckpt_version == s.version:
            return None
        t0 = time.time()
        buf = ray.get(self.actors.buffer.state_dict.remote(), timeout=self.cfg.train.sync_timeout_s)

        def write(tmp: Path) -> dict:
            ray.get(self.actors.learner.save_checkpoint.remote(str(tmp.resolve()), self.model_path),
                    timeout=max(self.cfg.train.sync_timeout_s, 600))
            save_config(self.cfg, tmp / "config.yaml")
            pq.write_table(buf["table"], tmp / "buffer.parquet")
            (tmp / "driver.json").write_text(json.dumps(self.state_dict(buf["counters"]), default=_jsonable))
            torch.save(rng_state(), tmp / "driver_rng.pt")
            (tmp / "history.jsonl").write_text("".join(json.dumps(h) + "\n" for h in self.history))
            return {"version": s.version, "reason": reason, "groups_consumed": s.consumed,
                    "prompts_drawn": self.source.consumed, "buffered_groups": s.buffered}

        path = checkpoint.save(self.run_dir, s.version, write, keep_last=self.cfg.train.keep_last)
        self._ckpt_version = s.version
        # the run directory's history follows the checkpoints (a crashed run keeps what it had)
        checkpoint.atomic_write_text(self.run_dir / "history.jsonl", "".join(json.dumps(h) + "\n" for h in self.history))
        print(f"checkpoint {path} ({reason}, {time.time() - t0:.1f}s)", flush=True)
        return path

    def state_dict(self, buffer_counters: dict) -> dict:
        """The driver's part of a checkpoint (JSON): counters, data cursor, cumulative stats."""
        s = self.s
        return {
            "version": s.version, "consumed": s.consumed, "live": s.live, "buffered": s.buffered,
            "requests": s.requests, "source": self.source.state_dict(), "window": dict(s.window),
            "busy_s": dict(s.busy_s), "train_busy_s": s.train_busy_s, "gen_busy_s": list(s.gen_busy_s),
            "resyncs": s.resyncs, "elapsed_s": time.time() - self.t_start, "last_eval": self._last_eval,
            "retry": [[rows, seed] for rows, seed in self.retry],
            "gen_failures": self.gen_failures, "invalid_by_reason": dict(self.invalid_by_reason),
            "trained_groups": self.trained_groups, "buffer_counters": buffer_counters,
            "aim_run_hash": self.tracker.hash, "before": self.before,
        }

    def restore(self, ckpt) -> None:
        """Back to checkpoint ``ckpt``: learner, buffer, data cursor, counters, RNG states, history;
        generators get the checkpoint's weights and version through one full weight sync."""
        import pyarrow.parquet as pq
        import torch

        from prorl_async.rng import set_rng_state

        d = json.loads((ckpt.path / "driver.json").read_text())
        version = _get(self.actors.generators, self.actors.learner.load_checkpoint.remote(str(ckpt.path.resolve())),
                       600, "restoring the learner")
        if version != d["version"]:
            raise RunError(f"checkpoint {ckpt.path}: learner version {version} != driver version {d['version']}")
        table = pq.read_table(ckpt.path / "buffer.parquet")
        n = ray.get(self.actors.buffer.load_state_dict.remote({"table": table, "counters": d["buffer_counters"]}))
        if n != d["buffered"]:
            raise RunError(f"checkpoint {ckpt.path}: buffer holds {n} groups, the driver counted {d['buffered']}")
        infos = _get(self.actors.generators, [self.actors.learner.broadcast_weights.remote()]
                     + [g.receive_weights.remote() for g in self.actors.generators],
                     self.cfg.train.sync_timeout_s, "weight sync of the restored policy")
        s = self.s
        s.gen_version = [info["version"] for info in infos[1:]]
        s.version, s.consumed, s.live, s.buffered, s.requests = (d["version"], d["consumed"], d["live"],
                                                                  d["buffered"], d["requests"])
        s.window = defaultdict(float, d["window"])
        s.busy_s = defaultdict(float, d["busy_s"])
        s.train_busy_s, s.resyncs = d["train_busy_s"], d["resyncs"]
        if len(d["gen_busy_s"]) == len(s.gen_busy_s):
            s.gen_busy_s = list(d["gen_busy_s"])
        self.source.load_state_dict(d["source"])
        self.retry = [(rows, seed) for rows, seed in d["retry"]]
        self.gen_failures = d["gen_failures"]
        self.invalid_by_reason = defaultdict(float, d["invalid_by_reason"])
        self.trained_groups = d["trained_groups"]
        self.before = d["before"]
        self._last_eval = d["last_eval"]
        self._ckpt_version = d["version"]
        self.history = [json.loads(line) for line in (ckpt.path / "history.jsonl").read_text().splitlines() if line]
        self.t_start = time.time() - d["elapsed_s"]
        self.t_last_step = self.last_progress = time.time()
        set_rng_state(torch.load(ckpt.path / "driver_rng.pt", weights_only=False))
        print(f"resumed from {ckpt.path} at step {s.version} ({s.consumed} groups trained, "
              f"{self.source.consumed} prompts drawn, {s.buffered} groups buffered)", flush=True)


# ---------------------------------------------------------------------------- entry point
def _jsonable(x):
    """numpy scalars / arrays in dataset rows -> JSON."""
    return x.tolist() if hasattr(x, "tolist") else str(x)


def _resumed_aim_hash(resume) -> Optional[str]:
    if resume is None:
        return None
    return json.loads((resume.path / "driver.json").read_text()).get("aim_run_hash")


def prepare_run_dir(cfg: Config) -> Path:
    run_dir = Path(cfg.run_dir or Path("runs") / f"{cfg.tracking.run_name or 'run'}-{time.strftime('%Y%m%d-%H%M%S')}")
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


def load_train_rows(cfg: Config) -> list[dict]:
    if not cfg.data.mix:
        return load_rows(cfg.data.train, strict=cfg.data.strict)
    sources = {e["source"]: load_rows(e["source"], strict=cfg.data.strict) for e in cfg.data.mix}
    weights = {e["source"]: float(e["weight"]) for e in cfg.data.mix}
    return mix(sources, weights, cfg.data.mix_size, seed=cfg.data.shuffle_seed)


def format_table(before: dict, after: dict) -> str:
    keys = [k for k in before if k in after]
    lines = [f"{'held-out metric':<28}{'before':>10}{'after':>10}{'change':>10}"]
    for k in keys:
        lines.append(f"{k:<28}{before[k]:>10.3f}{after[k]:>10.3f}{after[k] - before[k]:>+10.3f}")
    return "\n".join(lines)


def run(cfg: Config, resume=None) -> dict:
    """One training run; ``resume`` (a :class:`prorl_async.checkpoint.Checkpoint` of ``cfg.run_dir``)
    continues that run exactly where the checkpoint left it."""
    t0 = time.time()
    run_dir = prepare_run_dir(cfg)
    save_config(cfg, run_dir / "config.yaml")
    print(f"run directory: {run_dir}", flush=True)
    model_path = resolve_model_path(cfg.model, seed=cfg.train.seed)
    for module in cfg.reward.extra_modules:  # custom verifiers register their domains on import
        importlib.import_module(module)
    train_rows = load_train_rows(cfg)
    eval_rows = load_rows(cfg.data.eval, strict=cfg.data.strict)
    source = PromptSource(train_rows, seed=cfg.data.shuffle_seed)
    started = init_ray(cfg)
    tracker = None
    actors = None
    try:
        tracker = Tracker(cfg.tracking.aim_repo, cfg.tracking.experiment, cfg.tracking.run_name or run_dir.name,
                          config_to_dict(cfg), enabled=cfg.tracking.enabled, run_hash=_resumed_aim_hash(resume))
        actors = Actors.start(cfg, model_path, name=f"prorl-{run_dir.name}")
        before = {} if resume is not None else {**evaluate(cfg, actors, eval_rows, 0, tracker),
                                                 **evaluate(cfg, actors, eval_rows, 0, tracker, greedy=True)}
        loop = TrainingLoop(cfg, actors, source, tracker, eval_rows)
        loop.run_dir, loop.model_path, loop.before = run_dir, model_path, before
        if resume is not None:
            loop.restore(resume)
            before = loop.before
        try:
            history = loop.run()
        except RunError:
            # a run that must stop keeps its last good state (the learner's weights are never
            # updated by a non-finite step), unless the learner itself is gone
            if not loop.learner_dead:
                try:
                    loop.save_checkpoint("error")
                except Exception as e:  # the stop reason matters more than this checkpoint
                    log.warning("no checkpoint at the stop: %s", _cause(e))
            raise
        loop.save_checkpoint("end")
        steps = loop.s.version
        after = {**evaluate(cfg, actors, eval_rows, steps, tracker),
                 **evaluate(cfg, actors, eval_rows, steps, tracker, greedy=True)}
        ray.get(actors.learner.save_model.remote(str((run_dir / "final").resolve())))
        summary = {"run_dir": str(run_dir), "aim_run_hash": tracker.hash, "steps": steps,
                   "wall_time_s": time.time() - t0, "before": before, "after": after,
                   "max_trained_staleness": max((h.get("async/trained_staleness_max", 0) for h in history), default=0),
                   "generator_failures": loop.gen_failures, "weight_resyncs": loop.s.resyncs,
                   "prompts_consumed": source.consumed,
                   "final_metrics": history[-1] if history else {}}
        tracker.set("summary", {k: v for k, v in summary.items() if k != "final_metrics"})
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        (run_dir / "history.jsonl").write_text("\n".join(json.dumps(h) for h in history) + "\n")
        (run_dir / "trained_groups.jsonl").write_text("\n".join(json.dumps(g) for g in loop.trained_groups) + "\n")
        print(format_table(before, after), flush=True)
        print(f"done: {steps} steps in {summary['wall_time_s']:.0f}s; run dir {run_dir}", flush=True)
        return summary
    finally:
        if tracker is not None:
            tracker.close()
        if actors is not None:
            for a in actors.all():
                try:
                    ray.kill(a)
                except Exception:
                    pass
            for pg in actors.placement_groups:
                ray.util.remove_placement_group(pg)
        if started:
            ray.shutdown()
