"""Learner actor: a shell over the torch learner plus the send side of weight sync."""

from __future__ import annotations

import ray
import torch

from prorl_async.learners.torch_learner import TorchLearner
from prorl_async.learners.weight_sync import WeightSyncGroup, free_port, local_ip, tensor_checksum


@ray.remote
class LearnerActor:
    def __init__(self, cfg, model_path: str):
        torch.set_num_threads(cfg.train.num_threads)
        self.cfg = cfg
        device = "cuda" if cfg.train.learner_num_gpus > 0 and torch.cuda.is_available() else "cpu"
        self.learner = TorchLearner(cfg, model_path, device=device)
        self._sync = None

    def sync_address(self) -> tuple[str, int]:
        host = local_ip()
        return host, self.cfg.ray.weight_sync_port or free_port(host)

    def init_weight_sync(self, host: str, port: int, world_size: int, backend: str) -> bool:
        self._sync = WeightSyncGroup(host, port, 0, world_size, backend, self.cfg.train.sync_timeout_s)
        return True

    def train_step(self, table, step: int) -> dict:
        return self.learner.train_step(table, step)

    def broadcast_weights(self) -> dict:
        return self._sync.send(self.learner.named_tensors(), self.learner.version)

    def weights_checksum(self) -> tuple[int, float]:
        return self.learner.version, tensor_checksum([t for _, t in self.learner.named_tensors()])

    def observe_validation(self, step: int, score: float):
        return self.learner.observe_validation(step, score)

    def save_model(self, path: str) -> str:
        self.learner.model.save_pretrained(path)
        return path
