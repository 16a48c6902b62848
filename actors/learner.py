"""Learner actors: a shell over a learner (torch or DeepSpeed, by ``train.learner``) plus the
send side of weight sync, and :class:`LearnerGroup`, which runs ``train.num_learners``
data-parallel learner actors in their own torch.distributed world (separate from the
weight-sync group) behind the same calls the driver makes on a single learner."""

from __future__ import annotations

import time
from datetime import timedelta

import ray
import torch

from actors.placement import ActorPlace, here, local_ip
from actors.replay_buffer import BatchRefs
from prorl_async.machine import actor_runtime_env, with_env_vars
from prorl_async.console import with_role
from prorl_async.learners import host_memory, make_learner
from prorl_async.learners.base import Learner
from prorl_async.learners.batch import shard_groups
from prorl_async.learners.core import sync_device
from prorl_async.ledger import write_step
from prorl_async.outputs import look_at_run_dir
from prorl_async.metrics import rss_mb
from prorl_async.weight_ipc import IpcWeightSender, device_key
from prorl_async.weight_sync import WeightSyncGroup, bind_gloo, close_group, serve_store, tensor_checksum


def optimizer_state_size(learner: Learner) -> float:
    """Parameters holding optimizer state (AdamW moments): 0 right after a reset that cleared it."""
    return float(len(learner.base_optimizer().state))


def resolve_batch(batch):
    """The batch table from what the driver hands a learner: the buffer's
    :class:`~actors.replay_buffer.BatchRefs` (the objects the rows already live in, mapped here
    without a copy), ``[ObjectRef]`` or an ObjectRef of a table, or a table."""
    if isinstance(batch, BatchRefs):
        return batch.resolve()
    if isinstance(batch, (list, tuple)):
        (batch,) = batch
    return ray.get(batch) if isinstance(batch, ray.ObjectRef) else batch


