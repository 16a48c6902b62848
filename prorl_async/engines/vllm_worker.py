"""The receive side of weight sync, running *inside* each vLLM worker process.

vLLM mixes this class into its worker (``LLM(worker_extension_cls=...)``); the engine front
end (:mod:`prorl_async.engines.vllm`) calls its methods through ``collective_rpc`` with
small arguments only — tensors never travel through RPC payloads. Each worker joins the
learner's :class:`~prorl_async.weight_sync.WeightSyncGroup` as its own rank
(with tensor parallelism every TP rank receives the full checkpoint-format tensors and
vLLM's loaders shard them), receives the buckets by broadcast (gloo on CPU, NCCL on GPU),
and the receiver checks the sender's manifest (names, shapes, dtypes), every bucket checksum
and the values' finiteness before anything touches the model.

Applying uses the worker's ``reload_weights(weights_iterator=..., is_checkpoint_format=True)``
(vLLM's in-place, layerwise reload, which re-runs the CPU backend's weight repacking); the
raw ``model.load_weights`` would corrupt repacked CPU weights. A reload that fails half way
leaves meta tensors behind, so validation happens first and a failed reload marks the worker
broken: later generations are refused instead of crashing the engine.
"""

from __future__ import annotations

import time
from typing import Optional

import torch

from prorl_async.weight_ipc import IpcWeightReceiver
from prorl_async.weight_sync import WeightSyncError, WeightSyncGroup, tensor_checksum


class WeightSyncWorkerExtension:
    """Mixed into vLLM's worker class; method names are prefixed to avoid clashes."""

    def prorl_init_weight_sync(self, host: str, port: int, base_rank: int, world_size: int, backend: str,
                               timeout_s: float, manifest: list, checksum: Optional[float] = None) -> int:
        """Join the weight-sync group as rank ``base_rank + <this worker's TP rank>``."""
        rank = base_rank + int(getattr(self, "rank", 0))
        device = "cpu" if backend == "gloo" else str(self.device)
        self._prorl_expected = [(n, tuple(s), getattr(torch, dt)) for n, s, dt in manifest]
        wire = next((dt for _, _, dt in self._prorl_expected if dt.is_floating_point), None)
        if backend == "ipc":  # same device: the learner's handles come with each update
            self._prorl_sync = IpcWeightReceiver(rank, str(getattr(self, "device", "cpu")),
                                                 wire_dtype=wire)
        else:
            self._prorl_sync = WeightSyncGroup(host, port, rank, world_size, backend, timeout_s, device=device,
                                               wire_dtype=wire)  # the sender casts to the engine's dtype
        self._prorl_staged = None
        self._prorl_version = 0
        self._prorl_checksum = checksum  # of the weights in use, in checkpoint (HF) layout
        self._prorl_broken = None
        return rank

    def prorl_receive(self, apply: bool, payload: Optional[dict] = None) -> dict:
        """Receive one update into staging; apply it now when ``apply``. ``payload``: the
        learner's handles (ipc); what is staged for later is copied out of the learner's memory."""
        t0 = time.perf_counter()
        if payload is not None:
            version, tensors = self._prorl_sync.receive(payload, self._prorl_expected)
        else:
            version, tensors = self._prorl_sync.receive(self._prorl_expected)  # raises before staging on mismatch
        if payload is not None and not apply:
            tensors = [(n, t.clone()) for n, t in tensors]
        self._prorl_staged = (version, tensors, tensor_checksum([t for _, t in tensors]))
        del tensors
        received = time.perf_counter() - t0
        applied = self.prorl_apply_staged() if apply else None
        return {"version": version, "receive_s": received, "applied": applied is not None,
                "seconds": time.perf_counter() - t0, "bytes": self._prorl_sync.last_bytes}

    def prorl_apply_staged(self) -> Optional[int]:
        """Apply staged weights with vLLM's in-place reload; returns the new version or None."""
        if self._prorl_broken:
            raise WeightSyncError(self._prorl_broken)
        staged, self._prorl_staged = self._prorl_staged, None
        if staged is None:
            return None
        version, tensors, checksum = staged
        try:
            self.reload_weights(weights_iterator=iter(tensors), is_checkpoint_format=True)
        except Exception as e:  # the model may now hold meta tensors: never generate with it
            self._prorl_broken = f"in-place reload of weights version {version} failed: {e!r}"
            raise
        self._refresh_tied_modules()
        self._prorl_version, self._prorl_checksum = version, checksum
        return version

    def _refresh_tied_modules(self) -> None:
        """Re-derive kernel-format copies of *tied* weights (e.g. ``lm_head`` tied to
        ``embed_tokens``). The reload only post-processes modules whose checkpoint weights it
        loaded; a tied head is skipped by the model's loader, so on the CPU backend its
        prepacked GEMM weight would keep serving the old embedding."""
        model = self.model_runner.get_model()
        first: dict[int, str] = {}
        tied: list[str] = []
        for name, p in model.named_parameters(remove_duplicate=False):
            if id(p) in first:
                tied.append(name.rpartition(".")[0])
            else:
                first[id(p)] = name
        if not tied:
            return
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(self.vllm_config), torch.no_grad():
            for module_name in tied:
                module = model.get_submodule(module_name)
                method = getattr(module, "quant_method", None)
                if method is not None and hasattr(method, "process_weights_after_loading"):
                    method.process_weights_after_loading(module)

    def prorl_checksum(self) -> tuple[int, Optional[float]]:
        """(version, checksum of the applied weights in checkpoint layout)."""
        return self._prorl_version, self._prorl_checksum

    def prorl_health(self) -> Optional[str]:
        return getattr(self, "_prorl_broken", None)
