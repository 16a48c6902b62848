"""transformers generation engine: batched sampling with behaviour logprobs.

Samples with temperature and nucleus (top-p) filtering through ``model.generate`` and
recovers each sampled token's log-probability from the raw logits as
``log_softmax(logits / temperature)`` — the same quantity the learner recomputes, so the
importance weight ``exp(logp_old - logp_mu)`` compares like with like (top-p truncation is
not renormalised into the logprob, matching vLLM's processed-logprob convention when
top_p = 1).
"""

from __future__ import annotations

import threading
import time
from typing import Iterable, Optional

import torch

from prorl_async import machine
from prorl_async.engines.base import Completion, SamplingSpec, stop_token_ids
from prorl_async.weight_ipc import IpcWeightReceiver
from prorl_async.weight_sync import WeightSyncGroup, close_group, joined, tensor_checksum
from prorl_async.models import context_length, load_model, load_tokenizer
from prorl_async.receive_memory import check_update_fits


class HFEngine:
    """:class:`~prorl_async.engines.base.Engine` over transformers' ``generate``."""

    def __init__(self, model_path: str, dtype: str = "float32", device: str = "cpu", **_):
        self.tokenizer = load_tokenizer(model_path)
        self.stops = stop_token_ids(model_path, self.tokenizer)  # the ids that end a response (as vLLM's)
        self.model = load_model(model_path, dtype).to(device).eval()
        self.device = device
        self.context = context_length(model_path)  # prompt + response positions the model accepts
        self._lock = threading.Lock()  # weights change only between requests
        self.version = 0                # version of the weights in use
        self.weight_sync_ranks = 1
        self._staged: Optional[tuple[int, list]] = None  # (version, [(name, tensor)]) received, not yet applied
        self._sync = None
        self.update_bytes = 0  # what one update holds until applied (checked to fit when the group forms)

    # ------------------------------------------------------------------ generation
    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], spec: SamplingSpec) -> list[list[Completion]]:
        if spec.ignore_eos:
            raise ValueError("SamplingSpec.ignore_eos is supported by the vllm engine only (rollout.engine=vllm)")
        longest = max(map(len, prompt_ids), default=0)
        if self.context is not None and longest + spec.max_new_tokens > self.context:
            raise ValueError(f"a prompt of {longest} tokens + max_new_tokens {spec.max_new_tokens} exceeds the model's "
                             f"context of {self.context}; a run drops such rows when it loads its data "
                             f"(prorl_async.engines.prompts.drop_unfit)")
        self._apply_staged()
        version = self.version
        tok = self.tokenizer
        flat = [p for p in prompt_ids for _ in range(spec.n)]
        width = max(map(len, flat))
        pad = tok.pad_token_id
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in flat], device=self.device)
        att = (ids != pad).long() if pad is not None else torch.ones_like(ids)
        for i, p in enumerate(flat):  # a prompt may legitimately contain the pad id
            att[i, width - len(p):] = 1
        gen = torch.Generator(device="cpu").manual_seed(spec.seed)
        with self._lock:
            torch.manual_seed(int(torch.randint(0, 2**62, (1,), generator=gen)))
            out = self.model.generate(
                input_ids=ids, attention_mask=att, max_new_tokens=spec.max_new_tokens,
                do_sample=not spec.greedy, temperature=spec.temperature if not spec.greedy else None,
                top_p=spec.top_p if not spec.greedy else None, top_k=0 if not spec.greedy else None,
                pad_token_id=pad, eos_token_id=self.stops,
                output_logits=True, return_dict_in_generate=True)
        seqs = out.sequences[:, width:]
        logits = torch.stack(out.logits, dim=1).float()  # [B, L, V], raw model logits
        temp = 1.0 if spec.greedy else spec.temperature
        logp = torch.log_softmax(logits / temp, dim=-1).gather(-1, seqs[..., None]).squeeze(-1)
        completions: list[Completion] = []
        for row, lp in zip(seqs.tolist(), logp.tolist()):
            end = next((i + 1 for i, t in enumerate(row) if t in self.stops), 0)  # through the first stop token
            if end:
                completions.append(Completion(row[:end], lp[:end], "stop", version, version, [version] * end))
            else:
                completions.append(Completion(row, lp, "length", version, version, [version] * len(row)))
        return [completions[i * spec.n:(i + 1) * spec.n] for i in range(len(prompt_ids))]

    def abort(self) -> None:
        """Nothing to do: ``model.generate`` cannot be interrupted, a request runs to its end."""

    # ------------------------------------------------------------------ weights
    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        return list(self.model.named_parameters())

    def init_weight_sync(self, host: str, port: int, rank: int, world_size: int, backend: str = "gloo",
                         timeout_s: float = 120.0) -> str:
        """Join the weight-sync group as ``rank``; returns the dtype this engine announces.

        Received buffers live where the backend moves them (NCCL: this engine's GPU), then load
        into the model; the engine announces its dtype so the sender casts on its side (bf16 on
        the wire for bf16). ``ipc``: no group; the learner's handles arrive with each update."""
        close_group(self._sync)  # a re-formed group: the old one's communicator and sockets go first
        dtype = next(t.dtype for _, t in self.named_tensors() if t.is_floating_point())
        shapes = [(n, tuple(t.shape), t.dtype) for n, t in self.named_tensors()]
        if backend == "ipc":  # the staged copy of the learner's tensors
            self.update_bytes = check_update_fits(shapes, str(self.device), 1, "the HF engine")
            self._sync = IpcWeightReceiver(rank, str(self.device), wire_dtype=dtype)
        else:  # the received buckets and the staged copy
            device = str(self.device) if backend == "nccl" else "cpu"
            self.update_bytes = check_update_fits(shapes, device, 2, "the HF engine")
            self._sync = WeightSyncGroup(host, port, rank, world_size, backend, timeout_s, wire_dtype=dtype,
                                         device=device)
        return str(dtype).removeprefix("torch.")

    def receive_weights(self, payload: Optional[dict] = None) -> dict:
        """Receive one update into staging; applied at the next request boundary. ``payload``:
        the learner's handles (ipc), copied here, so the learner may free its snapshot."""
        shapes = [(n, tuple(t.shape), t.dtype) for n, t in self.named_tensors()]
        t0 = time.perf_counter()
        sync = joined(self._sync)
        version, tensors = sync.receive(payload, shapes) if payload is not None else sync.receive(shapes)
        with self._lock:
            self._staged = (version, [(n, t.clone()) for n, t in tensors])
        del tensors  # an ipc mapping of the learner's memory ends here
        return {"version": version, "seconds": time.perf_counter() - t0, "applied": False}

    def _apply_staged(self) -> None:
        with self._lock:
            staged, self._staged = self._staged, None
        if staged is not None:
            self.load_weights(staged[1])
            self.version = staged[0]
            del staged
            machine.release_freed_heap()  # the staged copy was freed below live blocks

    def weights_checksum(self) -> tuple[int, int]:
        """(version, checksum) of the weights in use; applies staged weights first."""
        self._apply_staged()
        return self.version, tensor_checksum([t.detach() for _, t in self.named_tensors()])

    @torch.no_grad()
    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.model.named_parameters())
        with self._lock:
            for name, t in tensors:
                params[name].copy_(t)