@ray.remote
class LearnerActor:
    def __init__(self, cfg, model_path: str, rank: int = 0, world_size: int = 1, in_group: bool = False):
        """``in_group``: a rank of a :class:`LearnerGroup`, whose learner is built by :meth:`join_world`
        once rank 0 serves the world's store (:meth:`serve_world`); otherwise built here."""
        torch.set_num_threads(cfg.train.num_threads)
        bind_gloo(local_ip())  # the learners' world and the weight-sync group listen on this node's IP
        self.cfg, self.model_path, self.rank, self.world_size = cfg, model_path, rank, world_size
        self.role = f"learner-{rank}" if in_group else "learner"
        self._world = ""  # host:port of the learners' world this rank joined
        self.device = "cuda" if cfg.train.learner_num_gpus > 0 and torch.cuda.is_available() else "cpu"
        self.learner: Learner
        if not in_group:
            self.learner = make_learner(cfg, model_path, self.device)
        self._world_store = None  # rank 0 of a group: the learners' store, served for the actor's life
        self._sync = None
        self._sync_store = None  # the weight-sync store listening since sync_address, until init_weight_sync
        self._ledger_run_dir = ""  # where the ledger goes (train.record_rollouts); "" = nowhere
        self._observed: list[dict] = []  # held-out scores received since the last step (the ledger keeps them)

    def record_ledger(self, run_dir: str) -> bool:
        """Write every step's ledger rows under ``run_dir/ledger/`` (:mod:`prorl_async.ledger`)."""
        self._ledger_run_dir = run_dir
        return True

    def look_at_run_dir(self, run_dir: str, model_path: str) -> dict:
        """What this rank's node sees of ``run_dir`` and the model (:mod:`actors.storage`)."""
        return look_at_run_dir(run_dir, self.rank, local_ip(), model_path)

    def _write_ledger(self, metrics: dict) -> dict:
        """The step's ledger file, with the held-out scores received before it; ``perf/ledger_s``."""
        t0 = time.perf_counter()
        rows = self.learner.ledger_rows()  # built here, after the update (its time is perf/ledger_s, not train_s)
        if not self._ledger_run_dir or rows is None:
            return metrics
        write_step(self._ledger_run_dir, rows, self._observed, rank=None if self.world_size == 1 else self.rank)
        self._observed = []
        return {**metrics, "perf/ledger_s": time.perf_counter() - t0}

    def ready(self) -> int:
        return self.rank

    def where(self) -> list[ActorPlace]:
        return [here(self.role, self._world)]

    def serve_world(self) -> tuple[str, int]:
        """Rank 0 of a group: the learners' own world (not the weight-sync group) meets at a store on
        this node, on a port the OS bound as it picked it (:func:`~prorl_async.weight_sync.serve_store`)."""
        self._world_store, port = serve_store(local_ip())
        return local_ip(), port

    def join_world(self, master: tuple[str, int]) -> int:
        """Build this rank's learner in the world whose store rank 0 serves at ``master``."""
        self.learner = make_learner(self.cfg, self.model_path, self.device, self.rank, self.world_size, master,
                                    served_store=True)
        self._world = f"{master[0]}:{master[1]}"
        return self.rank

    def sync_address(self, epoch: int = 1) -> tuple[str, int]:
        """Where the weight-sync store listens; a fixed ``ray.weight_sync_port`` shifts by the group
        epoch. Without one, the store listens from now on a port the OS picked as it bound it, and
        :meth:`init_weight_sync` hands it to the group (no window in which another process can take it)."""
        host = local_ip()
        if self.cfg.ray.weight_sync_port:
            self._sync_store = None
            return host, self.cfg.ray.weight_sync_port + epoch - 1
        self._sync_store, port = serve_store(host, timedelta(seconds=self.cfg.train.sync_timeout_s))
        return host, port

    def device_key(self) -> str:
        """The GPU (UUID) or host this learner's weights live on (ipc needs the generators' to match)."""
        return device_key(self.learner.device)

    def init_weight_sync(self, host: str, port: int, world_size: int, backend: str, wire_dtype=None) -> bool:
        close_group(self._sync)  # a re-formed group: the old one's communicator and store go first
        if backend == "ipc":  # same device: handles to a snapshot instead of a collective
            self._sync = IpcWeightSender(world_size - 1, device=str(self.learner.device), wire_dtype=wire_dtype)
            return True
        served, self._sync_store = self._sync_store, None  # the group holds it from here on
        self._sync = WeightSyncGroup(host, port, 0, world_size, backend, self.cfg.train.sync_timeout_s,
                                     device=sync_device(backend, self.learner.device), store=served)
        return True

    def train_step(self, batch, step: int) -> dict:
        """``batch``: ``[ObjectRef]`` of the batch table, as the driver passes it (resolved here,
        a zero-copy read of the buffer's object), or the table itself."""
        table = resolve_batch(batch)
        metrics = self._write_ledger(self.learner.train_step(table, step))
        return {**metrics, "actor/optimizer_state_params": optimizer_state_size(self.learner),
                "sys/rss_mb/learner": rss_mb()}

    def train_shard(self, batch, step: int, world_size: int) -> dict:
        """Train on this rank's groups of the whole batch (read from the object store, zero-copy)."""
        return self._write_ledger(self.learner.train_step(shard_groups(resolve_batch(batch), self.rank, world_size), step))

    def broadcast_weights(self) -> dict:
        """``perf/sync_*`` metrics; with ipc also ``weights``, the payload of handles every
        generator's ``receive_weights`` takes (the snapshot lives until :meth:`release_weights`)."""
        named = self.learner.named_tensors()  # a collective under ZeRO-3: every rank calls it
        if self.rank != 0:
            return {}
        if isinstance(self._sync, IpcWeightSender):
            payload, metrics = self._sync.send(named, self.learner.version)
            return {**metrics, "weights": payload}
        return self._sync.send(named, self.learner.version)

    def release_weights(self) -> list[int]:
        """Every generator answered: free the ipc snapshots (versions freed; [] for a collective)."""
        return self._sync.release() if isinstance(self._sync, IpcWeightSender) else []

    def weights_checksum(self) -> tuple[int, int]:
        return self.learner.version, tensor_checksum([t for _, t in self.learner.named_tensors()])

    def observe_validation(self, step: int, score: float) -> dict:
        """The held-out score to the reference-reset policy; ``ref/reset_<cause>`` if it reset."""
        cause = self.learner.observe_validation(step, score)
        if self._ledger_run_dir:  # replay applies it before the next step, as it happened here
            self._observed.append({"step": step, "score": score, "cause": cause, "checkpointed": False})
        return {"ref/reset": 1.0, f"ref/reset_{cause}": 1.0,
                "actor/optimizer_state_params": optimizer_state_size(self.learner)} if cause else {}

    def save_model(self, path: str) -> str:
        return self.learner.save_model(path)

    def save_checkpoint(self, path: str, tokenizer_path: str = "") -> str:
        """Learner state into a checkpoint directory being written (prorl_async.learners.files)."""
        self.learner.save_checkpoint(path, tokenizer_path)
        for obs in self._observed:  # in this checkpoint's state already: a replay from it must not apply them again
            obs["checkpointed"] = True
        return path

    def load_checkpoint(self, path: str) -> int:
        """Restore the learner from a checkpoint directory; returns its policy version."""
        return self.learner.load_checkpoint(path)


