"""Cluster start-up and actor wiring: join or start Ray, place and start the actors, form the
weight-sync group (:mod:`prorl_async.weight_sync`), and turn Ray failures into one clear error.

Placement follows the config's resources (``rollout.generator_num_gpus``, ``*_resources`` ...;
docs/cluster.md); the ranks of a learner group are packed by a placement group.
A generator is restarted by Ray up to ``rollout.max_generator_failures`` times; the driver then
re-forms the weight-sync group and gives it the current weights before it serves again.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from prorl_async import console
from prorl_async.config import Config
from prorl_async.learners.core import NonFiniteStepError

from actors.failures import Failure
from actors.generator import GeneratorActor
from actors.grader import GraderActor
from actors.learner import process_runtime_env, start_learner
from actors.placement import placement_line
from actors.replay_buffer import ReplayBufferActor
from actors.stopping import raise_if_terminated


def on_driver_node() -> NodeAffinitySchedulingStrategy:
    """Ray scheduling onto the node this driver runs on. Hard: with ``soft=True`` Ray 2.60 placed a
    0-CPU actor on another node of a simulated cluster 4 times in 4, though the driver's node had room."""
    return NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)


class RunError(RuntimeError):
    """A run that cannot go on; the message says why."""


def cause(err: Exception) -> str:
    """``Type: last line of the message`` of the exception behind a Ray error."""
    c = getattr(err, "cause", None) or err
    return f"{type(c).__name__}: {str(c).strip().splitlines()[-1] if str(c).strip() else ''}"


def actor_died(err: Exception) -> bool:
    """True if a failed request's chain (generate -> grade -> put) failed because an actor died."""
    seen = 0
    while err is not None and seen < 5:
        if isinstance(err, (ray.exceptions.RayActorError, ray.exceptions.ActorDiedError,
                            ray.exceptions.ActorUnavailableError)):
            return True
        err = getattr(err, "cause", None)
        seen += 1
    return False


def dead_actor_id(err: Exception):
    """The hex id of the actor whose death failed this call (None if no actor died; "" if unknown).

    A task whose input came from a dead actor fails with ``RayTaskError(ActorDiedError)``,
    which carries the id of the actor that ran the task (say the grader); the dead one is
    the innermost actor error of the chain."""
    found, seen = None, 0
    while err is not None and seen < 8:
        if isinstance(err, (ray.exceptions.RayActorError, ray.exceptions.ActorDiedError,
                            ray.exceptions.ActorUnavailableError)) and not isinstance(err, ray.exceptions.RayTaskError):
            return getattr(err, "actor_id", None) or ""
        if isinstance(err, ray.exceptions.RayActorError):
            found = ""
        err = getattr(err, "cause", None)
        seen += 1
    return found


GRADER_MAX_RESTARTS = -1  # the grader holds no state: Ray restarts it as often as it dies


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


def init_ray(cfg: Config, log_dir: Path | None = None) -> bool:
    """Join the configured / job cluster, or start a local one. Returns True if started here.

    ``log_dir``: actors' output goes to files there, not to this console (:mod:`prorl_async.console`),
    unless ``$PRORL_ASYNC_VERBOSE`` is set; without it, Ray streams it here as it always did.

    Ray 2.60 turns token authentication on for new local clusters and would write a token to
    ``~/.ray/auth_token``. A local cluster started here keeps auth on but passes a fresh
    token through the environment only (``RAY_AUTH_TOKEN``), so nothing is written outside
    the run's directories; ``RAY_AUTH_MODE=disabled`` opts out. Joining an existing cluster
    uses whatever token the environment or ``~/.ray/auth_token`` provides.
    """
    if ray.is_initialized():
        return False
    handler = signal.getsignal(signal.SIGTERM)
    try:
        return _init_ray(cfg, log_dir)
    finally:  # Ray's core worker puts a C handler for SIGTERM in place of Python's, one that aborts the
        # driver (status -6, no finally blocks): a Python handler set before (actors.stopping) gets it back
        if callable(handler) and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, handler)


