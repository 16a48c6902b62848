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

The checksum a worker reports (compared with the learner's ``tensor_checksum``) is taken from
the model, not from the received tensors, so a reload that skips or misplaces a weight shows.
It is exact, per checkpoint tensor, in the learner's order, with vLLM's fused parameters read
back in checkpoint layout: ``qkv_proj`` / ``gate_up_proj`` split along dim 0 by the layer's
``output_sizes`` into the names of the model's ``packed_modules_mapping``, a padded vocabulary
cut to ``org_vocab_size``. A weight the model keeps readable after the reload in its checkpoint
dtype (norms, embeddings; on GPU every unquantized weight) is read there. The CPU backend
replaces a linear layer's weight by a oneDNN / packed-kernel handle and leaves an empty
parameter, so such a weight is read inside the reload, as the model's loader wrote it into the
layer's own (fused) parameter, just before ``process_weights_after_loading`` repacks it; the
repacked kernel copy itself is not readable. A checkpoint tensor found in neither place (the
loader skipped it) marks the worker broken. With tensor parallelism (each rank holds shards)
the reported checksum is the received tensors' instead.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from typing import Iterator, Optional

import torch

from prorl_async import machine
from prorl_async.receive_memory import check_update_fits
from prorl_async.weight_ipc import IpcWeightReceiver
from prorl_async.weight_sync import (WeightSyncError, WeightSyncGroup, _checksum, chain_checksums, close_group, joined,
                                     tensor_checksum)


class WeightSyncWorkerExtension:
    """Mixed into vLLM's worker class; method names are prefixed to avoid clashes."""

    def prorl_init_weight_sync(self, host: str, port: int, base_rank: int, world_size: int, backend: str,
                               timeout_s: float, manifest: list, checksum: Optional[int] = None) -> int:
        """Join the weight-sync group as rank ``base_rank + <this worker's TP rank>``."""
        rank = base_rank + int(getattr(self, "rank", 0))
        close_group(getattr(self, "_prorl_sync", None))  # a re-formed group: the old one goes first
        device = "cpu" if backend == "gloo" else str(self.device)
        self._prorl_expected = [(n, tuple(s), getattr(torch, dt)) for n, s, dt in manifest]
        wire = next((dt for _, _, dt in self._prorl_expected if dt.is_floating_point), None)
        # held until applied: the received buckets, or (ipc, mid-request) the staged copy
        self.prorl_update_bytes = check_update_fits(self._prorl_expected, device, 1, f"vLLM worker rank {rank}")
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
        sync = joined(getattr(self, "_prorl_sync", None))  # a worker of a restarted generator has none yet
        if payload is not None:
            version, tensors = sync.receive(payload, self._prorl_expected)
        else:
            version, tensors = sync.receive(self._prorl_expected)  # raises before staging on mismatch
        if payload is not None and not apply:
            tensors = [(n, t.clone()) for n, t in tensors]
        self._prorl_staged = (version, tensors)
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
        version, tensors = staged
        sharded = int(getattr(self.parallel_config, "tensor_parallel_size", 1)) > 1
        checksum = tensor_checksum([t for _, t in tensors]) if sharded else None
        loaded: dict[str, int] = {}
        try:
            with self._checksums_as_loaded(loaded), _quiet_expected_load_warnings(self.model_runner.get_model()):
                self.reload_weights(weights_iterator=iter(tensors), is_checkpoint_format=True)
        except Exception as e:  # the model may now hold meta tensors: never generate with it
            self._prorl_broken = f"in-place reload of weights version {version} failed: {e!r}"
            raise
        del tensors, staged
        self._refresh_tied_modules()
        machine.release_freed_heap()  # the received / staged copies were freed below live blocks
        if not sharded:
            checksum = self._model_checksum(loaded, version)
        self._prorl_version, self._prorl_checksum = version, checksum
        return version

    @contextmanager
    def _checksums_as_loaded(self, out: dict[str, int]) -> Iterator[None]:
        """While the reload runs, record into ``out`` (checkpoint name -> checksum at its index
        in the manifest) each weight of a layer with a ``quant_method`` as the loader left it in
        the layer's parameter, just before ``process_weights_after_loading`` repacks it."""
        model = self.model_runner.get_model()
        packed = dict(getattr(model, "packed_modules_mapping", {}) or {})
        index = {name: i for i, (name, _, _) in enumerate(self._prorl_expected)}
        prefixes: dict[int, str] = {}
        methods: dict[int, object] = {}
        for prefix, module in model.named_modules():
            method = getattr(module, "quant_method", None)
            if method is not None and hasattr(method, "process_weights_after_loading"):
                prefixes[id(module)] = prefix
                methods[id(method)] = method

        def wrap(method):
            original = method.process_weights_after_loading

            def process_weights_after_loading(layer):
                prefix = prefixes.get(id(layer))
                if prefix is not None:
                    for name, piece in checkpoint_pieces(prefix, layer, packed):
                        if name in index and tuple(piece.shape) == self._prorl_expected[index[name]][1]:
                            out[name] = _checksum(piece, True, index[name])
                return original(layer)
            return process_weights_after_loading

        for method in methods.values():
            method.process_weights_after_loading = wrap(method)  # instance attribute over the class's
        try:
            yield
        finally:
            for method in methods.values():
                del method.process_weights_after_loading

    def _model_checksum(self, loaded: dict[str, int], version: int) -> int:
        """The checksum of the model's weights in checkpoint layout and order: each weight as the
        model holds it now, where it is still readable in the manifest's shape and dtype, else as
        ``loaded`` recorded it inside the reload."""
        model = self.model_runner.get_model()
        packed = dict(getattr(model, "packed_modules_mapping", {}) or {})
        readable: dict[str, torch.Tensor] = {}
        for prefix, module in model.named_modules():
            for name, piece in checkpoint_pieces(prefix, module, packed):
                readable.setdefault(name, piece)
        per_tensor, missing = [], []
        for i, (name, shape, dtype) in enumerate(self._prorl_expected):
            t = readable.get(name)
            if t is not None and tuple(t.shape) == shape and t.dtype == dtype:
                per_tensor.append(_checksum(t, True, i))
            elif name in loaded:  # repacked for a CPU kernel (or its dtype changed) after loading
                per_tensor.append(loaded[name])
            else:
                missing.append(name)
        if missing:
            self._prorl_broken = (f"after the reload of weights version {version} the model holds no weights for "
                                  f"{len(missing)} checkpoint tensors ({', '.join(missing[:3])}, ...): vLLM's loader "
                                  "skipped them; restart the engine")
            raise WeightSyncError(self._prorl_broken)
        return chain_checksums(per_tensor)

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

    def prorl_checksum(self) -> tuple[int, Optional[int]]:
        """(version, checksum of the applied weights in checkpoint layout)."""
        return self._prorl_version, self._prorl_checksum

    def prorl_health(self) -> Optional[str]:
        return getattr(self, "_prorl_broken", None)


def checkpoint_pieces(prefix: str, module: torch.nn.Module, packed: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """``module``'s own parameters as checkpoint tensors: a fused parameter (``qkv_proj``,
    ``gate_up_proj``: a key of ``packed``) split along dim 0 by the layer's ``output_sizes`` into
    the checkpoint names, a padded vocabulary cut to ``org_vocab_size``; empty parameters (a CPU
    kernel holds the weight) yield nothing."""
    parent, _, leaf = prefix.rpartition(".")
    sizes = getattr(module, "output_sizes", None)
    for pname, p in module.named_parameters(recurse=False):
        t = p.detach()
        if t.numel() == 0 or t.is_meta:
            continue
        if leaf in packed and sizes is not None and len(sizes) == len(packed[leaf]) and sum(sizes) == t.shape[0]:
            offset = 0
            for sub, size in zip(packed[leaf], sizes):
                yield f"{parent + '.' if parent else ''}{sub}.{pname}", t[offset:offset + size]
                offset += size
        else:
            org = getattr(module, "org_vocab_size", None)
            yield f"{prefix + '.' if prefix else ''}{pname}", (t[:org] if org is not None else t)


LAYERWISE_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


@contextmanager
def _quiet_expected_load_warnings(model: torch.nn.Module) -> Iterator[None]:
    """Drop vLLM's ``<Layer>: Failed to load weights`` warning for the layers that never load
    from a checkpoint: a head whose every parameter is tied to an earlier module's (SmolLM2's
    ``lm_head``, the checkpoint has no tensor for it) and layers holding buffers only
    (``RotaryEmbedding``'s cos/sin cache). vLLM's layerwise reload counts buffers and tied
    parameters as loadable and warns when none arrive, then puts the layer's own tensors back
    (for a tied head: the shared parameter, which the embedding's reload has already updated).
    The warning for any other layer, a real failure, still comes through."""
    seen: set[int] = set()
    never_loads: set[str] = set()
    loads: set[str] = set()  # a class with one instance that loads weights keeps its warning
    for _, module in model.named_modules():
        own = [p for p in module._parameters.values() if p is not None]
        buffers = [b for b in module._buffers.values() if b is not None]
        if (own and all(id(p) in seen for p in own)) or (buffers and not own):
            never_loads.add(type(module).__name__)
        elif own:
            loads.add(type(module).__name__)
        seen.update(id(p) for p in own)
    quiet = never_loads - loads

    def keep(record: logging.LogRecord) -> bool:
        return not (record.msg == "%s: Failed to load weights" and record.args and record.args[0] in quiet)

    logger = logging.getLogger(LAYERWISE_LOGGER)
    logger.addFilter(keep)
    try:
        yield
    finally:
        logger.removeFilter(keep)