_SAME_ON_EVERY_RANK = {"actor/grad_norm", "actor/lr", "actor/updates", "actor/skipped_updates",
                       "is/nonfinite_behavior_samples"}


@ray.remote
class LearnerGroup:
    """``n`` data-parallel learner actors; each trains on whole groups (prompt ids) of the batch.
    ``placement_group``: rank r takes its bundle r (:func:`actors.cluster.learner_placement`, which
    the caller owns and removes); None: each rank goes where Ray puts it."""

    def __init__(self, cfg, model_path: str, placement_group=None):
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        t = cfg.train
        n = t.num_learners
        opts = dict(num_cpus=t.learner_num_cpus, num_gpus=t.learner_num_gpus, max_restarts=0,
                    **({"resources": t.learner_resources} if t.learner_resources else {}))
        bundle = [{"scheduling_strategy": PlacementGroupSchedulingStrategy(placement_group, placement_group_bundle_index=r)}
                  if placement_group is not None else {} for r in range(n)]
        self.members = [LearnerActor.options(**with_role(opts, f"learner-{r}"), **bundle[r])
                        .remote(cfg, model_path, r, n, in_group=True) for r in range(n)]
        master = ray.get(self.members[0].serve_world.remote())  # on rank 0's node
        pending = [m.join_world.remote(master) for m in self.members]
        while pending:  # the first rank that fails to start fails the group now, not when its peers time out
            done, pending = ray.wait(pending, num_returns=1)
            ray.get(done)
        self.n = n

    def sync_address(self, epoch: int = 1):
        return ray.get(self.members[0].sync_address.remote(epoch))

    def where(self) -> list[ActorPlace]:
        return [p for m in ray.get([m.where.remote() for m in self.members]) for p in m]

    def device_key(self) -> str:
        return ray.get(self.members[0].device_key.remote())

    def init_weight_sync(self, host: str, port: int, world_size: int, backend: str, wire_dtype=None) -> bool:
        return ray.get(self.members[0].init_weight_sync.remote(host, port, world_size, backend, wire_dtype))

    def record_ledger(self, run_dir: str) -> bool:
        return self._all("record_ledger", run_dir)

    def look_at_run_dir(self, run_dir: str, model_path: str) -> list[dict]:
        return ray.get([m.look_at_run_dir.remote(run_dir, model_path) for m in self.members])

    def train_step(self, batch, step: int) -> dict:
        """``batch``: ``[ObjectRef]`` of the batch table (preferred: the bytes never pass through
        this actor), an ObjectRef, or a table (put into the object store once). Every rank reads
        the same object and keeps its own groups (:func:`shard_groups`)."""
        if isinstance(batch, (list, tuple)):
            (batch,) = batch
        ref = batch if isinstance(batch, (ray.ObjectRef, BatchRefs)) else ray.put(batch)
        results = ray.get([m.train_shard.remote(ref, step, self.n) for m in self.members])
        merged = dict(results[0])  # global quantities (whitening, token counts, mismatch/) are all-reduced already
        tokens = [max(float(r.get("perf/train_valid_tokens", 0.0)), 0.0) for r in results]
        w = tokens if sum(tokens) > 0 else [1.0] * len(results)
        for k in merged:
            if k in _SAME_ON_EVERY_RANK or not k.startswith(("actor/", "is/", "kl/", "len/", "async/")):
                continue
            pairs = [(r[k], wr) for r, wr in zip(results, w) if isinstance(r.get(k), (int, float))]
            if pairs and k.endswith("_max"):
                merged[k] = float(max(v for v, _ in pairs))
            elif pairs:  # per-rank token means -> token mean of the whole batch
                merged[k] = float(sum(v * wr for v, wr in pairs) / max(sum(wr for _, wr in pairs), 1e-12))
        merged["perf/train_valid_tokens"] = float(sum(tokens))
        merged["perf/num_learners"] = float(self.n)
        return merged

    def _all(self, method: str, *args):
        return ray.get([getattr(m, method).remote(*args) for m in self.members])[0]

    def broadcast_weights(self) -> dict:
        return self._all("broadcast_weights")

    def release_weights(self) -> list[int]:
        return self._all("release_weights")

    def weights_checksum(self):
        return self._all("weights_checksum")

    def observe_validation(self, step: int, score: float):
        return self._all("observe_validation", step, score)

    def save_model(self, path: str) -> str:
        return self._all("save_model", path)

    def save_checkpoint(self, path: str, tokenizer_path: str = "") -> str:
        return self._all("save_checkpoint", path, tokenizer_path)

    def load_checkpoint(self, path: str) -> int:
        return self._all("load_checkpoint", path)