def _init_ray(cfg: Config, log_dir: Path | None) -> bool:
    quiet = log_dir is not None and not console.verbose()
    output = ({"log_to_driver": False, "runtime_env": {
        "worker_process_setup_hook": f"{console.__name__}.{console.actor_output_to_file.__name__}",
        "env_vars": {console.LOG_DIR_ENV: str(Path(log_dir).resolve())}}} if quiet else {"log_to_driver": True})
    address = cfg.ray.address or os.environ.get("RAY_ADDRESS", "")
    if address:
        ray.init(address=address, logging_level=logging.WARNING, **output)
        return False
    local_cluster_auth()
    start_local_ray(num_cpus=cfg.ray.num_cpus or None, include_dashboard=False, logging_level=logging.WARNING,
                    configure_logging=True, **output)
    return True


NODE_START_TIMEOUT = "timed out during startup"  # ray.init's message when its node did not come up


@contextlib.contextmanager
def ray_processes_in_own_sessions():
    """Inside the block, the processes Ray starts for a local cluster (GCS, raylet and the raylet's
    workers under it, the dashboard and log monitors) each get a session of their own, so that a
    signal to this driver's process group reaches the driver alone: ``timeout``, ``kill -TERM
    -PGID`` and a shell's ``kill %1`` signal the whole group, and the raylet and the actors died
    of the SIGTERM before the driver's own handler could land the step in flight and write the
    checkpoint (measured: ``error: the learner died at step 5``). Ray does the like on Windows
    (its ``ConsolePopen`` puts them in a new process group) and on Linux only blocks SIGINT in
    them. Done only where the kernel ties them to the driver's life (``PR_SET_PDEATHSIG``, Ray's
    fate sharing), so they still end with the driver however it ends; elsewhere the block changes
    nothing."""
    from ray._private import services
    from ray._private import utils as ray_utils

    base = getattr(services, "ConsolePopen", None)
    if base is None or os.name != "posix" or not ray_utils.detect_fate_sharing_support():
        yield
        return

    class OwnSessionPopen(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args, **kwargs):
            kwargs.setdefault("start_new_session", True)
            super().__init__(*args, **kwargs)

    services.ConsolePopen = OwnSessionPopen
    try:
        yield
    finally:
        services.ConsolePopen = base


def start_local_ray(**init_kwargs) -> None:
    """``ray.init`` of a new local cluster (its processes outside this driver's process group:
    :func:`ray_processes_in_own_sessions`), tried a second time if its node did not come up. Ray
    2.60's raylet waits a fixed 15 s for its dashboard agent's port file and exits when it is late
    (ray-project/ray#65983), which a loaded machine can miss: a CI worker starting three runs at
    once, a busy login node. The processes the failed start left behind (this process's children
    since the call) are stopped before the second try; any other error is raised as it is."""
    import psutil

    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    with ray_processes_in_own_sessions():
        try:
            ray.init(**init_kwargs)
            return
        except Exception as e:  # ray.init raises a bare Exception for this one
            if NODE_START_TIMEOUT not in str(e):
                raise
        left = [p for p in me.children(recursive=True) if p.pid not in before]
        for p in left:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        psutil.wait_procs(left, timeout=10)
        logging.getLogger("prorl_async").warning(
            "Ray's local node did not start in time (its raylet gives the dashboard agent 15 s); "
            "stopped %d processes of that start and trying once more", len(left))
        ray.init(**init_kwargs)


PLACEMENT_TIMEOUT_S = 300.0


def reserve(bundles: list[dict], strategy: str, name: str, what: str, timeout_s: float):
    """A placement group of ``bundles``, placed within ``timeout_s``, or one :class:`RunError`
    that starts with ``what`` and ends with the cluster's resources (nothing left reserved)."""
    from ray.util.placement_group import placement_group, remove_placement_group

    pg = placement_group(bundles, strategy=strategy, name=name)
    if not pg.wait(timeout_seconds=timeout_s):
        remove_placement_group(pg)
        raise RunError(f"{what} within {timeout_s:.0f}s; cluster resources: {ray.cluster_resources()}")
    return pg


