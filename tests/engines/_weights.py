"""The learner's side of weight sync for engine tests: weights that differ from the checkpoint,
pushed into an engine over a real 2-rank gloo group (learner rank 0, engine rank 1) by a
sender thread, as the learner actor pushes them. One place for the vLLM tests in-process, in
the multiprocess subprocess (``_vllm_multiprocess_main.py``) and with SmolLM2."""

from __future__ import annotations

import threading

import torch

from prorl_async.models import load_model
from prorl_async.weight_sync import WeightSyncGroup, free_port


def perturbed(model_path: str, seed: int, scale: float, relative: bool = False):
    """The checkpoint with Gaussian noise: ``p + scale * n`` (or ``p * (1 + scale * n)``)."""
    model = load_model(model_path, "float32")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            noise = scale * torch.randn(p.shape, generator=gen, dtype=p.dtype)
            p.add_(p * noise if relative else noise)
    return model.eval()


class WeightPusher:
    """A gloo weight-sync group between this process (rank 0) and ``engine`` (rank 1)."""

    def __init__(self, engine, timeout_s: float = 120.0):
        port, box = free_port(), {}
        th = threading.Thread(target=lambda: box.setdefault(
            "g", WeightSyncGroup("127.0.0.1", port, 0, 2, "gloo", timeout_s=timeout_s)))
        th.start()
        engine.init_weight_sync("127.0.0.1", port, 1, 2, "gloo", timeout_s=timeout_s)
        th.join(timeout_s)
        self.engine, self.group, self.timeout_s = engine, box["g"], timeout_s

    def send_async(self, model, version: int) -> threading.Thread:
        """Start broadcasting ``model``'s weights as ``version``; it completes when the engine receives."""
        named = [(n, p.detach()) for n, p in model.named_parameters()]
        th = threading.Thread(target=self.group.send, args=(named, version))
        th.start()
        return th

    def push(self, model, version: int) -> dict:
        """Send and receive one version; the engine's ``receive_weights`` answer."""
        th = self.send_async(model, version)
        info = self.engine.receive_weights()
        th.join(self.timeout_s)
        return info