def process_runtime_env(cfg, on_gpu: bool) -> dict:
    """Ray options of a learner or generator actor's process: :func:`actor_runtime_env`
    (``OMP_WAIT_POLICY``) plus, on a CPU, the capacity of its oneDNN and ideep kernel caches
    (:func:`prorl_async.learners.host_memory.kernel_cache_env`), both read when the process starts."""
    env = actor_runtime_env(cfg)
    kernels = host_memory.kernel_cache_env(cfg.train.kernel_cache_entries, on_gpu=on_gpu)
    return with_env_vars(env, kernels) if kernels else env


def learner_runtime_env(cfg) -> dict:
    """:func:`process_runtime_env` of the run's learner."""
    return process_runtime_env(cfg, on_gpu=cfg.train.learner_num_gpus > 0)


def start_learner(cfg, model_path: str, name: str = "", placement_group=None):
    """One learner actor, or a :class:`LearnerGroup` for ``train.num_learners > 1`` (its ranks in
    ``placement_group``'s bundles when given, see :class:`LearnerGroup`).

    Not restartable (``max_restarts=0``): a dead learner fails the run at once, leaving the
    last checkpoint as it was, rather than coming back without its optimizer state."""
    t = cfg.train
    named = {"name": name} if name else {}
    env = learner_runtime_env(cfg)  # a LearnerGroup's ranks inherit it
    if t.num_learners == 1:
        pinned = {"resources": t.learner_resources} if t.learner_resources else {}
        return LearnerActor.options(num_cpus=t.learner_num_cpus, num_gpus=t.learner_num_gpus, max_restarts=0,
                                    **pinned, **named, **with_role(env, "learner")).remote(cfg, model_path)
    return LearnerGroup.options(num_cpus=0, max_restarts=0, **named,
                                **with_role(env, "learner-group")).remote(cfg, model_path, placement_group)