def learner_placement(cfg: Config, timeout_s: float = PLACEMENT_TIMEOUT_S):
    """The placement group of a learner group's ranks (None for one learner): one bundle per rank,
    each with the rank's CPUs, GPUs and ``train.learner_resources``. PACK, not STRICT_PACK: the
    ranks share a node whenever one node can hold them all (a data-parallel all-reduce inside one
    node), and a group larger than any node still starts, on as few nodes as Ray can find."""
    t = cfg.train
    bundle = {k: v for k, v in {"CPU": t.learner_num_cpus, "GPU": t.learner_num_gpus}.items() if v}
    bundle.update(t.learner_resources)
    if t.num_learners == 1 or not bundle:  # one learner, or nothing reserved to pack by
        return None
    return reserve([bundle] * t.num_learners, "PACK", "prorl-learners",
                   f"the cluster cannot hold the {t.num_learners} learner ranks' bundles {bundle} (train.num_learners="
                   f"{t.num_learners}, train.learner_num_cpus={t.learner_num_cpus}, train.learner_num_gpus="
                   f"{t.learner_num_gpus}, train.learner_resources={t.learner_resources})", timeout_s)


def generator_placement(cfg: Config, index: int, timeout_s: float = PLACEMENT_TIMEOUT_S) -> tuple[dict, object]:
    """Ray options for generator ``index``, and its placement group (None below 2 GPUs).

    A CPU generator's process bounds its oneDNN and ideep kernel caches as a CPU learner's does
    (``train.kernel_cache_entries``): every decode batch size is a new matmul shape, and at the
    libraries' 1024 entries a SmolLM2 generator's resident size rose about 350 MB over its first
    100 steps after each start (docs/prorl_in_miniature.md, the ninth run).

    A generator that asks for more than one GPU (a tensor-parallel vLLM engine) gets its own
    placement group: one STRICT_PACK bundle with all its GPUs and CPUs, reserved together on
    one node before the engine starts. The engine's processes and any Ray tasks it starts
    (captured as child tasks) share that bundle, and a cluster with no node that fits fails
    here with the numbers instead of leaving the actor pending.
    """
    r = cfg.rollout
    pinned = {"resources": r.generator_resources} if r.generator_resources else {}
    opts = console.with_role({"num_cpus": r.generator_num_cpus, "num_gpus": r.generator_num_gpus, **pinned,
                              **process_runtime_env(cfg, on_gpu=r.generator_num_gpus > 0)}, f"generator-{index}")
    if r.generator_num_gpus <= 1:
        return opts, None
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    bundle = {"GPU": r.generator_num_gpus, **({"CPU": r.generator_num_cpus} if r.generator_num_cpus else {}),
              **r.generator_resources}
    pg = reserve([bundle], "STRICT_PACK", f"prorl-generator-{index}",
                 f"no node can hold generator {index}'s bundle {bundle} (rollout.generator_num_gpus="
                 f"{r.generator_num_gpus}, rollout.generator_num_cpus={r.generator_num_cpus}, "
                 f"rollout.generator_resources={r.generator_resources})", timeout_s)
    opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
        pg, placement_group_bundle_index=0, placement_group_capture_child_tasks=True)
    return opts, pg


def grader_options(cfg: Config) -> dict:
    """Ray options of the grader: no CPU of its own (its worker processes do the work), on a node
    with ``reward.grader_resources`` when set."""
    pinned = {"resources": cfg.reward.grader_resources} if cfg.reward.grader_resources else {}
    return console.with_role({"num_cpus": 0, **pinned}, "grader")


@dataclass
class Actors:
    generators: list
    grader: object
    buffer: object
    learner: object
    placement_groups: list = field(default_factory=list)
    sync_epoch: int = 0
    sync_backend: str = ""  # the resolved ray.weight_sync_backend: gloo, nccl or ipc
    sync_store: str = ""  # host:port of the weight-sync group's store (on the learner's node)

    @classmethod
    def start(cls, cfg: Config, model_path: str, name: str = "", longest_prompt: int = 0) -> "Actors":
        """``longest_prompt``: the run's longest prompt in tokens (0 = unknown), which sets vLLM's
        context on GPU (``rollout.max_model_len=0``)."""
        r, t = cfg.rollout, cfg.train
        learner_pg = learner_placement(cfg)  # a data-parallel LearnerGroup's ranks, packed
        learner = start_learner(cfg, model_path, f"{name}/learner" if name else "", learner_pg)
        placed = [generator_placement(cfg, i) for i in range(r.num_generators)]
        # Ray restarts a dead generator (up to max_generator_failures times); the driver then
        # re-forms the weight-sync group and gives it the current weights before it serves.
        gens = [GeneratorActor.options(**opts, max_restarts=r.max_generator_failures, max_task_retries=0,
                                       **({"name": f"{name}/generator-{i}"} if name else {}))
                .remote(cfg, model_path, i, longest_prompt) for i, (opts, _) in enumerate(placed)]
        # the grader is stateless: restarted by Ray, the driver re-issues the requests it dropped.
        # The buffer holds the unconsumed groups: never restarted empty; its death stops the run, so
        # it lives on the driver's node, which the run cannot outlive anyway (not on a generator's)
        grader = GraderActor.options(**grader_options(cfg),
                                     max_restarts=GRADER_MAX_RESTARTS, max_task_retries=0,
                                     **({"name": f"{name}/grader"} if name else {})).remote(cfg)
        buffer = ReplayBufferActor.options(**console.with_role({"num_cpus": 0}, "buffer"), max_restarts=0,
                                           scheduling_strategy=on_driver_node(),
                                           **({"name": f"{name}/buffer"} if name else {})
                                           ).remote(t.max_staleness, cfg.algo.dynamic_sampling)
        actors = cls(gens, grader, buffer, learner, [pg for _, pg in placed if pg is not None]
                     + ([learner_pg] if learner_pg is not None else []))
        get([g.ready.remote() for g in gens] + [grader.ready.remote()], 600, "starting the actors")
        actors.form_weight_sync(cfg)
        print(actors.placement(), flush=True)
        return actors

    def placement(self) -> str:
        """One line naming each actor's node, its gloo addresses and placement group, and the
        weight-sync store (:mod:`actors.placement`)."""
        places = get([g.where.remote() for g in self.generators] + [self.grader.where.remote(),
                     self.buffer.where.remote()], 600, "placement")
        store = self.sync_store if self.sync_backend != "ipc" else ""  # ipc forms no group
        return placement_line(places + get(self.learner.where.remote(), 600, "placement"), store, self.sync_backend)

    def resolve_sync_backend(self, cfg: Config) -> str:
        """``ray.weight_sync_backend``, with ``auto`` resolved from where the actors landed:
        ``ipc`` when the learner and every generator hold the same GPU (one GPU, colocated by
        fractional reservations or a shared bundle: NCCL refuses two ranks on one device),
        ``nccl`` when they hold separate GPUs, ``gloo`` on CPU."""
        r, t = cfg.rollout, cfg.train
        backend = cfg.ray.weight_sync_backend
        if backend != "auto":
            return backend
        if not (r.generator_num_gpus > 0 and t.learner_num_gpus > 0):
            return "gloo"
        learner = get(self.learner.device_key.remote(), 600, "weight sync")
        gens = get([g.device_key.remote() for g in self.generators], 600, "weight sync")
        same = [k == learner for k in gens]
        if all(same):
            return "ipc"
        if any(same):
            raise RunError(f"generators {[i for i, x in enumerate(same) if x]} share the learner's GPU and the others "
                           "do not: NCCL cannot reach a rank on the learner's own device and ipc cannot reach the "
                           "others; reserve GPUs so that all generators share it (one GPU) or none does, or set "
                           "ray.weight_sync_backend")
        return "nccl"

    def form_weight_sync(self, cfg: Config) -> None:
        """(Re)build the weight-sync group: learner rank 0 + every generator (a TP=k engine takes k ranks).
        With ipc there is no group: each receiving process gets its rank (which handles are its
        own) and announces its dtype, which the learner's snapshot is cast to."""
        t = cfg.train
        backend = self.sync_backend = self.resolve_sync_backend(cfg)
        self.sync_epoch += 1
        host, port = get(self.learner.sync_address.remote(self.sync_epoch), 600, "weight sync")
        self.sync_store = f"{host}:{port}"
        ranks = get([g.weight_sync_ranks.remote() for g in self.generators], 600, "weight sync")
        world = 1 + sum(ranks)
        if backend == "ipc":
            dtypes = get([g.init_weight_sync.remote(host, port, 1 + sum(ranks[:i]), world, backend)
                          for i, g in enumerate(self.generators)], t.sync_timeout_s, "forming the weight-sync group")
            wire = dtypes[0] if len(set(dtypes)) == 1 else None
            get(self.learner.init_weight_sync.remote(host, port, world, backend, wire), t.sync_timeout_s,
                "forming the weight-sync group")
            return
        get([self.learner.init_weight_sync.remote(host, port, world, backend)]
             + [g.init_weight_sync.remote(host, port, 1 + sum(ranks[:i]), world, backend)
                for i, g in enumerate(self.generators)], t.sync_timeout_s, "forming the weight-sync group")
        if self.sync_epoch > 1:  # re-formed after a failure: where each generator is now (a restarted one may have moved)
            places = get([g.where.remote() for g in self.generators], 600, "placement")
            print(f"weight sync re-formed (group {self.sync_epoch}, store {self.sync_store}): "
                  + "; ".join(str(p) for p in places), flush=True)

    def receive_args(self, sent) -> tuple:
        """Arguments of ``GeneratorActor.receive_weights`` for the learner's ``broadcast_weights``
        ref ``sent``: ipc hands the ref on (Ray resolves it to the handles), a collective none."""
        return (sent,) if self.sync_backend == "ipc" else ()

    def release_weights(self) -> None:
        """Every generator answered the updates sent so far: the learner may free its ipc snapshots."""
        if self.sync_backend == "ipc":
            self.learner.release_weights.remote()

    def wait_generators_ready(self, timeout_s: float = 600.0) -> None:
        """Every generator answers again (a restarting actor refuses calls until it is back)."""
        deadline = time.time() + timeout_s
        for i, g in enumerate(self.generators):
            while True:
                try:
                    ray.get(g.ready.remote(), timeout=max(1.0, deadline - time.time()))
                    break
                except (ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError) as e:
                    if time.time() > deadline:
                        raise RunError(f"generator {i} did not come back within {timeout_s:.0f}s: {cause(e)}") from None
                    time.sleep(0.5)

    def sync_all(self, cfg: Config, what: str) -> list[int]:
        """The learner's current weights to every generator at once; their policy versions."""
        sent = self.learner.broadcast_weights.remote()
        try:
            infos = get([sent] + [g.receive_weights.remote(*self.receive_args(sent)) for g in self.generators],
                        cfg.train.sync_timeout_s, what)
        except ray.exceptions.RayActorError as e:  # a receiver died mid-sync
            role = self.role(dead_actor_id(e)) or "an actor"
            raise RunError(f"{what} failed: {role} died ({cause(e)})") from None
        finally:
            self.release_weights()
        return [info["version"] for info in infos[1:]]

    def role(self, actor_id) -> str:
        """Which actor an id (from :func:`dead_actor_id`) belongs to: generator-i, grader, buffer, learner, or ''."""
        if not actor_id:
            return ""
        named = {f"generator-{i}": g for i, g in enumerate(self.generators)}
        named.update(grader=self.grader, buffer=self.buffer, learner=self.learner)
        for role, a in named.items():
            if getattr(a, "_actor_id", None) is not None and a._actor_id.hex() == actor_id:
                return role
        return ""

    def failure(self, err: Exception) -> Failure:
        """What the failure policy (:mod:`actors.failures`) needs to know about a failed call."""
        nonfinite = isinstance(err, NonFiniteStepError) or isinstance(getattr(err, "cause", None), NonFiniteStepError)
        return Failure(died=actor_died(err), role=self.role(dead_actor_id(err)), cause=cause(err),
                       error_type=type(err).__name__, nonfinite=nonfinite)

    def all(self) -> list:
        return [*self.generators, self.grader, self.buffer, self.learner]

    def shutdown(self) -> None:
        for a in self.all():
            try:
                ray.kill(a)
            except Exception:
                pass
        for pg in self.placement_groups:
            ray.util.remove_placement_group(pg)


def get(refs, timeout: float, what: str):
    """``ray.get`` whose failures become one clear :class:`RunError`; a SIGTERM taken while it
    waited stops the run here (:func:`actors.stopping.raise_if_terminated`)."""
    try:
        out = ray.get(refs, timeout=timeout)
        raise_if_terminated()
        return out
    except ray.exceptions.GetTimeoutError:
        raise RunError(f"{what}: no answer within {timeout:.0f}s") from None
    except ray.exceptions.RayTaskError as e:
        cause = e.cause if getattr(e, "cause", None) is not None else e
        raise RunError(f"{what} failed: {type(cause).__name__}: {cause}") from None
